"""Region placement: map each job's GPU count to one pool (cloud, region, market).

A job's GPUs stay in one pool. Jobs that already run keep their pool when it still has room (no
churn); others go to the cheapest eligible pool (spot first for ``preferred``, on-demand only
for ``never``; at equal price on-demand before spot, as it carries no preemption risk).
Allowed/denied regions are ``cloud:region`` globs; ``blocked`` pools (spot locations just
reclaimed, from ``policies.migration``) take no new jobs. When fragmentation leaves no pool with
room for a job's GPU count, the job is repaired to the largest smaller count that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from policies.models import Market, Pool, SpotPolicy


@dataclass(frozen=True)
class PlacementRequest:
    """``gpus`` is the allocator's choice; ``fallbacks`` smaller acceptable counts, best first."""

    job_id: str
    gpus: int
    fallbacks: Sequence[int] = ()
    current_pool: str | None = None
    spot: SpotPolicy = SpotPolicy.ALLOWED
    allow: Sequence[str] = ("*",)
    deny: Sequence[str] = ()
    blocked: frozenset[str] = frozenset()  # pool ids to avoid (reclaimed spot), unless current


@dataclass(frozen=True)
class PlacementResult:
    pool: str
    gpus: int


@dataclass
class _Free:
    pool: Pool
    free: int = field(default=0)


def region_allowed(pool: Pool, allow: Sequence[str], deny: Sequence[str]) -> bool:
    name = f"{pool.cloud}:{pool.region}"
    return (any(fnmatchcase(name, pat) for pat in allow)
            and not any(fnmatchcase(name, pat) for pat in deny))


def eligible(pool: Pool, req: PlacementRequest) -> bool:
    if req.spot is SpotPolicy.NEVER and pool.market is Market.SPOT:
        return False
    if pool.id in req.blocked and pool.id != req.current_pool:
        return False
    return region_allowed(pool, req.allow, req.deny)


def _cost_key(pool: Pool, spot: SpotPolicy) -> tuple[int, float, int, str]:
    spot_rank = 0 if (spot is SpotPolicy.PREFERRED and pool.market is Market.SPOT) else 1
    risk = 1 if pool.market is Market.SPOT else 0
    return (spot_rank, pool.price_per_gpu_hour, risk, pool.id)


def place(requests: Sequence[PlacementRequest], pools: Sequence[Pool],
          used: dict[str, int] | None = None) -> dict[str, PlacementResult | None]:
    """Place every request; ``used`` are GPUs already held per pool by jobs not placed here.

    Order: jobs staying in their current pool first, then larger jobs first (first-fit
    decreasing keeps big gangs placeable).
    """
    free = {p.id: _Free(p, p.capacity - (used or {}).get(p.id, 0)) for p in pools}
    order = sorted(requests, key=lambda r: (r.current_pool not in free, -r.gpus, r.job_id))
    out: dict[str, PlacementResult | None] = {}
    for req in order:
        out[req.job_id] = None
        for gpus in (req.gpus, *req.fallbacks):
            pool = _pick(req, gpus, free)
            if pool is not None:
                free[pool].free -= gpus
                out[req.job_id] = PlacementResult(pool, gpus)
                break
    return out


def _pick(req: PlacementRequest, gpus: int, free: dict[str, _Free]) -> str | None:
    cur = free.get(req.current_pool or "")
    if cur is not None and cur.free >= gpus and eligible(cur.pool, req):
        return cur.pool.id
    fits = [f.pool for f in free.values() if f.free >= gpus and eligible(f.pool, req)]
    if not fits:
        return None
    return min(fits, key=lambda p: _cost_key(p, req.spot)).id
