"""The simulation loop: a virtual clock, rounds every ``interval``, restarts, progress, completion.

Conventions of Pollux's simulator (FACTS.md section 3): every round advances every running job,
then the policy re-solves and every job whose GPUs (type, count or placement) changed starts a
restart countdown during which it holds its GPUs and makes no progress; the first start pays it
too. A batch-size change alone needs no restart (AdaptDL rescales the batch in place). Progress is
counted in iterations at the job's initial batch; the gain per iteration is the statistical
efficiency; a job completes at the exact moment its progress reaches the model's target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from broker.sim.workload import WorkloadJob
from policies.apps import APP_SPECS
from policies.choices import ChoiceTables, TypeCapacity, ValueConfig
from policies.goodput import EfficiencyModel
from policies.schedulers import Admission, Assignment, JobState, PolicyName, make_policy
from providers.measurements import load_application


class SimulationError(ValueError):
    """The workload cannot run on this cluster at all (says which job and why)."""


@dataclass(frozen=True)
class SimConfig:
    policy: PolicyName = PolicyName.ELASTIC
    admission: Admission = Admission.QUEUE
    interval: float = 60.0
    restart_penalty: float | None = 30.0  # None: per model (Sia)
    efficiency: EfficiencyModel = EfficiencyModel.GNS
    sia_slowdown: bool = False
    value: ValueConfig = field(default_factory=ValueConfig)
    accumulation: bool = True  # elastic policies may use gradient accumulation
    migrate: bool = False  # running jobs may move to another accelerator type
    max_hours: float = 24 * 60  # safety stop for workloads that never drain

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError(f"interval must be positive, got {self.interval}")
        if self.restart_penalty is not None and self.restart_penalty < 0:
            raise ValueError(f"restart penalty must be >= 0, got {self.restart_penalty}")


@dataclass
class JobRecord:
    name: str
    application: str
    submitted: float
    completed: float | None = None
    dropped: bool = False
    restarts: int = 0  # rescales and migrations after the first start
    gpu_seconds: float = 0.0  # GPU time held (restarts included)

    @property
    def jct(self) -> float | None:
        return None if self.completed is None else self.completed - self.submitted


@dataclass
class SimJob:
    """One job in a simulation: the policy's view of it, its record, its restart countdown."""

    state: JobState
    record: JobRecord
    restart_left: float = 0.0
    started: bool = False


@dataclass
class SimResult:
    records: list[JobRecord]
    end_time: float
    rounds: int
    unfinished: int = 0
    solve_seconds: list[float] = field(default_factory=list)


def simulate(workload: Sequence[WorkloadJob], fleet: Sequence[TypeCapacity],
             cfg: SimConfig = SimConfig(), tables: ChoiceTables | None = None,
             on_round: Callable[[float, int], None] | None = None) -> SimResult:
    """Run one workload to completion (or ``cfg.max_hours``) and return per-job records."""
    import time

    policy = make_policy(cfg.policy, fleet, cfg.admission, cfg.value, tables, cfg.accumulation,
                         cfg.migrate)
    jobs = [make_job(w, cfg) for w in sorted(workload, key=lambda w: (w.time, w.name))]
    _check_runnable(jobs, fleet, cfg.policy)
    rate_cache: dict[tuple, float] = {}
    now, rounds, nxt = 0.0, 0, 0
    active: list[SimJob] = []
    solve_s: list[float] = []
    limit = cfg.max_hours * 3600
    while (nxt < len(jobs) or active) and now < limit:
        for job in active:
            advance(job, now, cfg.interval, rate_cache)
        now += cfg.interval
        rounds += 1
        active = [j for j in active if j.record.completed is None]
        if not active and nxt < len(jobs) and jobs[nxt].record.submitted > now:
            # idle cluster: jump to the first round at or after the next arrival
            now = math.ceil(jobs[nxt].record.submitted / cfg.interval) * cfg.interval
        while nxt < len(jobs) and jobs[nxt].record.submitted <= now:
            active.append(jobs[nxt])
            nxt += 1
        if active:
            t0 = time.perf_counter()
            plan = policy.schedule([j.state for j in active], now)
            solve_s.append(time.perf_counter() - t0)
            _apply(active, plan, cfg)
            active = [j for j in active if not j.record.dropped]
        if on_round:
            on_round(now, sum(j.record.completed is not None or j.record.dropped for j in jobs))
    unfinished = sum(j.record.completed is None and not j.record.dropped for j in jobs)
    return SimResult([j.record for j in jobs], now, rounds, unfinished, solve_s)


