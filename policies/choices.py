"""Turns jobs and the throughput model into the allocator's choices, one set per accelerator type.

For every allowed GPU count (1, 2, 4 on one node, or whole nodes) the best global batch inside
the job's range is found first (the batch dimension folds into the value before the DP); the
value of a count is the job's goodput speed-up over one GPU by default. Other value functions:

- ``remaining``: speed-up weighted by 1 / (remaining work at one GPU), i.e. the fraction of the
  job's remaining work done per second; it favours jobs near completion (SRPT-like).
- ``fair``: speed-up to the power ``p`` (0 < p <= 1), Pollux-style fairness: concave values
  spread GPUs over more jobs.

A running job's choices that change its configuration are discounted by the restart penalty
(``1 - restart_s / horizon``), so the DP only rescales when the gain pays for the lost time.

Heterogeneous fleets: the exact joint problem (each job picks one type and one count) is a
multi-dimensional knapsack, not one DP. ``assign_types`` is the outer step, a Lagrangian
decomposition: every type gets a price per GPU; each job independently takes the (type, count)
with the largest value minus price x GPUs, and prices rise on over-demanded types and fall on
idle ones (subgradient steps). The type assignments met on the way, plus a greedy one (jobs to
the type where one GPU is worth most, while GPUs last), are scored exactly by running the DP
once per type, and the best is kept. Values of moves carry the restart discount, so running
jobs migrate only when it pays. ``tests/test_choices.py`` measures the loss of this
decomposition against the joint MILP (scipy HiGHS) on small random cases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from policies.apps import Application
from policies.elastic_dp import Choice, JobChoices, allocate
from policies.models import Accelerator
from policies.trace_throughput import Placement, packed_placement


class ValueFunction(StrEnum):
    SPEEDUP = "speedup"
    REMAINING = "remaining"
    FAIR = "fair"


@dataclass(frozen=True)
class ValueConfig:
    function: ValueFunction = ValueFunction.SPEEDUP
    fairness_p: float = 0.5
    restart_horizon_s: float = 1800.0  # the time a rescale must pay back its restart within

    def __post_init__(self) -> None:
        if not 0 < self.fairness_p <= 1:
            raise ValueError(f"fairness p must be in (0, 1], got {self.fairness_p}")
        if self.restart_horizon_s <= 0:
            raise ValueError(f"restart horizon must be positive, got {self.restart_horizon_s}")


@dataclass(frozen=True)
class TypeCapacity:
    """The GPUs of one accelerator type in the fleet, as nodes of equal size."""

    accelerator: Accelerator
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def allowed_gpu_counts(gpus_per_node: int, nodes: int) -> tuple[int, ...]:
    """1, 2, 4 GPUs inside one node, or whole nodes (Sia's placement rule)."""
    small = {n for n in (1, 2, 4) if n <= gpus_per_node}
    whole = {k * gpus_per_node for k in range(1, nodes + 1)}
    return tuple(sorted(small | whole))


def placement_for(gpus: int, gpus_per_node: int) -> Placement:
    return packed_placement(gpus, gpus_per_node)


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
              fixed_batch: int | None = None, accumulation: bool = True) -> ConfigTable:
        """Best batch and goodput per allowed GPU count; ``accumulation=False`` keeps only
        configurations whose per-GPU batch fits in memory (no gradient accumulation)."""
        key = (app.name, app.efficiency.model, cap, fixed_batch, accumulation, epoch)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        counts, seconds, effective = self._step_times(app, cap, fixed_batch, accumulation)
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
                    accumulation: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (app.name, cap, fixed_batch, accumulation)
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
                if accum and not accumulation:
                    continue
                seconds[i, j] = t
                effective[i, j] = n * atomic * (accum + 1)
        out = (counts, seconds, effective)
        self._times[key] = out
        return out


def values(table: ConfigTable, ref_rate: float, remaining: float, cfg: ValueConfig,
           slowdown: float = 1.0) -> np.ndarray:
    """Value of each GPU count of a table (NaN where the count cannot run)."""
    speedup = table.rate / ref_rate
    if cfg.function is ValueFunction.SPEEDUP:
        return speedup
    if cfg.function is ValueFunction.FAIR:
        return np.power(speedup, cfg.fairness_p)
    # remaining: fraction of the remaining work done per hour, at this count
    return table.rate / slowdown * 3600.0 / max(remaining, 1e-9)


def job_choices(job_id: str, table: ConfigTable, vals: np.ndarray, *,
                current_gpus: int | None = None, restart_s: float = 0.0,
                cfg: ValueConfig = ValueConfig(), required: bool = False,
                max_gpus: int | None = None) -> JobChoices:
    """The allocator's input for one job on one type, with the restart discount applied.

    ``current_gpus``: the job's GPU count on this type if it runs here, 0 if it runs on another
    type (every choice is then a move), None if it does not run.
    """
    discount = max(0.0, 1.0 - restart_s / cfg.restart_horizon_s)
    out = []
    for n, b, v in zip(table.gpus.tolist(), table.batch.tolist(), vals.tolist(), strict=True):
        if not v > 0 or (max_gpus is not None and n > max_gpus):
            continue
        if current_gpus is not None and n != current_gpus:
            v *= discount
        out.append(Choice(gpus=int(n), batch_size=int(b), value=float(v)))
    return JobChoices(job_id=job_id, choices=out, required=required)


