"""Baselines, for comparison only: none of this runs in the live broker.

FleetBroker's own decisions are the live round's (``broker.scheduler.plan_round``, driven by
``broker.sim.driver``). These policies exist to be compared with it:

- ``tiresias`` (classic clusters, ``--policy tiresias``): discretised two-queue
  least-attained-service, as in Pollux's simulator; every job at its workload row's GPUs and
  batch, packed on the freest nodes of one type, never resized.
- ``ondemand``, ``skypilot-failover``, ``skypilot-eager`` (spot clusters, ``--spot-policy``):
  an elastic allocator (:class:`BaselineAllocator`: a DP over each job's GPU counts at its best
  batch, valued by speed-up with a restart discount, each count capped at the largest pool's
  free GPUs) shares the market's available GPUs, and a placement step puts each job's whole gang
  in ONE pool (one region); jobs that fragmentation leaves out are re-allocated over what is
  left. Running jobs keep their pool while it holds their new size; the others are placed,
  largest gang first: ``ondemand`` on on-demand pools only, cheapest first;
  ``skypilot-failover`` on spot only, cheapest first, a preempted job relaunched in the region
  it was preempted from first, then anywhere (SkyPilot's FAILOVER); ``skypilot-eager`` on spot
  only, a preempted job trying the other regions first in price order and its own region last
  (SkyPilot's EAGER_NEXT_REGION). Neither looks at deadlines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.scheduler import Admission, Policy
from broker.sim.cluster import fleet_capacity
from broker.sim.engine import Assignment, SimConfig, SimState, SimulationError
from broker.sim.rounds import MarketPolicy, SimPool, SpotConfig, SpotJob, SpotRounds
from broker.sim.workload import WorkloadJob
from policies.apps import Application
from policies.elastic_dp import Choice, JobChoices, allocate
from policies.models import Accelerator, Market
from policies.trace_throughput import Placement
from policies.type_assignment import TypeCapacity, assign_types, placement_for

# a rescale must pay its restart back within this many seconds: a running job's other sizes are
# worth (1 - restart / horizon) of their speed-up
RESTART_HORIZON_S = 1800.0


# --- Tiresias (classic clusters) ---------------------------------------------------------------


@dataclass
class _Nodes:
    """Free GPUs per node of one type; Tiresias' jobs keep their nodes while they run."""

    cap: TypeCapacity
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = [self.cap.gpus_per_node] * self.cap.nodes

    def take(self, gpus: int) -> list[int]:
        """Pollux's packing: repeatedly the node with the most free GPUs (lowest index on ties)."""
        got: list[int] = []
        while len(got) < gpus:
            idx = max(range(len(self.free)), key=lambda i: (self.free[i], -i))
            n = min(self.free[idx], gpus - len(got))
            self.free[idx] -= n
            got.extend([idx] * n)
        return got


def _placement(nodes: list[int]) -> Placement:
    counts: list[int] = []
    for i, idx in enumerate(nodes):
        if i and idx == nodes[i - 1]:
            counts[-1] += 1
        else:
            counts.append(1)
    return tuple(counts)


