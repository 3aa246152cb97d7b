"""The live round's settings: policy, admission and the costs it weighs."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from policies.region_score import DEFAULT_RESTART_S, PRIOR_WEIGHT_H, Egress, Stickiness

# Seconds of training an in-place resize of the demo job loses: the larger of the grow (0.24 s)
# and shrink (0.06 s) medians of ``python -m tests.bench resize`` (examples/results/resize.json,
# 2026-12-04); the same run's checkpoint-and-relaunch path lost 15-17 s.
RESIZE_IN_PLACE_S = 0.24


class Policy(StrEnum):
    ELASTIC = "elastic"  # the allocator picks GPU count and batch size
    FIXED_BATCH = "fixed-batch"  # GPU count scales, batch stays at the spec's initial size
    STATIC = "static"  # gpus.min at the initial batch, never rescaled once running


class Admission(StrEnum):
    QUEUE = "queue"  # a job that does not fit waits
    DROP = "drop"  # a job that does not fit in the round it arrives is dropped (seed paper)


class SchedulerConfig(BaseModel):
    """The round's settings (the ``scheduler`` section of the broker config)."""

    model_config = ConfigDict(extra="forbid")

    policy: Policy = Field(default=Policy.ELASTIC, description="elastic: the allocator picks "
                           "GPU count and batch size; fixed-batch: GPU count scales, the batch "
                           "stays the spec's initial one; static: gpus.min at the initial batch, "
                           "never rescaled")
    admission: Admission = Field(default=Admission.QUEUE, description="queue: a job that does "
                                 "not fit waits; drop: it is dropped in the round it arrives")
    speedup_exponent: float = Field(
        default=0.25, gt=0, le=1, description="a job's value is its speed-up over one GPU to this "
        "power: concave, so a waiting job's first GPUs are worth more than a large job's "
        "super-linear gain from more (1: plain throughput)")
    restart_horizon_s: float = Field(
        default=1800.0, gt=0, description="how long a plan is expected to hold: a running job's "
        "current config is favoured by the share of it a restart loses (restart_s / this)")
    min_rescale_interval_s: float = Field(
        default=30.0, ge=0, description="a job keeps its config at least this long after start")
    max_failures: int = Field(default=3, ge=0, description="failed attempts before 'failed'")
    restart_s: float = Field(
        default=DEFAULT_RESTART_S, ge=0, description="what a relaunch costs (node start, setup, "
        "checkpoint restore): placement prices it into a move and into every preemption")
    resize_in_place_s: float = Field(
        default=RESIZE_IN_PLACE_S, ge=0, description="what a resize costs a job that its node "
        "takes in place (the runtime re-forms the group without a restart; "
        "docs/runtime.md): the allocator favours its current size over such a size by this "
        "only, over any other by restart_s")
    checkpoint_gb: float = Field(
        default=0.0, ge=0, description="checkpoint size assumed for egress on a move to another "
        "region or cloud for a job whose agent has not reported its checkpoint's size yet")
    egress: Egress = Field(default_factory=Egress, description="checkpoint transfer prices")
    reaction_s: float = Field(
        default=6.0, ge=0, description="from a preemption to the broker's relaunch decision (a "
        "heartbeat, 5 s, and a loop tick, 1 s, by default): the deadline rule counts it with "
        "restart_s and a checkpoint interval in what one preemption can cost")
    checkpoint_on_notice: bool = Field(
        default=False, description="jobs checkpoint on the preemption notice (FleetBroker's "
        "agent does: AWS warns 2 min ahead, GCP and Azure 30 s), so a preemption loses no work "
        "since the last checkpoint; placement and the deadline rule then price a preemption as "
        "its reaction and restart only")
    prior_weight_h: float = Field(
        default=PRIOR_WEIGHT_H, gt=0, description="how many node-hours of the broker's own "
        "observation a pool's prior reclaim rate (Spot Advisor, or unknown_reclaim_rate) "
        "counts as, when the two are blended into the pool's expected preemptions per hour")
    unknown_reclaim_rate: float = Field(
        default=0.15, ge=0, le=1, description="the monthly reclaim fraction assumed for a pool "
        "the AWS Spot Advisor has no figure for (GCP, Azure, local spot regions, unlisted "
        "types): a middling advisor bucket (10-15% and 15-20% per month) until the broker's "
        "own preemption counts outweigh it")
    move_margin: Stickiness = Field(
        default_factory=Stickiness, description="the saving a running job's move to a cheaper "
        "pool must beat (its restart counted): max(min_saving_usd, min_saving_fraction x cost)")
