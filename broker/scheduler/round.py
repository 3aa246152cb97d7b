"""One scheduling round, for the live leader loop and ``fleet simulate`` alike: snapshot ->
type choice -> per-type allocation and placement -> diff -> one plan written atomically with
the leader's fencing token."""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from broker.models import IntentKind, JobRecord, JobState
from broker.scheduler.allocation import allocate_and_place, choose_types, repair
from broker.scheduler.choices import UsablePools, offered_types, type_choices
from broker.scheduler.config import Admission, SchedulerConfig
from broker.scheduler.intents import (
    RoundResult,
    diff,
    dropped_if_left_out,
    no_pool,
    note,
    on_demand_launches,
    stop,
    unlaunchable,
    wait_for_spot,
)
from broker.scheduler.placing import Marks, blocked_pools, pool_risk, refused_pools
from broker.store import Plan, PoolStats, Snapshot, Store
from broker.waiting import UNSCHEDULABLE, WAITING_STATES, too_big_reason, waiting_for_capacity
from policies.elastic_dp import Choice
from policies.migration import Blocklist
from policies.models import Accelerator, Pool
from policies.placement import PoolRisk
from policies.spot import must_not_preempt


def plan_round(snap: Snapshot, fence: int, config: SchedulerConfig,
               now: float | None = None, *, blocklist: Blocklist | None = None,
               priors: Mapping[str, float] | None = None,
               stats: PoolStats | None = None) -> RoundResult:
    """Decide the round's changes from one snapshot; pure apart from reading the clock. Each
    job waiting for GPUs gets one of the accelerator types its spec accepts (:func:`choose_types`),
    then each type's allocation and placement run on its pools (:func:`_plan_type`). Jobs
    are not placed in spot locations ``blocklist`` holds while other pools have room, nor ever in
    pools it marks refused (they may stay where they run: :class:`Marks`); pools
    are ranked by expected cost with ``priors`` (monthly reclaim rate per pool id; none: 0)
    and the preemptions and node-hours ``stats`` the broker observed."""
    now = time.time() if now is None else now
    res = RoundResult(plan=Plan(wake=False))
    pools_by_id = {p.id: p for p in snap.pools}
    marks = Marks(blocked_pools(snap.pools, blocklist, now),
                  refused_pools(snap.pools, blocklist, now))
    risk = pool_risk(snap.pools, priors, stats or PoolStats(), snap.jobs, now,
                     config.prior_weight_h, config.unknown_reclaim_rate)
    used: dict[str, int] = defaultdict(int)  # GPUs held by jobs this round does not move
    offered: dict[str, list[Accelerator]] = {}
    jobs: list[JobRecord] = []
    usable = UsablePools(snap.pools)

    for job in snap.jobs:
        if job.state in (JobState.LAUNCHING, JobState.SUSPENDING):
            if job.pool:
                used[job.pool] += job.gpus
            continue
        if job.cancel_requested:
            if job.state is JobState.RUNNING:
                stop(res, job, fence, IntentKind.STOP, "cancelled by user")
            continue
        types = offered_types(job, usable)
        if not types:
            if job.state in WAITING_STATES:
                no_pool(res, job, *usable.why_none(job.spec), config)
            continue
        if job.state in WAITING_STATES and (why := too_big_reason(
                job.spec, max(usable.sizes(job.spec, a)[0] for a in types))):
            if job.state is JobState.QUEUED:
                unlaunchable(res, job, types[0], [], config, reason=why)
            else:
                note(res, job, UNSCHEDULABLE, why)
            continue
        offered[job.id] = types
        jobs.append(job)

    pools_of: dict[Accelerator, list[Pool]] = defaultdict(list)
    for p in snap.pools:
        pools_of[p.accelerator].append(p)
    room = usable.room = {p.id: max(0, p.capacity - used.get(p.id, 0)) for p in snap.pools}
    # Running jobs first so the allocator's tie-break favours keeping them.
    jobs.sort(key=lambda j: (j.state is not JobState.RUNNING, -j.spec.priority, j.submitted_at,
                             j.id))
    alike: dict[tuple, tuple[Choice, ...]] = {}
    choices = {(j.id, a): type_choices(j, a, usable, config, alike)
               for j in jobs for a in offered[j.id]}
    by_accel: dict[Accelerator, list[JobRecord]] = defaultdict(list)
    types = choose_types(jobs, offered, choices, pools_of, room)
    for job in jobs:
        by_accel[types.get(job.id, offered[job.id][0])].append(job)
    for accel, group in by_accel.items():
        _plan_type(res, accel, group, {j.id: choices[j.id, accel] for j in group},
                   pools_of[accel], pools_by_id, used, risk, marks, config, fence, now)
    return res


