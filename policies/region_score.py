"""Region-aware placement scoring: the expected dollars to finish a job's remaining work in a pool.

Cost = price x GPUs x hours, the hours stretched by expected rework from preemptions (prior from
the Spot Advisor blended with what the broker observed), plus the one-off cost of moving: a restart
and the checkpoint's egress when it lives in another region or cloud, plus, for a job that writes
its checkpoints to a bucket in a fixed region, the egress of every checkpoint written from a pool
elsewhere. A running job moves only when
the saving beats a stickiness margin, so jobs are not moved for pennies.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field

from policies.migration import Blocklist, location_keys
from policies.models import Market, Pool

HOURS_PER_MONTH = 730.0
# The prior counts as this many node-hours of the broker's own observation (a day of one node):
# enough that a few lucky hours do not erase a pool's bad record, few enough that a week of the
# broker's own reclaims outweighs it (``SchedulerConfig.prior_weight_h``).
PRIOR_WEIGHT_H = 24.0
DEFAULT_RESTART_S = 60.0  # a relaunch: node start, setup, checkpoint restore
DEFAULT_CHECKPOINT_INTERVAL_S = 100.0  # the job spec's default (policies.models.CheckpointSpec)


class Egress(BaseModel):
    """Checkpoint transfer prices in USD per GB (list prices of the big three, rounded)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    same_region: float = Field(default=0.0, ge=0, description="USD/GB inside one region")
    same_cloud: float = Field(default=0.02, ge=0,
                              description="USD/GB inter-region inside one cloud")
    cross_cloud: float = Field(default=0.09, ge=0, description="USD/GB internet egress")

    def per_gb(self, src_cloud: str | None, src_region: str | None, dst: Pool) -> float:
        if src_cloud is None:
            return 0.0
        if src_cloud != dst.cloud:
            return self.cross_cloud
        return self.same_region if src_region == dst.region else self.same_cloud


class Candidate(BaseModel):
    """A pool with what is known about its risk and headroom."""

    model_config = ConfigDict(frozen=True)

    pool: Pool
    prior_monthly_rate: float = Field(default=0.0, ge=0, le=1, description="Spot Advisor bucket")
    preemptions_seen: int = Field(default=0, ge=0)
    node_hours_seen: float = Field(default=0.0, ge=0)
    prior_weight_h: float = Field(default=PRIOR_WEIGHT_H, gt=0, description="node-hours of "
                                  "observation the prior counts as")
    free_gpus: int | None = Field(default=None, ge=0, description="quota/capacity headroom")


class JobNeeds(BaseModel):
    """What placement must know about one job (its whole gang goes to one pool, one region)."""

    model_config = ConfigDict(frozen=True)

    gpus: int = Field(ge=1)
    remaining_h: float = Field(ge=0)
    restart_h: float = Field(default=DEFAULT_RESTART_S / 3600, ge=0)
    checkpoint_interval_h: float = Field(default=DEFAULT_CHECKPOINT_INTERVAL_S / 3600, ge=0)
    checkpoint_gb: float = Field(default=0.0, ge=0)
    checkpoint_cloud: str | None = None  # where the checkpoint to restore is (None: none yet)
    checkpoint_region: str | None = None
    # Where the job writes its checkpoints when that is a fixed bucket (the spec's
    # ``checkpoint.region``); None: next to where it runs, no transfer.
    bucket_cloud: str | None = None
    bucket_region: str | None = None
    current_pool: str | None = None
    allow: list[str] = Field(default_factory=lambda: ["*"])
    deny: list[str] = Field(default_factory=list)
    markets: frozenset[Market] = frozenset({Market.SPOT, Market.ON_DEMAND})


class Stickiness(BaseModel):
    """Move a running job only if it saves more than both margins over its remaining work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_saving_usd: float = Field(default=1.0, ge=0, description="USD a move must save at least")
    min_saving_fraction: float = Field(default=0.1, ge=0, le=1, description="share of the "
                                       "job's remaining cost a move must save at least")

    def threshold(self, current_cost: float) -> float:
        return max(self.min_saving_usd, self.min_saving_fraction * current_cost)

    def keeps(self, current_cost: float, best_cost: float) -> bool:
        """Does a running job stay where it costs ``current_cost`` rather than move to a pool
        where it costs ``best_cost`` (the move's restart and egress included)?"""
        return current_cost - best_cost < self.threshold(current_cost)


def hazard_per_hour(c: Candidate) -> float:
    """Preemptions per node-hour: a Gamma-Poisson blend of the prior and the observed rate."""
    if c.pool.market is Market.ON_DEMAND:
        return 0.0
    prior = -math.log1p(-min(c.prior_monthly_rate, 0.999)) / HOURS_PER_MONTH
    w = c.prior_weight_h
    return (prior * w + c.preemptions_seen) / (w + c.node_hours_seen)


def eligible(needs: JobNeeds, c: Candidate, blocklist: Blocklist | None, now: float) -> bool:
    pool = c.pool
    name = f"{pool.cloud}:{pool.region}"
    if not any(fnmatchcase(name, p) for p in needs.allow) or any(
        fnmatchcase(name, p) for p in needs.deny
    ):
        return False
    if pool.market not in needs.markets:
        return False
    room = pool.capacity if c.free_gpus is None else min(c.free_gpus, pool.capacity)
    if pool.id == needs.current_pool:
        room += needs.gpus  # the job's own GPUs are not "used" against itself
    if room < needs.gpus:
        return False
    return blocklist is None or not any(blocklist.is_blocked(k, now) for k in location_keys(pool))


def expected_cost(needs: JobNeeds, c: Candidate, egress: Egress | None = None) -> float:
    """Expected USD to finish the remaining work in ``c``, including the move there."""
    egress = egress or Egress()
    rate = c.pool.price_per_gpu_hour * needs.gpus
    lost_per_preemption = needs.checkpoint_interval_h / 2 + needs.restart_h
    hours = needs.remaining_h * (1 + hazard_per_hour(c) * lost_per_preemption)
    move = 0.0
    if c.pool.id != needs.current_pool:
        transfer = egress.per_gb(needs.checkpoint_cloud, needs.checkpoint_region, c.pool)
        move = needs.restart_h * rate + transfer * needs.checkpoint_gb
    writes = 0.0
    if needs.checkpoint_interval_h > 0:  # one checkpoint per interval crosses to the bucket
        writes = hours / needs.checkpoint_interval_h * needs.checkpoint_gb * \
            egress.per_gb(needs.bucket_cloud, needs.bucket_region, c.pool)
    return rate * hours + move + writes