def make_job(w: WorkloadJob, cfg: SimConfig) -> SimJob:
    """A workload row as a job, with its application's measured model and restart cost."""
    app = load_application(w.application, cfg.efficiency)
    spec = APP_SPECS[w.application]
    restart = spec.restart_s if cfg.restart_penalty is None else cfg.restart_penalty
    state = JobState(w.name, app, w.time, w.num_replicas, w.batch_size, restart_s=restart,
                     slowdown=spec.sia_slowdown if cfg.sia_slowdown else 1.0)
    return SimJob(state, JobRecord(w.name, w.application, w.time))


def _check_runnable(jobs: list[SimJob], fleet: Sequence[TypeCapacity],
                    policy: PolicyName) -> None:
    rigid = policy in (PolicyName.STATIC, PolicyName.TIRESIAS)
    for j in jobs:
        s = j.state
        types = [c for c in fleet if c.accelerator in s.app.throughput]
        if not types:
            raise SimulationError(f"job {s.id}: {s.app.name} has no measurements on any type "
                                  "of this cluster")
        if rigid and max(c.gpus for c in types) < s.workload_gpus:
            raise SimulationError(
                f"job {s.id} needs {s.workload_gpus} GPUs but the largest type of this cluster "
                f"has {max(c.gpus for c in types)}; use a bigger cluster or policy elastic"
            )


def advance(job: SimJob, start: float, seconds: float, cache: dict[tuple, float]) -> None:
    """Run ``job`` for ``seconds`` from ``start`` on its current assignment (restart first)."""
    s, rec, a = job.state, job.record, job.state.current
    if a is None:
        return
    rec.gpu_seconds += seconds * a.gpus
    delay = min(job.restart_left, seconds)
    job.restart_left -= delay
    elapsed = delay
    eff = s.app.efficiency
    bounds = eff.boundaries
    while elapsed < seconds:
        epoch = eff.epoch(s.progress)
        rate = goodput(s, a, epoch, cache)
        if not rate > 0:
            raise SimulationError(f"job {s.id}: {s.app.name} cannot run with {a} (no measurements)")
        nxt = bounds[epoch + 1]
        left = seconds - elapsed
        if s.progress + rate * left < nxt:
            s.progress += rate * left
            return
        elapsed += (nxt - s.progress) / rate
        s.progress = float(nxt)
        if epoch + 1 >= eff.max_epochs:
            rec.completed = start + elapsed
            rec.gpu_seconds -= (seconds - elapsed) * a.gpus
            s.current = None
            return


def goodput(state: JobState, a: Assignment, epoch: int, cache: dict[tuple, float]) -> float:
    """M0-iterations per second of ``state``'s job on ``a`` during ``epoch``, its slowdown
    applied (NaN where the measurements cannot run it). ``cache`` keeps the tables' answers."""
    key = (state.app.name, state.app.efficiency.model, a, epoch)
    rate = cache.get(key)
    if rate is None:
        rate, _ = state.app.rate(a.accelerator, a.placement, a.batch_size, epoch)
        cache[key] = rate
    return rate / state.slowdown


def _apply(active: list[SimJob], plan: dict[str, Assignment | None], cfg: SimConfig) -> None:
    for job in active:
        s = job.state
        new = plan.get(s.id)
        if s.new and new is None and cfg.admission is Admission.DROP:
            job.record.dropped = True
        s.new = False
        old = s.current
        if new is None:
            s.current = None
            job.restart_left = 0.0
            continue
        moved = old is None or (old.accelerator, old.gpus, old.placement) != (
            new.accelerator, new.gpus, new.placement)
        if moved:
            job.restart_left = s.restart_s
            if job.started:
                job.record.restarts += 1
            job.started = True
        s.current = new
