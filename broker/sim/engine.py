"""The simulation's physics: a job's progress on the measured tables, restarts, completion.

Conventions of Pollux's simulator (docs/simulator.md, "Conventions"): every round advances every
running job on its current assignment; a job that (re)starts holds its GPUs for its restart
penalty before it makes progress (the first start pays it too). Progress is counted in
iterations at the job's initial batch; the gain per iteration is the statistical efficiency; a
job completes at the exact moment its progress reaches the model's target. Who decides the
assignments is not here: the rounds (``broker.sim.rounds.SpotRounds``) run the live broker's round
(``broker.sim.driver``) or a baseline (``broker.sim.baselines``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from broker.errors import InvalidInput
from broker.scheduler import Admission, Policy
from broker.sim.workload import WorkloadJob
from policies.apps import APP_SPECS, Application
from policies.goodput import EfficiencyModel
from policies.models import Accelerator
from policies.trace_throughput import Placement
from providers.measurements import load_application


class SimulationError(InvalidInput):
    """A simulation that cannot run: a setting out of range (says which and its bound), or a
    workload this cluster cannot run at all (says which job and why)."""


class Baseline(StrEnum):
    """Classic-simulation policies that exist for comparison only (``broker.sim.baselines``);
    the others (``broker.scheduler.Policy``) are the live round's."""

    TIRESIAS = "tiresias"


@dataclass(frozen=True)
class SimConfig:
    policy: Policy | Baseline = Policy.ELASTIC
    admission: Admission = Admission.QUEUE
    interval: float = 60.0
    restart_penalty: float | None = 30.0  # None: per model (Sia)
    efficiency: EfficiencyModel = EfficiencyModel.GNS
    sia_slowdown: bool = False
    max_hours: float = 24 * 60  # safety stop for workloads that never drain

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise SimulationError(f"interval must be positive, got {self.interval}")
        if self.restart_penalty is not None and self.restart_penalty < 0:
            raise SimulationError(f"restart penalty must be >= 0, got {self.restart_penalty}")


@dataclass(frozen=True)
class Assignment:
    """Where and how a job runs: accelerator type, GPUs, global batch, GPUs per node."""

    accelerator: Accelerator
    gpus: int
    batch_size: int
    placement: Placement


@dataclass
class SimState:
    """A simulated job's physics: its model's tables, the workload row's request, its progress
    and what it runs on now."""

    id: str
    app: Application
    submitted: float
    workload_gpus: int
    workload_batch: int
    progress: float = 0.0
    current: Assignment | None = None
    restart_s: float = 30.0
    slowdown: float = 1.0

    @property
    def epoch(self) -> int:
        return self.app.efficiency.epoch(self.progress)


@dataclass
class SimRecord:
    """What the simulation reports of one job (``broker.sim.report``)."""

    name: str
    application: str
    submitted: float
    completed: float | None = None
    dropped: bool = False
    restarts: int = 0  # relaunches after the first start (rescales, moves, preemptions)
    gpu_seconds: float = 0.0  # GPU time held (restarts included)

    @property
    def jct(self) -> float | None:
        return None if self.completed is None else self.completed - self.submitted


@dataclass
class SimJob:
    """One job in a simulation: its physics, its record, its restart countdown."""

    state: SimState
    record: SimRecord
    restart_left: float = 0.0
    started: bool = False


@dataclass
class SimResult:
    records: list[SimRecord]
    end_time: float
    rounds: int
    unfinished: int = 0
    solve_seconds: list[float] = field(default_factory=list)


def make_job(w: WorkloadJob, cfg: SimConfig) -> SimJob:
    """A workload row as a job, with its application's measured model and restart cost."""
    app = load_application(w.application, cfg.efficiency)
    spec = APP_SPECS[w.application]
    restart = spec.restart_s if cfg.restart_penalty is None else cfg.restart_penalty
    state = SimState(w.name, app, w.time, w.num_replicas, w.batch_size, restart_s=restart,
                     slowdown=spec.sia_slowdown if cfg.sia_slowdown else 1.0)
    return SimJob(state, SimRecord(w.name, w.application, w.time))


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


def goodput(state: SimState, a: Assignment, epoch: int, cache: dict[tuple, float]) -> float:
    """M0-iterations per second of ``state``'s job on ``a`` during ``epoch``, its slowdown
    applied (NaN where the measurements cannot run it). ``cache`` keeps the tables' answers."""
    key = (state.app.name, state.app.efficiency.model, a, epoch)
    rate = cache.get(key)
    if rate is None:
        rate, _ = state.app.rate(a.accelerator, a.placement, a.batch_size, epoch)
        cache[key] = rate
    return rate / state.slowdown
