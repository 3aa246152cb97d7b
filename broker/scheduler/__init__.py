"""The scheduling round, one program for the live leader loop and ``fleet simulate``.

A round turns a snapshot (jobs with their fitted models, pools with capacity, price and risk,
the clock) into a plan: each waiting job's accelerator type (:mod:`.allocation`), per type the
allocation (``policies.elastic_dp``, over the choices of :mod:`.choices`), placement by
expected cost (``policies.placement``, with the requests of :mod:`.placing`) with a deadline
job's market chosen by Can't Be Late's rule (:mod:`.pacing`), then the diff against what runs
(:mod:`.intents`), written atomically with the leader's fencing token (:mod:`.round`).
"""

from broker.scheduler.choices import (
    job_accelerator,
    job_choices,
    job_model,
    one_gpu_rate,
    samples_per_sec,
)
from broker.scheduler.config import Admission, Policy, SchedulerConfig
from broker.scheduler.intents import WAIT_FOR_SPOT, RoundResult
from broker.scheduler.pacing import (
    WAIT_FOR_ON_DEMAND,
    Paced,
    Placed,
    deadline_job,
    on_demand_choices,
    place_by_deadline,
    requested_choice,
)
from broker.scheduler.placing import (
    Marks,
    blocked_pools,
    checkpoint_gb,
    checkpoint_interval_s,
    lost_work_h,
    placement_request,
    pool_risk,
    refused_pools,
)
from broker.scheduler.round import Scheduler, plan_round

__all__ = [
    "WAIT_FOR_ON_DEMAND", "WAIT_FOR_SPOT", "Admission", "Marks", "Paced", "Placed", "Policy",
    "RoundResult", "Scheduler", "SchedulerConfig", "blocked_pools", "checkpoint_gb",
    "checkpoint_interval_s", "deadline_job", "job_accelerator", "job_choices", "job_model",
    "lost_work_h", "on_demand_choices", "one_gpu_rate", "place_by_deadline", "placement_request",
    "plan_round", "pool_risk", "refused_pools", "requested_choice", "samples_per_sec",
]
