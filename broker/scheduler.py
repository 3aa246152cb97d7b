"""One scheduling round: snapshot -> per-accelerator allocation (``policies.elastic_dp``) ->
placement (``policies.placement``) -> diff against what runs -> a plan of job transitions and
intents written atomically with the leader's fencing token.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, Field

from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.store import Plan, Snapshot, Store
from policies.elastic_dp import Choice, InfeasibleAllocation, JobChoices, allocate
from policies.migration import Blocklist, location_keys
from policies.models import Accelerator, Market, Pool
from policies.placement import PlacementRequest, place
from policies.throughput import ThroughputModel, batch_candidates

log = logging.getLogger(__name__)


class Policy(StrEnum):
    ELASTIC = "elastic"  # the allocator picks GPU count and batch size
    FIXED_BATCH = "fixed-batch"  # GPU count scales, batch stays at the spec's initial size
    STATIC = "static"  # gpus.min at the initial batch, never rescaled once running


class Admission(StrEnum):
    QUEUE = "queue"  # a job that does not fit waits
    DROP = "drop"  # a job that does not fit in the round it arrives is dropped (seed paper)


class SchedulerConfig(BaseModel):
    policy: Policy = Policy.ELASTIC
    admission: Admission = Admission.QUEUE
    stickiness: float = Field(default=0.1, ge=0, description="bonus on a running job's config")
    min_rescale_interval_s: float = Field(
        default=30.0, ge=0, description="a job keeps its config at least this long after start")
    max_failures: int = Field(default=3, ge=0, description="failed attempts before 'failed'")


@dataclass
class RoundResult:
    plan: Plan
    launches: int = 0
    resizes: int = 0
    migrations: int = 0
    suspends: int = 0
    stops: int = 0
    dropped: int = 0
    solve_s: float = 0.0
    changed: list[str] = field(default_factory=list)


def job_choices(job: JobRecord, policy: Policy, max_gpus: int,
                model: ThroughputModel | None = None) -> list[Choice]:
    """Each GPU count's best batch size and its value (speed-up over one GPU)."""
    spec = job.spec
    pgm = spec.batch_size.per_gpu_max
    model = (model or ThroughputModel()).calibrated(
        job.measured_gpus, job.measured_batch_size, job.samples_per_sec, pgm)
    fixed = policy is not Policy.ELASTIC or spec.batch_mode.value == "fixed"
    lo, hi = spec.gpus.min, min(spec.gpus.max, max_gpus)
    if policy is Policy.STATIC:
        hi = min(hi, lo)
    b = spec.batch_size
    measured = tuple(sorted(job.measured.items()))
    return list(_choice_table(lo, hi, b.min, b.max, b.initial, pgm, fixed, spec.priority, model,
                              measured))


@functools.lru_cache(maxsize=65_536)
def _choice_table(lo: int, hi: int, bmin: int, bmax: int, binit: int, pgm: int | None,
                  fixed: bool, priority: int, model: ThroughputModel,
                  measured: tuple[tuple[str, float], ...] = ()) -> tuple[Choice, ...]:
    """Choices depend only on these numbers; jobs of the same shape share one table. Where the
    job's agent measured a configuration, the measurement replaces the model's estimate."""
    seen = dict(measured)

    def tput(g: int, x: int) -> float:
        return seen.get(f"{g}x{x}") or model.throughput(g, x, pgm)

    def batches(g: int) -> list[int]:
        if fixed:
            return [binit] if binit >= g else []
        return batch_candidates(bmin, bmax, g)

    base = max((tput(1, x) for x in batches(1)), default=0.0) or tput(1, binit)
    weight = 2.0 ** (priority / 25.0)
    out = []
    for g in range(lo, hi + 1):
        options = batches(g)
        if not options:
            continue
        best = max(options, key=lambda x, g=g: tput(g, x))
        out.append(Choice(g, best, weight * tput(g, best) / base))
    return tuple(out)


def _accelerator(job: JobRecord, pools_by_id: dict[str, Pool],
                 available: set[Accelerator]) -> Accelerator | None:
    if job.state is JobState.RUNNING and job.pool in pools_by_id:
        return pools_by_id[job.pool].accelerator
    return next((a for a in job.spec.accelerators if a in available), None)


