"""A fleet with a history, for the dashboard's tests and benchmark: pools in three clouds, jobs
submitted through the API, and their lives recorded through the store's own transitions and
placement intervals (launched, running, preempted and moved, finished, waiting with a reason),
so every page has real records to show.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from broker import transitions
from broker.models import Intent, IntentKind, JobRecord, JobState, Placement
from broker.store import Plan, Store
from policies.models import Accelerator, Market, Pool

POOLS = [
    Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100, market=Market.SPOT,
         nodes=16, gpus_per_node=4, price_per_gpu_hour=0.92),
    Pool(cloud="aws", region="us-west-2", accelerator=Accelerator.V100, market=Market.SPOT,
         nodes=16, gpus_per_node=4, price_per_gpu_hour=1.05),
    Pool(cloud="gcp", region="us-central1", accelerator=Accelerator.V100,
         market=Market.ON_DEMAND, nodes=16, gpus_per_node=4, price_per_gpu_hour=2.48),
    Pool(cloud="azure", region="eastus", accelerator=Accelerator.T4, market=Market.SPOT,
         nodes=32, gpus_per_node=4, price_per_gpu_hour=0.16),
    Pool(cloud="gcp", region="europe-west4", accelerator=Accelerator.T4,
         market=Market.ON_DEMAND, nodes=32, gpus_per_node=4, price_per_gpu_hour=0.35),
]
BY_ID = {p.id: p for p in POOLS}
REFERENCE = {Accelerator.V100: 2.48, Accelerator.T4: 0.35}  # the fleet's on-demand per type
TEAMS = ("ml", "vision", "speech")
WAIT_REASONS = ("allocator gave its GPUs to other jobs",
                "waiting for spot: ahead of its deadline's pace, so no on-demand yet")


def spec_json(i: int, team: str, accelerator: Accelerator) -> dict[str, object]:
    return {"name": f"train-{i}", "run": "python train.py", "team": team,
            "accelerators": [accelerator.value], "gpus": {"min": 1, "max": 8},
            "batch_size": {"min": 32, "max": 512, "default": 64}, "work": {"samples": 10**6}}


def _place(store: Store, job: JobRecord, pool: Pool, gpus: int, start: float) -> JobRecord:
    """Launch ``job`` in ``pool`` (a move when it ran elsewhere), running since ``start``."""
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=0, attempt=job.attempt + 1,
                    gpus=gpus, batch_size=64 * gpus, pool=pool.id)
    plan = Plan()
    transitions.launching(plan, job, intent, nodes=1, moved=job.pool not in (None, pool.id),
                          resized=False)
    store.apply(plan)
    job = _get(store, job.id)
    plan = Plan()
    transitions.running(plan, job, node_ids=[f"{job.id}-n{job.attempt}"], started=start,
                        fence=0)
    plan.open_placement(Placement(
        job_id=job.id, attempt=job.attempt, start=start, pool=pool.id, cloud=pool.cloud,
        region=pool.region, market=pool.market, gpus=gpus, batch_size=64 * gpus,
        price_per_gpu_hour=pool.price_per_gpu_hour,
        ondemand_price_per_gpu_hour=REFERENCE[pool.accelerator]))
    store.apply(plan)
    return _get(store, job.id)


def _close(store: Store, job: JobRecord, state: JobState, reason: str, *,
           preempted: bool = False, noticed: bool = True) -> JobRecord:
    """End the running attempt (its interval closes now): finished, or preempted (``noticed``:
    a notice came first and the job was stopping, else its nodes were just gone)."""
    if preempted and noticed:
        plan = Plan()
        transitions.stopping(plan, job, event="preempted", reason=reason, fence=0,
                             preempted=True)
        store.apply(plan)
        job = _get(store, job.id)
    open_ = next(p for p in store.placements(job.id) if p.end is None)
    plan = Plan()
    code = 0 if not preempted else 75 if noticed else None  # lost nodes report nothing
    transitions.ended(plan, job, state, reason=reason, exit_code=code, fence=0,
                      preempted=preempted and not noticed)
    plan.close_placement(open_.model_copy(update={"end": time.time()}))
    store.apply(plan)
    return _get(store, job.id)


def _get(store: Store, job_id: str) -> JobRecord:
    job = store.get_job(job_id)
    assert job is not None
    return job


def record_fleet(store: Store, submit: Callable[[dict[str, object]], str], jobs: int,
                 seed: int = 7) -> None:
    """Pools, then ``jobs`` jobs submitted with ``submit`` (spec JSON -> job id), each given a
    life by a seeded draw: a fifth wait (three in four with one of the scheduler's reasons,
    the rest with none yet), V100 jobs of the next tenth are reclaimed on spot and run on in
    the other spot region, about a third ran and completed, the rest are running."""
    rng = random.Random(seed)
    store.set_pools(POOLS)
    now = time.time()
    spot_v100 = [p for p in POOLS if p.accelerator is Accelerator.V100 and p.market is Market.SPOT]
    for i in range(jobs):
        team = TEAMS[i % len(TEAMS)]
        accelerator = Accelerator.V100 if i % 2 else Accelerator.T4
        job = _get(store, submit(spec_json(i, team, accelerator)))
        pools = [p for p in POOLS if p.accelerator is accelerator]
        kind = rng.random()
        start = now - rng.uniform(0.5, 12) * 3600
        gpus = rng.choice((1, 2, 4, 8))
        if kind < 0.2:
            if i % 4:
                plan = Plan()
                transitions.noted(plan, job, "waiting", WAIT_REASONS[i % len(WAIT_REASONS)])
                store.apply(plan)
            continue
        if kind < 0.3 and accelerator is Accelerator.V100:  # reclaimed, then moved
            first, second = rng.sample(spot_v100, 2)
            job = _place(store, job, first, gpus, start)
            job = _close(store, job, JobState.SUSPENDED, "spot capacity reclaimed",
                         preempted=True, noticed=rng.random() < 0.5)
            _place(store, job, second, gpus, time.time())
            continue
        job = _place(store, job, rng.choice(pools), gpus, start)
        if kind < 0.6:
            _close(store, job, JobState.COMPLETED, "exit 0")