class TiresiasPolicy:
    """Discretised two-queue least-attained-service (Tiresias), as in Pollux's simulator.

    Jobs run with the workload's GPU count and batch size on concrete nodes. A job is demoted
    from the first to the second queue once it has run for ``threshold_gpu_s`` GPU-seconds;
    within a queue jobs keep their order; jobs that do not fit are skipped (later, smaller jobs
    may run) and running jobs that lose their turn are preempted.
    """

    def __init__(self, fleet: Sequence[TypeCapacity], threshold_gpu_s: float = 16 * 3600):
        if not fleet:
            raise ValueError("the fleet has no GPUs")
        self.fleet = {cap.accelerator: cap for cap in fleet}
        self.threshold = threshold_gpu_s
        self._held: dict[str, tuple[Accelerator, list[int]]] = {}
        self._q0: list[str] = []
        self._q1: list[str] = []
        self._executed: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def schedule(self, jobs: Sequence[SimState], now: float) -> dict[str, Assignment | None]:
        """One round: the assignment of every job in ``jobs`` (None: it waits)."""
        by_id = {j.id: j for j in jobs}
        self._q0 = [k for k in self._q0 if k in by_id]
        self._q1 = [k for k in self._q1 if k in by_id]
        for j in sorted(jobs, key=lambda j: (j.submitted, j.id)):
            if j.id not in self._executed:
                self._executed[j.id] = 0.0
                self._q0.append(j.id)
            if j.current is not None:
                self._executed[j.id] += now - self._last.get(j.id, now)
                if j.id in self._q0 and self._executed[j.id] * j.workload_gpus >= self.threshold:
                    self._q0.remove(j.id)
                    self._q1.append(j.id)
            self._last[j.id] = now
        free = {acc: cap.gpus for acc, cap in self.fleet.items()}
        chosen: list[SimState] = []
        for key in self._q0 + self._q1:
            j = by_id[key]
            acc = self._fits(j, free)
            if acc is not None:
                free[acc] -= j.workload_gpus
                chosen.append(j)
        out = self._place(chosen)
        return {j.id: out.get(j.id) for j in jobs}

    def _rank_types(self, job: SimState) -> list[Accelerator]:
        """Types the job fits on, fastest (at its own configuration) first."""
        def speed(acc: Accelerator) -> float:
            p = placement_for(job.workload_gpus, self.fleet[acc].gpus_per_node)
            rate, _ = job.app.rate(acc, p, job.workload_batch, 0)
            return rate if rate > 0 else 0.0
        fits = [a for a, cap in self.fleet.items()
                if a in job.app.throughput and cap.gpus >= job.workload_gpus]
        return sorted(fits, key=lambda a: (-speed(a), a.value))

    def _place(self, running: Sequence[SimState]) -> dict[str, Assignment | None]:
        """Keep the nodes of jobs that stay, pack the others on the freest nodes."""
        nodes = {acc: _Nodes(cap) for acc, cap in self.fleet.items()}
        keep = {j.id for j in running}
        self._held = {k: v for k, v in self._held.items() if k in keep}
        for acc, idxs in self._held.values():
            for idx in idxs:
                nodes[acc].free[idx] -= 1
        out: dict[str, Assignment | None] = {}
        for j in running:
            if j.id not in self._held:
                for acc in self._rank_types(j):
                    if sum(nodes[acc].free) >= j.workload_gpus:
                        self._held[j.id] = (acc, nodes[acc].take(j.workload_gpus))
                        break
            if j.id in self._held:
                acc, idxs = self._held[j.id]
                out[j.id] = Assignment(acc, j.workload_gpus, j.workload_batch, _placement(idxs))
        return out

    def _fits(self, job: SimState, free: dict[Accelerator, int]) -> Accelerator | None:
        held = self._held.get(job.id)
        if held is not None:
            return held[0] if free[held[0]] >= job.workload_gpus else None
        for acc in self._rank_types(job):
            if free[acc] >= job.workload_gpus:
                return acc
        return None


class TiresiasRounds(SpotRounds):
    """Tiresias on a classic cluster (one on-demand pool per type), on the simulation's shared
    loop: a job Tiresias preempts checkpoints and waits; one it places again restarts."""

    def __init__(self, workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                 cfg: SimConfig, spot: SpotConfig):
        if cfg.admission is not Admission.QUEUE:
            raise SimulationError("the Tiresias baseline queues jobs (admission queue); "
                                  "admission drop is the live round's (policies elastic, "
                                  "fixed-batch, static)")
        types = [p.pool.accelerator for p in pools]
        if len(set(types)) < len(types):
            raise SimulationError("the Tiresias baseline runs one pool per accelerator type; "
                                  "this cluster has several of one type")
        self.fleet = fleet_capacity([p.pool for p in pools])
        super().__init__(workload, pools, cfg, spot, {Market.ON_DEMAND})
        self.policy = TiresiasPolicy(self.fleet)
        self.pool_of = {p.pool.accelerator: p for p in self.pools}

    def _job(self, w: WorkloadJob) -> SpotJob:
        job = super()._job(w)
        s = job.state
        types = [c for c in self.fleet if c.accelerator in s.app.throughput]
        if not types:
            raise SimulationError(f"job {s.id}: {s.app.name} has no measurements on any type "
                                  "of this cluster")
        if max(c.gpus for c in types) < s.workload_gpus:
            raise SimulationError(
                f"job {s.id} needs {s.workload_gpus} GPUs but the largest type of this cluster "
                f"has {max(c.gpus for c in types)}; use a bigger cluster or policy elastic")
        return job

    def _schedule(self, active: list[SpotJob], now: float) -> None:
        plan = self.policy.schedule([j.state for j in active], now)
        for job in active:
            new = plan.get(job.state.id)
            if new == job.state.current:
                continue
            if job.state.current is not None:
                self._stop(job)
            if new is not None:
                self._launch(job, new, self.pool_of[new.accelerator], now)


# --- the spot baselines' elastic allocator -----------------------------------------------------