def blocked_pools(pools: list[Pool], blocklist: Blocklist | None, now: float) -> frozenset[str]:
    """Spot pools in a location the blocklist holds (a reclaim says nothing about on-demand)."""
    if blocklist is None:
        return frozenset()
    return frozenset(p.id for p in pools if p.market is Market.SPOT and
                     any(blocklist.is_blocked(k, now) for k in location_keys(p)))


def plan_round(snap: Snapshot, fence: int, config: SchedulerConfig,
               now: float | None = None, *, blocklist: Blocklist | None = None) -> RoundResult:
    """Decide the round's changes from one snapshot; pure apart from reading the clock. Jobs
    are not placed in spot locations ``blocklist`` holds (they may stay where they run)."""
    now = time.time() if now is None else now
    res = RoundResult(plan=Plan(wake=False))
    pools_by_id = {p.id: p for p in snap.pools}
    blocked = blocked_pools(snap.pools, blocklist, now)
    available = {p.accelerator for p in snap.pools if p.capacity > 0}
    used: dict[str, int] = defaultdict(int)  # GPUs held by jobs this round does not move
    by_accel: dict[Accelerator, list[JobRecord]] = defaultdict(list)

    for job in snap.jobs:
        if job.state in (JobState.LAUNCHING, JobState.SUSPENDING):
            if job.pool:
                used[job.pool] += job.gpus
            continue
        if job.cancel_requested:
            if job.state is JobState.RUNNING:
                _stop(res, job, fence, IntentKind.STOP, "cancelled by user")
            continue
        accel = _accelerator(job, pools_by_id, available)
        if accel is None:
            if config.admission is Admission.DROP and job.state is JobState.QUEUED:
                _drop(res, job, "no pool offers its accelerators")
            continue
        by_accel[accel].append(job)

    for accel, jobs in by_accel.items():
        pools = [p for p in snap.pools if p.accelerator is accel]
        capacity = max(0, sum(p.capacity - used.get(p.id, 0) for p in pools))
        # Running jobs first so the allocator's tie-break favours keeping them.
        jobs.sort(key=lambda j: (j.state is not JobState.RUNNING, -j.spec.priority,
                                 j.submitted_at, j.id))
        choices = {j.id: job_choices(j, config.policy, capacity) for j in jobs}
        t0 = time.perf_counter()
        chosen = _allocate(jobs, choices, capacity, pools_by_id, config, now)
        res.solve_s += time.perf_counter() - t0
        requests = []
        for job in jobs:
            c = chosen.get(job.id)
            if c is None:
                continue
            fallbacks = sorted((x.gpus for x in choices[job.id] if x.gpus < c.gpus), reverse=True)
            requests.append(PlacementRequest(
                job.id, c.gpus, fallbacks,
                job.pool if job.state is JobState.RUNNING else None,
                job.spec.spot, job.spec.regions.allow, job.spec.regions.deny, blocked))
        placed = place(requests, pools, used)
        # GPUs free right now: running jobs hold theirs until they have checkpointed, so a
        # launch into GPUs a resizing job still holds waits for a later round.
        free_now = {p.id: p.capacity - used.get(p.id, 0) for p in pools}
        for job in jobs:
            if job.state is JobState.RUNNING and job.pool in free_now:
                free_now[job.pool] -= job.gpus
        for job in jobs:
            where = placed.get(job.id)
            target = None
            if where is not None:
                batch = next(x.batch_size for x in choices[job.id] if x.gpus == where.gpus)
                target = (where.pool, where.gpus, batch)
                if job.state is not JobState.RUNNING:
                    if free_now[where.pool] < where.gpus:
                        continue  # deferred, not dropped: it waits for the GPUs to free up
                    free_now[where.pool] -= where.gpus
            _diff(res, job, target, fence, config)
    return res