def assign_types(cands: Mapping[str, Mapping[Accelerator, JobChoices]],
                 capacity: Mapping[Accelerator, int], iterations: int = 40,
                 evaluate: int = 6) -> dict[str, Accelerator]:
    """Outer step for heterogeneous fleets: one accelerator type per job (see module doc).

    ``cands[job][type]`` are the job's choices on that type, values on one common scale.
    Candidates: a greedy by one-GPU value per type, one that fills each type's free GPUs with
    the jobs' best sizes in order (:func:`_filled_types`), then assignments from GPU prices per
    type
    (each job takes the (type, count) with the largest value minus price x GPUs; prices follow
    the excess demand). The best few candidates are scored exactly with the per-type DP.
    """
    jobs = [j for j in cands if cands[j]]
    types = list(capacity)
    if len(types) == 1:
        return {j: types[0] for j in jobs}
    candidates = [_greedy_types(cands, capacity, jobs), _filled_types(cands, capacity, jobs)]
    # every (job, type, count) choice as flat arrays, in job order then type order then count
    job_ix, type_ix, gpus, vals = [], [], [], []
    for j_i, j in enumerate(jobs):
        for acc, jc in cands[j].items():
            for c in jc.choices:
                job_ix.append(j_i)
                type_ix.append(types.index(acc))
                gpus.append(c.gpus)
                vals.append(c.value)
    if not vals:
        return candidates[0]
    jx, tx = np.array(job_ix), np.array(type_ix)
    g, v = np.array(gpus, float), np.array(vals)
    caps = np.array([capacity[t] for t in types], float)
    starts = np.flatnonzero(np.r_[True, jx[1:] != jx[:-1]])
    owners = jx[starts]
    step0 = float(np.median(v / g))
    price = np.zeros(len(types))
    for it in range(iterations):
        score = v - price[tx] * g
        best = np.maximum.reduceat(score, starts)
        # first choice reaching its job's best score (deterministic ties, as the order above)
        hit = np.flatnonzero(score == best[np.searchsorted(starts, np.arange(len(v)),
                                                           side="right") - 1])
        first = hit[np.r_[True, jx[hit][1:] != jx[hit][:-1]]]
        pick = {jobs[o]: types[t] for o, t in zip(owners.tolist(), tx[first].tolist(),
                                                   strict=True)}
        if pick not in candidates:
            candidates.append(pick)
        wants = first[score[first] > 0]
        demand = np.bincount(tx[wants], weights=g[wants], minlength=len(types))
        price = np.maximum(0.0, price + step0 / (1 + it / 4) * (demand - caps)
                           / np.maximum(caps, 1))
    pool = [*candidates[:2], *candidates[2:][-(evaluate - 2):]]
    scores = [_dp_value(cands, capacity, c) for c in pool]
    return pool[int(np.argmax(scores))]


def _greedy_types(cands: Mapping[str, Mapping[Accelerator, JobChoices]],
                  capacity: Mapping[Accelerator, int], jobs: list[str]) -> dict[str, Accelerator]:
    """Jobs take the type where their smallest configuration is worth most per GPU, while a
    GPU of it is left for them; the rest go to their best type and wait there."""
    free = dict(capacity)
    pairs = []
    for rank, j in enumerate(jobs):
        for acc, jc in cands[j].items():
            if jc.choices:
                c = min(jc.choices, key=lambda c: c.gpus)
                pairs.append((-c.value / c.gpus, rank, acc.value, j, acc, c.gpus))
    pairs.sort()
    out: dict[str, Accelerator] = {}
    for _, _, _, j, acc, n in pairs:
        if j not in out and free[acc] >= n:
            out[j] = acc
            free[acc] -= n
    for _, _, _, j, acc, _ in pairs:
        out.setdefault(j, acc)
    return out


def _filled_types(cands: Mapping[str, Mapping[Accelerator, JobChoices]],
                  capacity: Mapping[Accelerator, int], jobs: list[str]) -> dict[str, Accelerator]:
    """Jobs in order each take the type where their best size that fits the GPUs still free
    there is worth most (at equal worth, the type with more left free), and hold that size:
    where types are alike for the jobs, this spreads them instead of stacking them on one."""
    free = dict(capacity)
    out: dict[str, Accelerator] = {}
    for j in jobs:
        best: tuple[float, int, Accelerator, int] | None = None
        for acc, jc in cands[j].items():
            fit = [c for c in jc.choices if c.gpus <= free.get(acc, 0)]
            if fit:
                c = max(fit, key=lambda c: c.value)
                key = (c.value, free[acc], acc, c.gpus)
                if best is None or key[:2] > best[:2]:
                    best = key
        if best is not None:
            out[j] = best[2]
            free[best[2]] -= best[3]
        elif cands[j]:
            out[j] = next(iter(cands[j]))
    return out


def _dp_value(cands: Mapping[str, Mapping[Accelerator, JobChoices]],
              capacity: Mapping[Accelerator, int], types: Mapping[str, Accelerator]) -> float:
    total = 0.0
    for acc, cap in capacity.items():
        members = [cands[j][acc] for j, a in types.items() if a is acc]
        if members:
            total += sum(c.value for c in allocate(members, cap).values() if c is not None)
    return total
