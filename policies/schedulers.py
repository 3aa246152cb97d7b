"""Scheduling policies shared by the simulator and the live broker.

Policies: ``elastic``, ``fixed-batch``, ``static``, ``tiresias``.

Each policy sees the active jobs once per round and returns, per job, an ``Assignment``
(accelerator type, GPU count, global batch, placement) or None (waits). Admission ``drop`` means
a job the first round cannot place is dropped (the simulator drops it); the elastic policies then
never preempt a running job for a newcomer (running jobs are ``required`` in the DP).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from policies.apps import Application
from policies.choices import (
    ChoiceTables,
    ConfigTable,
    TypeCapacity,
    ValueConfig,
    assign_types,
    job_choices,
    placement_for,
    values,
)
from policies.elastic_dp import JobChoices, allocate
from policies.models import Accelerator
from policies.trace_throughput import Placement

MIGRATE_GAIN = 3.0  # with migration on, a running job moves only for this much more goodput


class Admission(StrEnum):
    QUEUE = "queue"
    DROP = "drop"


@dataclass(frozen=True)
class Assignment:
    accelerator: Accelerator
    gpus: int
    batch_size: int
    placement: Placement


@dataclass
class JobState:
    """What a policy sees of one job."""

    id: str
    app: Application
    submitted: float
    workload_gpus: int
    workload_batch: int
    progress: float = 0.0
    current: Assignment | None = None
    new: bool = True  # not yet seen by a scheduling round
    restart_s: float = 30.0
    slowdown: float = 1.0

    @property
    def remaining(self) -> float:
        return self.app.efficiency.target - self.progress

    @property
    def epoch(self) -> int:
        return self.app.efficiency.epoch(self.progress)


class Policy(abc.ABC):
    name: str

    def __init__(self, fleet: Sequence[TypeCapacity], admission: Admission = Admission.QUEUE):
        if not fleet:
            raise ValueError("the fleet has no GPUs")
        self.fleet = {cap.accelerator: cap for cap in fleet}
        self.admission = admission

    @abc.abstractmethod
    def schedule(self, jobs: Sequence[JobState], now: float) -> dict[str, Assignment | None]:
        """One round: the desired assignment of every job in ``jobs``."""

    def runnable_types(self, job: JobState) -> list[Accelerator]:
        return [a for a in self.fleet if a in job.app.throughput]


class ElasticPolicy(Policy):
    """The DP over (GPU count, best batch) per job, re-solved every round, once per type."""

    name = "elastic"
    fixed_batch = False

    def __init__(self, fleet: Sequence[TypeCapacity], admission: Admission = Admission.QUEUE,
                 value: ValueConfig = ValueConfig(), tables: ChoiceTables | None = None,
                 accumulation: bool = True, migrate: bool = False):
        super().__init__(fleet, admission)
        self.value = value
        self.accumulation = accumulation
        self.migrate = migrate  # may a running job move to another accelerator type?
        self.tables = tables or ChoiceTables()

    def _table(self, job: JobState, acc: Accelerator) -> ConfigTable:
        fixed = job.workload_batch if self.fixed_batch else None
        return self.tables.table(job.app, self.fleet[acc], job.epoch, fixed, self.accumulation)

    def schedule(self, jobs: Sequence[JobState], now: float) -> dict[str, Assignment | None]:
        order = sorted(jobs, key=lambda j: (j.submitted, j.id))
        cands: dict[str, dict[Accelerator, JobChoices]] = {}
        for j in order:
            tables = {a: self._table(j, a) for a in self.runnable_types(j)}
            refs = [r for r in (_first_rate(t) for t in tables.values()) if r > 0]
            if not refs:
                continue
            ref = min(refs)  # one scale for every type: speed-up over one GPU of the slowest
            cands[j.id] = {}
            if j.current is not None:
                here = j.current.accelerator
                # hysteresis: a running job may only move to a type where it runs
                # MIGRATE_GAIN times faster than its best here (no flip-flopping)
                floor = MIGRATE_GAIN * float(np.nanmax(tables[here].rate))
                tables = {a: t for a, t in tables.items()
                          if a is here or (self.migrate and np.nanmax(t.rate) >= floor)}
            for acc, table in tables.items():
                current = None
                if j.current is not None:
                    current = j.current.gpus if j.current.accelerator is acc else 0
                vals = values(table, ref, j.remaining, self.value, j.slowdown)
                cands[j.id][acc] = job_choices(
                    j.id, table, vals, current_gpus=current,
                    restart_s=j.restart_s if j.current else 0.0, cfg=self.value,
                    max_gpus=self.fleet[acc].gpus)
        types = assign_types(cands, {a: c.gpus for a, c in self.fleet.items()})
        if self.admission is Admission.DROP:  # admitted jobs are never moved or preempted
            types.update({j.id: j.current.accelerator for j in order if j.current is not None})
        out: dict[str, Assignment | None] = {j.id: None for j in order}
        for acc, cap in self.fleet.items():
            members = [cands[j.id][acc] for j in order if types.get(j.id) is acc]
            if self.admission is Admission.DROP:
                members = _admit(members, {j.id for j in order if j.current is None}, cap.gpus)
            for jid, choice in allocate(members, cap.gpus).items():
                if choice is not None:
                    out[jid] = Assignment(acc, choice.gpus, choice.batch_size,
                                          placement_for(choice.gpus, cap.gpus_per_node))
        return out


def _admit(members: list[JobChoices], newcomers: set[str], capacity: int) -> list[JobChoices]:
    """Drop admission: running jobs keep a configuration (required, never preempted); a
    newcomer is admitted, in arrival order, only while its smallest configuration still fits."""
    out, used = [], 0
    for jc in members:
        if not jc.choices:
            continue
        smallest = min(c.gpus for c in jc.choices)
        if jc.job_id in newcomers and used + smallest > capacity:
            continue
        used += smallest
        out.append(replace(jc, required=True))
    return out


class FixedBatchPolicy(ElasticPolicy):
    """The seed paper's baseline: the same DP over GPU counts, each job at its submitted batch."""

    name = "fixed-batch"
    fixed_batch = True