def _plan_type(res: RoundResult, accel: Accelerator, jobs: list[JobRecord],
               choices: dict[str, list[Choice]], pools: list[Pool],
               pools_by_id: dict[str, Pool], used: Mapping[str, int],
               risk: Mapping[str, PoolRisk], marks: Marks, config: SchedulerConfig, fence: int,
               now: float) -> None:
    """One accelerator type's allocation, placement and diff against what runs."""
    capacity = max(0, sum(p.capacity - used.get(p.id, 0) for p in pools))
    counts = None if any(p.gpu_counts is None for p in pools) else {
        g for p in pools for g in p.gpu_counts or ()}
    unfit = [j for j in jobs if counts is not None and j.state is JobState.QUEUED
             and not any(j.spec.gpus.min <= n <= j.spec.gpus.max for n in counts)]
    for j in unfit:
        unlaunchable(res, j, accel, sorted(counts or ()), config)
    never = [j for j in jobs if j.state is JobState.QUEUED and j not in unfit
             and must_not_preempt(j.spec.spot) and not on_demand_launches(j, pools)]
    for j in never:
        g = j.spec.gpus
        unlaunchable(res, j, accel, [], config, reason=(
            f"spot: never runs on on-demand only, and no on-demand {accel.value} pool in its "
            f"regions launches {g.min}-{g.max} GPUs; allow spot, or widen gpus or regions"))
    unfit += never
    if config.admission is Admission.DROP:  # dropped now: one change per job and plan
        jobs = [j for j in jobs if j not in unfit]
    placed = allocate_and_place(res, jobs, choices, capacity, pools, pools_by_id, used,
                                 risk, marks, config, now, accel)
    placed = repair(res, jobs, choices, placed, pools, pools_by_id, used, risk, marks, config,
                     now, accel)
    # GPUs free right now: running jobs hold theirs until they have checkpointed, so a
    # launch into GPUs a resizing job still holds waits for a later round.
    free_now = {p.id: p.capacity - used.get(p.id, 0) for p in pools}
    for job in jobs:
        if job.state is JobState.RUNNING and job.pool in free_now:
            free_now[job.pool] -= job.gpus
    for job in jobs:
        where = placed.where.get(job.id)
        target = None
        if where is not None:
            batch = next(x.batch_size for x in choices[job.id] if x.gpus == where.gpus)
            target = (where.pool, where.gpus, batch)
            if job.state is not JobState.RUNNING:
                if free_now[where.pool] < where.gpus:
                    # deferred, not dropped: it waits for the GPUs to free up
                    note(res, job, "waiting", f"waiting for capacity: {where.gpus} GPUs of "
                         f"{where.pool} free up once the jobs there have checkpointed")
                    continue
                free_now[where.pool] -= where.gpus
        if job.id in placed.waits:
            wait_for_spot(res, job, fence)
            continue
        if target is None and job.state is not JobState.RUNNING and job not in unfit and \
                not dropped_if_left_out(job, config):
            note(res, job, "waiting", placed.notes.get(job.id) or waiting_for_capacity(accel))
        diff(res, job, target, fence, config, pools_by_id, now)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Holds the cyclic garbage collector off for one round. A round parses and derives
    hundreds of thousands of short-lived, acyclic objects (reference counting frees them), and
    every full collection they trigger walks the whole heap, the cached records included: at
    10,000 jobs that was half of a round's time. Collection resumes when the round ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Scheduler:
    """Runs rounds against the store under a fencing token. ``priors`` gives each pool's
    monthly reclaim rate (``FleetProvider.interruption_priors``; without it, 0 everywhere)."""

    def __init__(self, store: Store, config: SchedulerConfig | None = None,
                 priors: Callable[[Sequence[Pool]], Mapping[str, float]] | None = None,
                 blocklist_decay_s: float | None = None,
                 refusal_decay_s: float | None = None) -> None:
        self.store = store
        self.config = config or SchedulerConfig()
        self.priors = priors
        # None: what the stored blocklist says
        self.blocklist_decay_s = blocklist_decay_s
        self.refusal_decay_s = refusal_decay_s

    def run_round(self, fence: int) -> RoundResult:
        """Snapshot, plan, apply atomically. A conflict (a job changed meanwhile) leaves
        everything as it was; the next round re-plans from fresh state."""
        with paused_gc():
            snap = self.store.snapshot()
            blocklist, _ = self.store.blocklist(self.blocklist_decay_s, self.refusal_decay_s)
            res = plan_round(snap, fence, self.config, blocklist=blocklist,
                             priors=self.priors(snap.pools) if self.priors else None,
                             stats=self.store.pool_stats())
            if not res.plan.empty():
                self.store.apply(res.plan, fence=fence)
        return res
