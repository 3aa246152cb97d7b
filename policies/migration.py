"""Preemption-aware location choice after SpotHedge (EuroSys'25), with a decaying blocklist.

A location (``cloud:region`` or ``cloud:region/zone``) that loses a node is marked preempted; a
launch goes to the cheapest active location not in use; when fewer than two remain active, all are
reset to active. Marks also decay after ``decay_s`` so a reclaimed location comes back on its own.
A launch the cloud refused (stock-out, quota) blocks that one pool (not a location: V100 spot
being out says nothing of A100, nor of on-demand) for the shorter ``refusal_decay_s``; SpotHedge's
reset leaves those marks alone. A refusal in one zone of a pool (an AWS spot AZ) marks only that
zone (``refusal_key``): the pool stays usable, its next launch avoids the zone.
The state is a plain pydantic object (JSON round-trip) so the broker can keep it in Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import NamedTuple

from pydantic import BaseModel, Field

from policies.models import Pool

DEFAULT_DECAY_S = 3600.0  # SpotHedge resets on its own rule; the decay bounds how long a mark lasts
DEFAULT_REFUSAL_DECAY_S = 600.0  # a stock-out often clears within minutes; quotas show in capacity
# A reclaim this many seconds or fewer after a launch is an early one; a spot pool with two early
# reclaims within the blocklist's refusal decay is under reclaim (a storm)
QUICK_RECLAIM_S = 300.0


class Blocklist(BaseModel):
    """Preempted locations with the time (seconds, any epoch) they were last marked."""

    locations: list[str] = Field(default_factory=list, description="every location known")
    preempted: dict[str, float] = Field(default_factory=dict)
    decay_s: float = Field(default=DEFAULT_DECAY_S, gt=0)
    refused: dict[str, float] = Field(
        default_factory=dict, description="pool id -> when a launch there was last refused")
    refusal_why: dict[str, str] = Field(
        default_factory=dict, description="pool id -> what was missing (capacity, quota)")
    refusal_decay_s: float = Field(default=DEFAULT_REFUSAL_DECAY_S, gt=0)

    def active(self, now: float) -> list[str]:
        return [loc for loc in self.locations if not self.is_blocked(loc, now)]

    def is_blocked(self, location: str, now: float) -> bool:
        return _fresh(self.preempted.get(location), now, self.decay_s)

    def is_refused(self, pool_id: str, now: float) -> bool:
        return _fresh(self.refused.get(pool_id), now, self.refusal_decay_s)

    def refused_until(self, pool_id: str) -> float | None:
        """When the refusal mark on ``pool_id`` lapses (``None``: never marked)."""
        marked = self.refused.get(pool_id)
        return None if marked is None else marked + self.refusal_decay_s


def _fresh(marked: float | None, now: float, decay_s: float) -> bool:
    return marked is not None and now - marked < decay_s


def register(state: Blocklist, locations: Iterable[str]) -> Blocklist:
    """Add locations (keeps order, no duplicates)."""
    known = list(state.locations)
    known += [loc for loc in dict.fromkeys(locations) if loc not in known]
    return state.model_copy(update={"locations": known})


def mark_preempted(state: Blocklist, location: str, now: float) -> Blocklist:
    """A node was lost in ``location``: block it, and reset all if fewer than two stay active."""
    state = register(state, [location])
    state = state.model_copy(update={"preempted": {**state.preempted, location: now}})
    return _reset_if_starved(state, now)


def mark_launched(state: Blocklist, location: str) -> Blocklist:
    """A launch succeeded in ``location``: capacity is back there, so it is active again."""
    return state.model_copy(
        update={"preempted": {k: v for k, v in state.preempted.items() if k != location}}
    )


def mark_refused(state: Blocklist, pool_id: str, now: float, why: str = "") -> Blocklist:
    """The cloud refused a launch in ``pool_id`` for want of ``why`` (capacity, quota): block
    that pool."""
    return state.model_copy(update={"refused": {**state.refused, pool_id: now},
                                    "refusal_why": {**state.refusal_why, pool_id: why}})


class Reclaimed(NamedTuple):
    """What one spot reclaim did to the blocklist (``mark_reclaimed``)."""

    blocklist: Blocklist
    early: bool  # within ``quick_reclaim_s`` of the launch: the pool's last early reclaim is now
    backoff: bool  # the pool's second early reclaim within the refusal decay: it is refused


def mark_reclaimed(state: Blocklist, pool: Pool, now: float, ran_s: float | None,
                   last_early: float | None,
                   quick_reclaim_s: float = QUICK_RECLAIM_S) -> Reclaimed:
    """A spot reclaim of a job that ran ``ran_s`` in ``pool`` (None: unknown), whose last early
    reclaim was at ``last_early``: the pool's locations (its region and, where it has one, its
    zone: a reclaim says the region is short too) are marked preempted. A pool whose second
    early reclaim this is, within the refusal decay of the first, is under reclaim (a storm):
    it is also marked refused, so nothing is launched there until that mark lapses. The
    preemption mark alone does not hold: SpotHedge resets every mark once fewer than two
    locations stay active, at once in a fleet of two spot regions, and a job then goes back and
    forth between regions that take it away before it trains; the reset leaves refusals alone.
    One early reclaim may be bad luck: it only marks the location, a last resort. The live
    reconciler and the simulator both apply it."""
    for key in location_keys(pool):
        state = mark_preempted(state, key, now)
    early = ran_s is not None and ran_s <= quick_reclaim_s
    backoff = early and last_early is not None and now - last_early < state.refusal_decay_s
    if backoff:
        state = mark_refused(state, refusal_key(pool.id), now,
                             f"under reclaim: took back two launches within "
                             f"{quick_reclaim_s:g} s of their start")
    return Reclaimed(state, early, backoff)


def refusal_key(pool_id: str, zone: str | None = None) -> str:
    """The refusal mark's key: the pool's id, or ``pool@zone`` for one zone of it (no pool id
    holds an ``@``, so a zone's mark never blocks the whole pool)."""
    return pool_id if zone is None else f"{pool_id}@{zone}"


def refused_zones(state: Blocklist, pool_id: str, now: float) -> tuple[str, ...]:
    """The zones of ``pool_id`` with a fresh refusal mark, in the order they were refused."""
    prefix = refusal_key(pool_id, "")
    marks = sorted((t, k) for k, t in state.refused.items()
                   if k.startswith(prefix) and state.is_refused(k, now))
    return tuple(k.removeprefix(prefix) for _, k in marks)


def expire(state: Blocklist, now: float) -> Blocklist:
    """Drop marks past their decay (keeps the stored object small)."""
    return state.model_copy(update={
        "preempted": {k: t for k, t in state.preempted.items() if state.is_blocked(k, now)},
        "refused": {k: t for k, t in state.refused.items() if state.is_refused(k, now)},
        "refusal_why": {k: w for k, w in state.refusal_why.items() if state.is_refused(k, now)}})


def _reset_if_starved(state: Blocklist, now: float) -> Blocklist:
    if len(state.locations) >= 2 and len(state.active(now)) < 2:
        return state.model_copy(update={"preempted": {}})
    return state


def choose_location(
    state: Blocklist,
    prices: Mapping[str, float],
    in_use: Iterable[str] = (),
    now: float = 0.0,
) -> str | None:
    """The cheapest active location not in use (SpotHedge's rule), among those with a price.

    Falls back to the cheapest active location in use, then to the cheapest of all, so a launch
    always has somewhere to go when any location has a price.
    """
    busy = set(in_use)
    priced = list(prices)
    active = [loc for loc in priced if not state.is_blocked(loc, now)]
    for pool in ([loc for loc in active if loc not in busy], active, priced):
        if pool:
            return min(pool, key=lambda loc: (prices[loc], loc))
    return None


def location_keys(pool: Pool) -> list[str]:
    """The blocklist keys a pool falls under: its region, and its zone when it has one."""
    region = f"{pool.cloud}:{pool.region}"
    return [region, f"{region}/{pool.zone}"] if pool.zone else [region]


class Recovery(StrEnum):
    REPLACE = "replace-node"  # launch replacements in the same pool; survivors keep running
    SHRINK = "shrink"  # go on with the survivors (elastic job); the allocator may grow it later
    MIGRATE = "migrate"  # checkpoint and place the whole job again


def recover_lost_nodes(
    nodes: int,
    lost: int,
    *,
    can_rejoin: bool,
    elastic: bool,
    min_nodes: int = 1,
    replacement_available: bool,
    location_blocked: bool,
) -> Recovery:
    """What to do when ``lost`` of a multi-node job's ``nodes`` are gone.

    Losing one node need not restart the job: when the runtime lets a new node rejoin (torchrun
    elastic rendezvous), replace it in the same pool; a location just marked preempted is a poor
    place for replacements, so an elastic job shrinks onto its survivors instead; only when neither
    works does the whole job move.
    """
    if not 0 < lost <= nodes:
        raise ValueError(f"lost ({lost}) must be between 1 and nodes ({nodes})")
    survivors = nodes - lost
    if not can_rejoin or survivors == 0:
        return Recovery.MIGRATE
    can_shrink = elastic and survivors >= min_nodes
    if replacement_available and not location_blocked:
        return Recovery.REPLACE
    if can_shrink:
        return Recovery.SHRINK
    return Recovery.REPLACE if replacement_available else Recovery.MIGRATE