def _first_rate(table: ConfigTable) -> float:
    """Goodput at the smallest runnable GPU count, per GPU (the reference for speed-ups)."""
    for n, r in zip(table.gpus.tolist(), table.rate.tolist(), strict=True):
        if r > 0:
            return r / n
    return 0.0


@dataclass
class _Nodes:
    """Free GPUs per node of one type; rigid jobs keep their nodes while they run."""

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


class _RigidPolicy(Policy):
    """Jobs run with the workload's GPU count and batch size on concrete nodes."""

    def __init__(self, fleet: Sequence[TypeCapacity], admission: Admission = Admission.QUEUE):
        super().__init__(fleet, admission)
        self._held: dict[str, tuple[Accelerator, list[int]]] = {}

    def _rank_types(self, job: JobState) -> list[Accelerator]:
        """Types the job fits on, fastest (at its own configuration) first."""
        def speed(acc: Accelerator) -> float:
            p = placement_for(job.workload_gpus, self.fleet[acc].gpus_per_node)
            rate, _ = job.app.rate(acc, p, job.workload_batch, 0)
            return rate if rate > 0 else 0.0
        fits = [a for a in self.runnable_types(job) if self.fleet[a].gpus >= job.workload_gpus]
        return sorted(fits, key=lambda a: (-speed(a), a.value))

    def _place(self, running: Sequence[JobState]) -> dict[str, Assignment | None]:
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

    def _fits(self, job: JobState, free: dict[Accelerator, int]) -> Accelerator | None:
        held = self._held.get(job.id)
        if held is not None:
            return held[0] if free[held[0]] >= job.workload_gpus else None
        for acc in self._rank_types(job):
            if free[acc] >= job.workload_gpus:
                return acc
        return None


class StaticPolicy(_RigidPolicy):
    """First come, first served; a started job keeps its GPUs until it ends."""

    name = "static"

    def schedule(self, jobs: Sequence[JobState], now: float) -> dict[str, Assignment | None]:
        free = {acc: cap.gpus for acc, cap in self.fleet.items()}
        chosen: list[JobState] = []
        order = sorted(jobs, key=lambda j: (j.current is None, j.submitted, j.id))
        for j in order:
            acc = self._fits(j, free)
            if acc is None:
                if self.admission is Admission.QUEUE and j.current is None:
                    break  # strict FCFS: the head of the queue blocks the rest
                continue
            free[acc] -= j.workload_gpus
            chosen.append(j)
        out = self._place(chosen)
        return {j.id: out.get(j.id) for j in jobs}


class TiresiasPolicy(_RigidPolicy):
    """Discretised two-queue least-attained-service (Tiresias), as in Pollux's simulator.

    A job is demoted from the first to the second queue once it has run for
    ``threshold_gpu_s`` GPU-seconds; within a queue jobs keep their order; jobs that do not fit
    are skipped (later, smaller jobs may run) and running jobs that lose their turn are preempted.
    """

    name = "tiresias"

    def __init__(self, fleet: Sequence[TypeCapacity], admission: Admission = Admission.QUEUE,
                 threshold_gpu_s: float = 16 * 3600):
        super().__init__(fleet, admission)
        self.threshold = threshold_gpu_s
        self._q0: list[str] = []
        self._q1: list[str] = []
        self._executed: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def schedule(self, jobs: Sequence[JobState], now: float) -> dict[str, Assignment | None]:
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
        chosen: list[JobState] = []
        for key in self._q0 + self._q1:
            j = by_id[key]
            acc = self._fits(j, free)
            if acc is not None:
                free[acc] -= j.workload_gpus
                chosen.append(j)
        out = self._place(chosen)
        return {j.id: out.get(j.id) for j in jobs}


class PolicyName(StrEnum):
    ELASTIC = "elastic"
    FIXED_BATCH = "fixed-batch"
    STATIC = "static"
    TIRESIAS = "tiresias"


def make_policy(name: PolicyName | str, fleet: Sequence[TypeCapacity],
                admission: Admission = Admission.QUEUE, value: ValueConfig = ValueConfig(),
                tables: ChoiceTables | None = None, accumulation: bool = True,
                migrate: bool = False) -> Policy:
    """``accumulation=False``: the elastic policies only use batches that fit in GPU memory
    (the seed paper's baseline then needs ``batch / per-GPU limit`` GPUs at least).
    ``migrate=True`` lets a running job change accelerator type when it would run
    ``MIGRATE_GAIN`` times faster there (hysteresis; without it the types flip-flop)."""
    name = PolicyName(name)
    if name is PolicyName.ELASTIC:
        return ElasticPolicy(fleet, admission, value, tables, accumulation, migrate)
    if name is PolicyName.FIXED_BATCH:
        return FixedBatchPolicy(fleet, admission, value, tables, accumulation, migrate)
    if name is PolicyName.STATIC:
        return StaticPolicy(fleet, admission)
    return TiresiasPolicy(fleet, admission)