def allowed_gpu_counts(gpus_per_node: int, nodes: int) -> tuple[int, ...]:
    """1, 2, 4 GPUs inside one node, or whole nodes (Sia's placement rule)."""
    small = {n for n in (1, 2, 4) if n <= gpus_per_node}
    whole = {k * gpus_per_node for k in range(1, nodes + 1)}
    return tuple(sorted(small | whole))


@dataclass(frozen=True)
class ConfigTable:
    """Per allowed GPU count: the best batch and its goodput (M0 iterations/s, NaN if none)."""

    gpus: np.ndarray
    batch: np.ndarray
    rate: np.ndarray

    def at(self, gpus: int) -> tuple[int, float]:
        i = int(np.searchsorted(self.gpus, gpus))
        if i < len(self.gpus) and self.gpus[i] == gpus:
            return int(self.batch[i]), float(self.rate[i])
        return 0, math.nan


def batch_grid(app: Application, points: int = 24) -> np.ndarray:
    """Candidate global batches: a geometric grid over [M0, max] plus the measured sizes."""
    lo, hi = app.init_batch_size, app.spec.max_batch_size
    grid = np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))
    return np.union1d(grid, app.efficiency.table.batch_sizes.astype(int))


class ChoiceTables:
    """Caches goodput-vs-GPU-count tables per (model, type, batch rule, epoch).

    Step times do not depend on the epoch, so they are computed once per (model, type, batch
    rule); only the statistical gain is re-evaluated per epoch, vectorised over the grid.
    """

    def __init__(self) -> None:
        self._times: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._tables: dict[tuple, ConfigTable] = {}

    def table(self, app: Application, cap: TypeCapacity, epoch: int,
              fixed_batch: int | None = None) -> ConfigTable:
        """Best batch and goodput per allowed GPU count (``fixed_batch``: that batch only)."""
        key = (app.name, app.efficiency.model, cap, fixed_batch, epoch)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        counts, seconds, effective = self._step_times(app, cap, fixed_batch)
        with np.errstate(invalid="ignore", divide="ignore"):
            gain = app.efficiency.gain(np.where(effective > 0, effective, 1), epoch)
            rate = np.where(np.isfinite(seconds) & (seconds > 0), gain / seconds, np.nan)
        filled = np.where(np.isnan(rate), -np.inf, rate)
        best = filled.argmax(axis=1)
        rows = np.arange(len(counts))
        best_rate = rate[rows, best]
        out = ConfigTable(counts, effective[rows, best].astype(int), best_rate)
        self._tables[key] = out
        return out

    def _step_times(self, app: Application, cap: TypeCapacity, fixed_batch: int | None,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (app.name, cap, fixed_batch)
        hit = self._times.get(key)
        if hit is not None:
            return hit
        model = app.on(cap.accelerator)
        grid = np.array([fixed_batch]) if fixed_batch else batch_grid(app)
        counts = np.array(allowed_gpu_counts(cap.gpus_per_node, cap.nodes))
        seconds = np.full((len(counts), len(grid)), np.nan)
        effective = np.zeros((len(counts), len(grid)), dtype=int)
        for i, n in enumerate(counts):
            placement = placement_for(int(n), cap.gpus_per_node)
            for j, b in enumerate(grid):
                if b < n * model.min_local_bsz:
                    continue
                t, atomic, accum = model.iteration(placement, int(b), app.spec.max_batch_size)
                seconds[i, j] = t
                effective[i, j] = n * atomic * (accum + 1)
        out = (counts, seconds, effective)
        self._times[key] = out
        return out


@dataclass(frozen=True)
class _FreeGpus(TypeCapacity):
    """A type's capacity for the allocator: the free GPUs of its pools (not always whole nodes)."""

    free: int = 0

    @property
    def gpus(self) -> int:
        return self.free


class BaselineAllocator:
    """The spot baselines' allocator: per job and type, each allowed GPU count at its best batch
    (``fixed_batch``: the workload's), valued by its goodput speed-up over one GPU of the job's
    slowest type, a running job's other counts discounted by its restart
    (``RESTART_HORIZON_S``); one type per job (``policies.type_assignment.assign_types``; a
    running job keeps its type), then the DP per type. Each job's count is capped at the
    largest pool's free GPUs of its type (``largest``: a gang runs in one pool)."""

    def __init__(self, fleet: Sequence[_FreeGpus], largest: dict[Accelerator, int],
                 fixed_batch: bool, tables: ChoiceTables):
        self.fleet = {cap.accelerator: cap for cap in fleet}
        self.largest = largest
        self.fixed_batch = fixed_batch
        self.tables = tables

    def _table(self, job: SimState, acc: Accelerator) -> ConfigTable:
        cap, top = self.fleet[acc], self.largest[acc]
        whole = TypeCapacity(acc, max(1, math.ceil(top / cap.gpus_per_node)), cap.gpus_per_node)
        fixed = job.workload_batch if self.fixed_batch else None
        table = self.tables.table(job.app, whole, job.epoch, fixed)
        keep = table.gpus <= top
        return ConfigTable(table.gpus[keep], table.batch[keep], table.rate[keep])

    def schedule(self, jobs: Sequence[SimState]) -> dict[str, Assignment | None]:
        """The assignment of every job in ``jobs`` (None: it waits)."""
        order = sorted(jobs, key=lambda j: (j.submitted, j.id))
        cands: dict[str, dict[Accelerator, JobChoices]] = {}
        for j in order:
            tables = {a: self._table(j, a) for a in self.fleet if a in j.app.throughput}
            refs = [r for r in (_first_rate(t) for t in tables.values()) if r > 0]
            if not refs:
                continue
            ref = min(refs)  # one scale for every type: speed-up over one GPU of the slowest
            if j.current is not None:
                tables = {j.current.accelerator: tables[j.current.accelerator]}
            cands[j.id] = {acc: _choices(j, table, table.rate / ref, self.fleet[acc].gpus)
                           for acc, table in tables.items()}
        types = assign_types(cands, {a: c.gpus for a, c in self.fleet.items()})
        out: dict[str, Assignment | None] = {j.id: None for j in order}
        for acc, cap in self.fleet.items():
            members = [cands[j.id][acc] for j in order if types.get(j.id) is acc]
            for jid, choice in allocate(members, cap.gpus).items():
                if choice is not None:
                    out[jid] = Assignment(acc, choice.gpus, choice.batch_size,
                                          placement_for(choice.gpus, cap.gpus_per_node))
        return out


def _first_rate(table: ConfigTable) -> float:
    """Goodput at the smallest runnable GPU count, per GPU (the reference for speed-ups)."""
    for n, r in zip(table.gpus.tolist(), table.rate.tolist(), strict=True):
        if r > 0:
            return r / n
    return 0.0


def _choices(job: SimState, table: ConfigTable, vals: np.ndarray, max_gpus: int) -> JobChoices:
    """The allocator's input for one job on one type: a running job's counts other than its
    own are worth less by its restart (:data:`RESTART_HORIZON_S`)."""
    current = job.current.gpus if job.current is not None else None
    discount = max(0.0, 1.0 - job.restart_s / RESTART_HORIZON_S)
    out = []
    for n, b, v in zip(table.gpus.tolist(), table.batch.tolist(), vals.tolist(), strict=True):
        if not v > 0 or n > max_gpus:
            continue
        if current is not None and n != current:
            v *= discount
        out.append(Choice(gpus=int(n), batch_size=int(b), value=float(v)))
    return JobChoices(job_id=job.id, choices=out)


# --- the spot baselines ------------------------------------------------------------------------


class MarketBaseline(SpotRounds):
    """The spot simulation's baselines: on-demand only, and the SkyPilot-like spot policies
    (see the module docstring)."""

    def __init__(self, workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                 cfg: SimConfig, spot: SpotConfig):
        if spot.market is MarketPolicy.FLEET:
            raise ValueError("fleet runs the live round: broker.sim.driver")
        self.market = Market.ON_DEMAND if spot.market is MarketPolicy.ONDEMAND else Market.SPOT
        super().__init__(workload, pools, cfg, spot, {self.market})
        self.types = fleet_capacity([p.pool for p in pools])
        self.tables = ChoiceTables()

    def _schedule(self, active: list[SpotJob], now: float) -> None:
        plan: dict[str, tuple[Assignment, SimPool] | None] = {j.state.id: None for j in active}
        plan.update(self._allocate(active, now))
        for job in active:
            self._apply(job, plan[job.state.id], now)

    def _allocate(self, group: list[SpotJob], now: float,
                  ) -> dict[str, tuple[Assignment, SimPool]]:
        """The elastic allocator over the market's available GPUs, then one pool per gang; jobs
        the placement cannot fit are re-allocated over what is left (fragmentation repair)."""
        pools = self.pools
        free = {p.pool.id: p.gpus_at(now) for p in pools}
        out: dict[str, tuple[Assignment, SimPool]] = {}
        todo = sorted(group, key=lambda j: (j.state.submitted, j.state.id))
        for _ in range(4):
            assigned = self._dp(todo, pools, free)
            if not assigned:
                break
            placed = self._place(todo, assigned, pools, free)
            out.update(placed)
            todo = [j for j in todo if j.state.id not in placed]
            if not todo or not placed:
                break
        return out

    def _dp(self, jobs: list[SpotJob], pools: list[SimPool], free: dict[str, int],
            ) -> dict[str, Assignment]:
        caps, largest = [], {}
        for cap in self.types:
            mine = [free[p.pool.id] for p in pools if p.pool.accelerator is cap.accelerator]
            if sum(mine) >= 1:
                caps.append(_FreeGpus(cap.accelerator, cap.nodes, cap.gpus_per_node, sum(mine)))
                largest[cap.accelerator] = max(mine)
        # a job running on a type with nothing free left waits for the next round
        states = [j.state for j in jobs
                  if j.state.current is None or j.state.current.accelerator in largest]
        if not caps or not states:
            return {}
        fixed = self.cfg.policy is Policy.FIXED_BATCH
        plan = BaselineAllocator(caps, largest, fixed, self.tables).schedule(states)
        return {k: v for k, v in plan.items() if v is not None}

    def _place(self, jobs: list[SpotJob], assigned: dict[str, Assignment], pools: list[SimPool],
               free: dict[str, int]) -> dict[str, tuple[Assignment, SimPool]]:
        """One pool per gang. A running job holds its GPUs where it runs until it is placed
        anew (one whose new size fits nowhere gets them back for the next allocation, not
        someone else). Running jobs keep their pool while it holds their new size, those that
        keep their configuration first (a rescale must not push a job that would not restart
        out of its pool); the others go, largest gang first, where the spot policy says."""
        out: dict[str, tuple[Assignment, SimPool]] = {}
        todo = sorted((j for j in jobs if j.state.id in assigned),
                      key=lambda j: (-assigned[j.state.id].gpus, j.state.submitted, j.state.id))
        held: dict[str, int] = {}
        for j in todo:
            if j.state.current is not None and j.pool is not None and j.pool.pool.id in free:
                held[j.state.id] = j.state.current.gpus
                free[j.pool.pool.id] -= j.state.current.gpus
        for j in sorted(todo, key=lambda j: _restarts(j, assigned[j.state.id])):
            a = assigned[j.state.id]
            if j.state.id in held and j.pool is not None and \
                    j.pool.pool.accelerator is a.accelerator and \
                    free[j.pool.pool.id] + held[j.state.id] >= a.gpus:
                free[j.pool.pool.id] += held.pop(j.state.id) - a.gpus
                out[j.state.id] = (a, j.pool)
        for j in todo:
            a = assigned[j.state.id]
            if j.state.id in out:
                continue
            if j.state.id in held:
                free[j.pool.pool.id] += held[j.state.id]
            fits = [p for p in pools if p.pool.accelerator is a.accelerator
                    and free[p.pool.id] >= a.gpus]
            pool = self._pick(j, fits)
            if pool is not None:
                free[pool.pool.id] -= a.gpus
                out[j.state.id] = (a, pool)
                held.pop(j.state.id, None)
            elif j.state.id in held:
                free[j.pool.pool.id] -= held[j.state.id]  # still holds them this pass
        for jid, gpus in held.items():  # back to the next allocation, its own seat included
            free[next(j for j in todo if j.state.id == jid).pool.pool.id] += gpus
        return out

    def _pick(self, job: SpotJob, fits: list[SimPool]) -> SimPool | None:
        """The pool for a job among those with room (``fits``, cheapest first)."""
        if not fits:
            return None
        policy, origin = self.spot.market, job.preempted_from
        if job.pool in fits:
            return job.pool  # SkyPilot and on-demand never move a running job
        if policy is MarketPolicy.FAILOVER and origin:
            return min(fits, key=lambda p: p.region != origin)  # cheapest of its region
        if policy is MarketPolicy.EAGER and origin:
            return min(fits, key=lambda p: p.region == origin)  # its own region last
        return fits[0]

    def _apply(self, job: SpotJob, new: tuple[Assignment, SimPool] | None, now: float) -> None:
        s = job.state
        if new is None:
            if s.current is not None:
                self._stop(job)  # suspended by the allocator
            return
        a, pool = new
        if s.current is not None and job.pool is pool and not _restarts(job, a):
            s.current = a  # a batch change alone needs no restart
            return
        if s.current is not None:
            self._stop(job)  # rescale or move: checkpoint first
        self._launch(job, a, pool, now)


def _restarts(job: SpotJob, a: Assignment) -> bool:
    """Does running ``job`` with ``a`` (re)start it: it is not running, or its type, GPU count
    or placement changes (a batch change alone needs no restart)?"""
    c = job.state.current
    return c is None or (c.accelerator, c.gpus, c.placement) != (a.accelerator, a.gpus,
                                                                  a.placement)
