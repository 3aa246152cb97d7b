"""Region placement: map each job's GPU count to one pool (cloud, region, market).

A job's GPUs stay in one pool. Jobs that already run keep their pool when it still has room;
others go to the eligible pool with the lowest expected cost to finish their work there
(``policies.region_score.expected_cost``: price, preemption risk, the move's restart and
checkpoint egress), spot first for ``preferred``, on-demand only for a job that must not be
preempted (``spot: never``, ``policies.spot.must_not_preempt``) and only the ``markets`` the
request allows (the deadline rule's choice); at equal cost the cheaper price, then the lower risk
(on-demand before spot). Then a running job moves into the room left in
another pool only when that saves more than the stickiness margin
(``policies.region_score.Stickiness``) with the move's restart counted; no job is displaced, and
a job that must not be preempted never moves. With no risk or job details every
spot pool is as safe as on-demand and every move costs alike, so the order is the price order.
Allowed/denied regions are ``cloud:region`` globs; ``blocked`` pools (spot locations just
reclaimed, from ``policies.migration``) take no new jobs while any other pool has room for them;
``refused`` pools (the cloud just refused a launch there: stock-out, quota) take none at all, as a
launch there would be refused again.
When fragmentation leaves no pool with
room for a job's GPU count, the job is repaired to the largest smaller count that fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from fnmatch import fnmatchcase

from policies.models import Market, Pool, SpotPolicy
from policies.region_score import (
    DEFAULT_CHECKPOINT_INTERVAL_S,
    DEFAULT_RESTART_S,
    PRIOR_WEIGHT_H,
    Candidate,
    Egress,
    JobNeeds,
    Stickiness,
    expected_cost,
    hazard_per_hour,
)
from policies.spot import must_not_preempt


@dataclass(frozen=True)
class PlacementRequest:
    """``gpus`` is the allocator's choice; ``fallbacks`` smaller acceptable counts, best first.

    The fields from ``remaining_h`` on describe the job for the expected cost: hours of work left
    at ``gpus`` (the default, one hour, compares pools by what an hour costs), what a relaunch
    loses, the checkpoint interval, and the checkpoint's size and location (its egress on a move
    to another region or cloud; ``None`` for a job without one) and the bucket it is written to
    when that stays in one region (each checkpoint written from elsewhere crosses to it).
    ``markets`` are those the job may use this round (the broker narrows them by the deadline
    rule, ``policies.spot``).
    """

    job_id: str
    gpus: int
    fallbacks: Sequence[int] = ()
    current_pool: str | None = None
    current_gpus: int = 0  # what it holds in current_pool now
    spot: SpotPolicy = SpotPolicy.ALLOWED
    allow: Sequence[str] = ("*",)
    deny: Sequence[str] = ()
    blocked: frozenset[str] = frozenset()  # pool ids to avoid (reclaimed spot), unless current
    refused: frozenset[str] = frozenset()  # pool ids not to launch in (refused), unless current
    remaining_h: float = 1.0
    restart_h: float = DEFAULT_RESTART_S / 3600
    checkpoint_interval_h: float = DEFAULT_CHECKPOINT_INTERVAL_S / 3600
    checkpoint_gb: float = 0.0
    checkpoint_cloud: str | None = None
    checkpoint_region: str | None = None
    bucket_cloud: str | None = None
    bucket_region: str | None = None
    markets: frozenset[Market] = frozenset(Market)

    def needs(self, gpus: int) -> JobNeeds:
        """The job as ``policies.region_score`` scores it, at ``gpus`` GPUs."""
        return JobNeeds(gpus=gpus, remaining_h=self.remaining_h, restart_h=self.restart_h,
                        checkpoint_interval_h=self.checkpoint_interval_h,
                        checkpoint_gb=self.checkpoint_gb, checkpoint_cloud=self.checkpoint_cloud,
                        checkpoint_region=self.checkpoint_region,
                        bucket_cloud=self.bucket_cloud, bucket_region=self.bucket_region,
                        current_pool=self.current_pool)


@dataclass(frozen=True)
class PoolRisk:
    """What is known about a pool's preemptions: the prior monthly reclaim rate (Spot Advisor
    bucket) and what the broker itself saw there. Unknown pools count as never reclaimed."""

    prior_monthly_rate: float = 0.0
    preemptions_seen: int = 0
    node_hours_seen: float = 0.0
    prior_weight_h: float = PRIOR_WEIGHT_H  # node-hours of observation the prior counts as


@dataclass(frozen=True)
class PlacementResult:
    pool: str
    gpus: int


@dataclass
class _Free:
    """A pool's GPUs still free in this call, and what ranks it: its candidate for the expected
    cost, then at equal cost (price, hazard, 1 for spot, id)."""

    pool: Pool
    free: int
    candidate: Candidate
    tie: tuple[float, float, int, str]


def _free(pool: Pool, used: int, risk: PoolRisk) -> _Free:
    c = Candidate(pool=pool, **asdict(risk))
    tie = (pool.price_per_gpu_hour, hazard_per_hour(c), int(pool.market is Market.SPOT), pool.id)
    return _Free(pool, pool.capacity - used, c, tie)


def region_allowed(pool: Pool, allow: Sequence[str], deny: Sequence[str]) -> bool:
    name = f"{pool.cloud}:{pool.region}"
    return (any(fnmatchcase(name, pat) for pat in allow)
            and not any(fnmatchcase(name, pat) for pat in deny))


def eligible(pool: Pool, req: PlacementRequest) -> bool:
    if pool.market not in req.markets:
        return False
    if pool.market is Market.SPOT and must_not_preempt(req.spot):
        return False
    if pool.id != req.current_pool and (pool.id in req.blocked or pool.id in req.refused):
        return False
    return region_allowed(pool, req.allow, req.deny)


def place(requests: Sequence[PlacementRequest], pools: Sequence[Pool],
          used: dict[str, int] | None = None, risk: Mapping[str, PoolRisk] | None = None,
          egress: Egress | None = None,
          stickiness: Stickiness | None = None) -> dict[str, PlacementResult | None]:
    """Place every request; ``used`` are GPUs already held per pool by jobs not placed here,
    ``risk`` what is known of each pool's preemptions (by pool id), ``egress`` the transfer
    prices of a checkpoint, ``stickiness`` the saving a running job's move must beat.

    Order: running jobs first, those that keep their size before those that grow or shrink
    (a growing job must not push one that stays out of its pool), then larger jobs first
    (first-fit decreasing keeps big gangs placeable); then running jobs move where that pays
    (``_move``).
    """
    risk, used, egress = risk or {}, used or {}, egress or Egress()
    free = {p.id: _free(p, used.get(p.id, 0), risk.get(p.id, PoolRisk())) for p in pools}
    order = sorted(requests, key=lambda r: (r.current_pool not in free,
                                            r.gpus != r.current_gpus, -r.gpus, r.job_id))
    out: dict[str, PlacementResult | None] = {}
    for req in order:
        out[req.job_id] = None
        for gpus in (req.gpus, *req.fallbacks):
            pool = _pick(req, gpus, free, egress)
            if pool is not None:
                free[pool].free -= gpus
                out[req.job_id] = PlacementResult(pool, gpus)
                break
    margin = stickiness or Stickiness()
    for req in order:
        got = out[req.job_id]
        if got is not None and got.pool == req.current_pool and not must_not_preempt(req.spot):
            out[req.job_id] = PlacementResult(_move(req, got.gpus, free, egress, margin), got.gpus)
    return out


def _pick(req: PlacementRequest, gpus: int, free: dict[str, _Free],
          egress: Egress) -> str | None:
    cur = free.get(req.current_pool or "")
    if cur is not None and cur.free >= gpus and cur.pool.launchable(gpus) and \
            eligible(cur.pool, req):
        return cur.pool.id
    best = _best(req, gpus, _fits(req, gpus, free), egress)
    return None if best is None else best.pool.id


def _move(req: PlacementRequest, gpus: int, free: dict[str, _Free], egress: Egress,
          stickiness: Stickiness) -> str:
    """Where a running job placed in its own pool ends up: the best pool with room now when
    moving there saves more than the stickiness margin over its remaining work (the move's
    restart and egress counted), else its
    own pool. Its own GPUs count as room where it is; the other jobs keep theirs."""
    cur = free[req.current_pool or ""]
    cur.free += gpus
    best = _best(req, gpus, _fits(req, gpus, free), egress) or cur
    needs = req.needs(gpus)
    if best is not cur and stickiness.keeps(
            expected_cost(needs, _sized(cur.candidate, gpus), egress),
            expected_cost(needs, _sized(best.candidate, gpus), egress)):
        best = cur
    best.free -= gpus
    return best.pool.id


def _fits(req: PlacementRequest, gpus: int, free: dict[str, _Free]) -> list[_Free]:
    """Eligible pools with room for ``gpus``."""
    room = [f for f in free.values() if f.free >= gpus and f.pool.launchable(gpus)]
    fits = [f for f in room if eligible(f.pool, req)]
    if not fits and req.blocked:
        # Every pool with room was just reclaimed: better there than waiting out the decay
        # (SpotHedge resets its marks when too few locations stay active). Refused pools stay
        # out: the cloud said no there minutes ago.
        fits = [f for f in room if eligible(f.pool, replace(req, blocked=frozenset()))]
    return fits


def _best(req: PlacementRequest, gpus: int, fits: list[_Free], egress: Egress) -> _Free | None:
    """The cheapest of ``fits`` by expected cost (spot first for ``preferred``)."""
    if len(fits) < 2:
        return fits[0] if fits else None
    needs = req.needs(gpus)
    spot_first = req.spot is SpotPolicy.PREFERRED
    return min(fits, key=lambda f: (
        not (spot_first and f.pool.market is Market.SPOT),
        expected_cost(needs, _sized(f.candidate, gpus), egress), *f.tie))


def _sized(c: Candidate, gpus: int) -> Candidate:
    """The candidate at the price of a ``gpus``-GPU launch (pools whose sizes differ in price)."""
    price = c.pool.price_for(gpus)
    if price == c.pool.price_per_gpu_hour:
        return c
    return c.model_copy(update={"pool": c.pool.model_copy(update={"price_per_gpu_hour": price})})
