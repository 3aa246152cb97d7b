"""The live round's type choice for heterogeneous fleets, and the small types it shares.

The exact joint problem (each job picks one type and one count) is a multi-dimensional knapsack,
not one DP. ``assign_types`` is the outer step, a Lagrangian decomposition: every type gets a
price per GPU; each job independently takes the (type, count) with the largest value minus
price x GPUs, and prices rise on over-demanded types and fall on idle ones (subgradient steps).
The type assignments met on the way, plus a greedy one (jobs to the type where one GPU is worth
most, while GPUs last) and one that fills each type's free GPUs in order, are scored exactly by
running the DP once per type, and the best is kept. ``broker.scheduler`` feeds it each job's
choices per type (values on one scale: the speed-up over one GPU of the job's slowest type);
``tests/test_choices.py`` measures the loss of this decomposition against the joint MILP (scipy
HiGHS) on small random cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from policies.elastic_dp import JobChoices, best_value
from policies.models import Accelerator
from policies.trace_throughput import Placement, packed_placement


@dataclass(frozen=True)
class TypeCapacity:
    """The GPUs of one accelerator type in the fleet, as nodes of equal size."""

    accelerator: Accelerator
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def placement_for(gpus: int, gpus_per_node: int) -> Placement:
    return packed_placement(gpus, gpus_per_node)


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
    owner_of = np.searchsorted(starts, np.arange(len(v)), side="right") - 1
    price = np.zeros(len(types))
    picks: list[np.ndarray] = []  # each a type index per job, in order of first appearance
    seen: set[bytes] = set()
    for it in range(iterations):
        score = v - price[tx] * g
        best = np.maximum.reduceat(score, starts)
        # first choice reaching its job's best score (deterministic ties, as the order above)
        hit = np.flatnonzero(score == best[owner_of])
        first = hit[np.r_[True, jx[hit][1:] != jx[hit][:-1]]]
        if (key := tx[first].tobytes()) not in seen:
            seen.add(key)
            picks.append(tx[first])
        wants = first[score[first] > 0]
        demand = np.bincount(tx[wants], weights=g[wants], minlength=len(types))
        price = np.maximum(0.0, price + step0 / (1 + it / 4) * (demand - caps)
                           / np.maximum(caps, 1))
    names = [jobs[o] for o in owners.tolist()]
    for pick in picks[-(evaluate - 2):]:
        got = dict(zip(names, (types[t] for t in pick.tolist()), strict=True))
        if got not in candidates:
            candidates.append(got)
    scores = [_dp_value(cands, capacity, c) for c in candidates]
    return candidates[int(np.argmax(scores))]


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
            total += best_value(members, cap)
    return total