def _allocate(jobs: list[JobRecord], choices: dict[str, list[Choice]], capacity: int,
              pools_by_id: dict[str, Pool], config: SchedulerConfig,
              now: float) -> dict[str, Choice | None]:
    """Run the allocator with running jobs' current config favoured (``stickiness``) and, for
    jobs started less than ``min_rescale_interval_s`` ago (or under the static policy), pinned;
    pins are dropped when they cannot all be honoured (capacity was lost)."""
    def build(pin: bool) -> list[JobChoices]:
        out = []
        for job in jobs:
            opts = choices[job.id]
            if job.state is JobState.RUNNING:
                pool = pools_by_id.get(job.pool or "")
                cur = [c for c in opts if (c.gpus, c.batch_size) == (job.gpus, job.batch_size)]
                young = (config.policy is Policy.STATIC or
                         now - (job.launched_at or 0) < config.min_rescale_interval_s)
                if pin and cur and young and pool is not None and pool.capacity >= job.gpus:
                    out.append(JobChoices(job.id, cur, required=True))
                    continue
                bonus = 1.0 + config.stickiness
                opts = [Choice(c.gpus, c.batch_size, c.value * bonus) if c in cur else c
                        for c in opts]
            out.append(JobChoices(job.id, opts))
        return out

    try:
        return allocate(build(pin=True), capacity)
    except InfeasibleAllocation:
        return allocate(build(pin=False), capacity)


def _diff(res: RoundResult, job: JobRecord, target: tuple[str, int, int] | None, fence: int,
          config: SchedulerConfig) -> None:
    if job.state is JobState.RUNNING:
        if target is None:
            _stop(res, job, fence, IntentKind.SUSPEND, "allocator gave its GPUs to other jobs")
        elif target[0] != job.pool:
            _stop(res, job, fence, IntentKind.MIGRATE, f"moving to {target[0]}", target)
        elif target[1:] != (job.gpus, job.batch_size):
            _stop(res, job, fence, IntentKind.RESIZE,
                  f"resize to {target[1]} GPUs, batch {target[2]}", target)
        return
    if target is None:
        if config.admission is Admission.DROP and job.state is JobState.QUEUED:
            _drop(res, job, "admission control: no room when it arrived")
        return
    pool, gpus, batch = target
    attempt = job.attempt + 1
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=fence, attempt=attempt,
                    gpus=gpus, batch_size=batch, pool=pool)
    relaunch = job.attempt > 0 and job.pool is not None
    moved = relaunch and pool != job.pool
    resized = relaunch and not moved and (gpus, batch) != (job.gpus, job.batch_size)
    res.plan.change(job, JobState.LAUNCHING, event_data={"pool": pool, "gpus": gpus,
                                                         "batch_size": batch},
                    attempt=attempt, launch_key=intent.key, gpus=gpus, batch_size=batch,
                    pool=pool, fence=fence, node_ids=[], exit_code=None,
                    migrations=job.migrations + moved, rescales=job.rescales + resized,
                    reason="placed" if not relaunch else "resumed from checkpoint")
    res.plan.add_intent(intent)
    res.launches += 1
    res.migrations += moved
    res.resizes += resized
    res.changed.append(job.id)


def _stop(res: RoundResult, job: JobRecord, fence: int, kind: IntentKind, reason: str,
          target: tuple[str, int, int] | None = None) -> None:
    pool, gpus, batch = target or (None, 0, None)
    intent = Intent(kind=kind, job_id=job.id, fence=fence, attempt=job.attempt, gpus=gpus,
                    batch_size=batch, pool=pool, reason=reason)
    res.plan.change(job, JobState.SUSPENDING, event=kind.value, event_data={"reason": reason},
                    reason=reason, fence=fence)
    res.plan.add_intent(intent)
    res.changed.append(job.id)
    if kind is IntentKind.STOP:
        res.stops += 1
    else:
        res.suspends += 1


def _drop(res: RoundResult, job: JobRecord, reason: str) -> None:
    res.plan.change(job, JobState.DROPPED, reason=reason)
    res.dropped += 1
    res.changed.append(job.id)


class Scheduler:
    """Runs rounds against the store under a fencing token."""

    def __init__(self, store: Store, config: SchedulerConfig | None = None) -> None:
        self.store = store
        self.config = config or SchedulerConfig()

    def run_round(self, fence: int) -> RoundResult:
        """Snapshot, plan, apply atomically. A conflict (a job changed meanwhile) leaves
        everything as it was; the next round re-plans from fresh state."""
        res = plan_round(self.store.snapshot(), fence, self.config,
                         blocklist=self.store.blocklist()[0])
        if not res.plan.empty():
            self.store.apply(res.plan, fence=fence)
        return res
