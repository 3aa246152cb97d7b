"""The elastic allocator: an exact multiple-choice knapsack over (jobs x GPUs) by dynamic programme.

Every job offers configurations ``Choice(gpus, batch_size, value)``; ``allocate`` picks at most one
per job (exactly one for a ``required`` job) so that the GPUs used fit ``capacity`` and the summed
value is maximal. The batch-size dimension is folded away first: for each GPU count only the best
batch size can be in an optimum, and a configuration that needs more GPUs for no more value than a
smaller one is dominated and dropped.

The programme keeps ``best[k]`` = the largest value of the jobs seen so far using at most ``k``
GPUs, and adds one job as a max-plus convolution of ``best`` with the job's few choices: a small
C loop (``policies/_maxplus.c``), or numpy over the whole GPU axis where it is not compiled.
Only the rows of ``best`` are kept; the winning choice of each job is recovered afterwards by
re-evaluating the same floating-point sums, so the backward pass costs O(jobs x choices).
Time O(jobs x choices x capacity), memory O(jobs x capacity) float64; ``best_value``, the
optimum alone, needs two rows, O(capacity), where the kernel is compiled.

Where every job's choices are all GPU counts 1..m with non-increasing marginal value (concave
speed-up curves), the greedy rule "hand out GPUs in order of marginal value" is optimal;
``allocate`` then skips the programme. Ties are broken deterministically: jobs earlier in the
input, and fewer GPUs, win.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:  # the compiled inner loop (policies/_maxplus.c); a source checkout falls back to numpy
    from policies import _maxplus
except ImportError:  # pragma: no cover - depends on the build
    _maxplus = None

__all__ = ["Choice", "InfeasibleAllocation", "JobChoices", "allocate", "best_value"]


@dataclass(frozen=True, slots=True)
class Choice:
    """One configuration of a job: ``gpus`` GPUs at global ``batch_size``, worth ``value``."""

    gpus: int
    batch_size: int
    value: float

    def __post_init__(self) -> None:
        if self.gpus.__class__ is not int and not isinstance(self.gpus, int | np.integer):
            raise ValueError(f"gpus must be an integer, got {self.gpus!r}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}; "
                             "leave a configuration out instead of offering 0 GPUs")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.value - self.value != 0:  # NaN or infinite
            raise ValueError(f"value must be a finite number, got {self.value!r} "
                             f"for {self.gpus} GPUs")


@dataclass(frozen=True, slots=True)
class JobChoices:
    """A job's configurations. A ``required`` job must be given one of them."""

    job_id: str
    choices: Sequence[Choice]
    required: bool = False

    def __post_init__(self) -> None:
        for c in self.choices:
            if not isinstance(c, Choice):
                raise ValueError(f"job {self.job_id!r}: choices must be Choice objects, "
                                 f"got {c!r}")


class InfeasibleAllocation(ValueError):
    """The required jobs cannot all be placed within the capacity."""

    def __init__(self, job_ids: Sequence[str], capacity: int, needed: int) -> None:
        self.job_ids = list(job_ids)
        self.capacity = capacity
        self.needed = needed
        names = ", ".join(self.job_ids)
        super().__init__(
            f"required jobs [{names}] need at least {needed} GPUs together but capacity is "
            f"{capacity}; lower their minimum GPU counts, mark fewer jobs required, or add capacity"
        )


def allocate(jobs: Sequence[JobChoices], capacity: int) -> dict[str, Choice | None]:
    """Return for every job one of its choices or ``None`` so that total value is maximal.

    The sum of the chosen ``gpus`` never exceeds ``capacity``; every ``required`` job gets a
    choice, else :class:`InfeasibleAllocation` names the required jobs. Raises ``ValueError``
    for invalid input (negative or zero GPUs, NaN or infinite values, duplicate job ids).
    """
    f, active = _prepare(jobs, capacity)
    result: dict[str, Choice | None] = {job.job_id: None for job in jobs}
    if not active.size:
        return result
    if _greedy_is_exact(f, active):
        picks = _greedy(f, capacity)
    else:
        picks = _dynamic_programme(f, active, capacity)
    for i, p in picks:
        result[jobs[i].job_id] = jobs[i].choices[f.src[p]]
    return result


def best_value(jobs: Sequence[JobChoices], capacity: int) -> float:
    """The summed value of :func:`allocate`'s answer, bit for bit, without recovering it: the
    compiled programme keeps two rows instead of its whole table (the numpy fallback fills
    the table). Raises as :func:`allocate` does."""
    f, active = _prepare(jobs, capacity)
    if not active.size:
        return 0.0
    if _greedy_is_exact(f, active):
        return sum((float(f.values[p]) for _, p in _greedy(f, capacity)), 0.0)
    offsets, required = _rows(f, active)
    if _maxplus is not None:
        return _maxplus.best(capacity + 1, offsets, f.gpus, f.values,
                             required.astype(np.uint8).tobytes())
    rows = np.zeros((len(active) + 1, capacity + 1))
    _forward_numpy(offsets, f.gpus, f.values, required, rows)
    return float(rows[-1, -1])


def _prepare(jobs: Sequence[JobChoices], capacity: int) -> tuple[_Frontiers, np.ndarray]:
    """The validated, folded problem and the rows of the jobs with a choice that fits (none
    at capacity 0); raises :class:`InfeasibleAllocation` where the required jobs cannot all
    fit."""
    _validate(jobs, capacity)
    f = _fold(jobs, capacity)
    placeable = np.diff(f.offsets) > 0
    unplaceable = [jobs[i].job_id for i in np.flatnonzero(f.required & ~placeable)]
    needed = int(f.gpus[f.offsets[:-1][f.required & placeable]].sum())
    if unplaceable or needed > capacity:
        required = unplaceable or [job.job_id for job in jobs if job.required]
        raise InfeasibleAllocation(required, capacity, max(needed, capacity + 1))
    return f, np.flatnonzero(placeable)


def _greedy_is_exact(f: _Frontiers, active: np.ndarray) -> bool:
    """Concave curves from one GPU and no job that must run: the greedy rule is optimal."""
    return bool(f.concave[active].all() and not f.required[active].any())


def _rows(f: _Frontiers, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The programme's rows: where each active job's frontier starts, then where the last
    ends (inactive jobs own no entries), and which of them must run."""
    return np.append(f.offsets[active], f.offsets[-1]), f.required[active]


def _validate(jobs: Sequence[JobChoices], capacity: int) -> None:
    """Choices validate themselves on construction; what is left is the whole-problem input."""
    if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer):
        raise ValueError(f"capacity must be an integer number of GPUs, got {capacity!r}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 GPUs, got {capacity}")
    if len({job.job_id for job in jobs}) != len(jobs):
        seen: set[str] = set()
        for job in jobs:
            if job.job_id in seen:
                raise ValueError(f"duplicate job id {job.job_id!r}: every job must appear once")
            seen.add(job.job_id)


@dataclass(frozen=True)
class _Frontiers:
    """Every job's undominated choices as flat arrays; job ``i`` owns ``offsets[i]:offsets[i+1]``.

    ``src`` is each entry's index in its job's ``choices``; ``concave`` marks jobs whose frontier
    is GPU counts 1..m with non-increasing marginal value (greedy is then exact).
    """

    offsets: np.ndarray
    gpus: np.ndarray
    values: np.ndarray
    src: np.ndarray
    required: np.ndarray
    concave: np.ndarray


def _fold(jobs: Sequence[JobChoices], capacity: int) -> _Frontiers:
    """Each job's frontier (see ``_frontier``), by the C kernel when built (the same rule)."""
    n = sum(len(job.choices) for job in jobs)
    offsets = np.empty(len(jobs) + 1, dtype=np.int64)
    gpus, src = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    values = np.empty(n)
    required, concave = np.empty(len(jobs), dtype=bool), np.empty(len(jobs), dtype=bool)
    if _maxplus is not None:
        _maxplus.fold(jobs, int(capacity), gpus, values, src, offsets, required.view(np.uint8),
                      concave.view(np.uint8))
    else:
        out = 0
        for i, job in enumerate(jobs):
            offsets[i] = out
            frontier = _frontier(job, capacity)
            for s, c in frontier:
                gpus[out], values[out], src[out] = c.gpus, c.value, s
                out += 1
            required[i] = job.required
            concave[i] = _is_concave_run([c for _, c in frontier])
        offsets[-1] = out
    end = offsets[-1]
    return _Frontiers(offsets, gpus[:end], values[:end], src[:end], required, concave)


def _frontier(job: JobChoices, capacity: int) -> list[tuple[int, Choice]]:
    """The job's undominated choices that fit, by increasing GPUs and strictly increasing value,
    each with its index in ``job.choices``. For an optional job a choice worth <= 0 loses to not
    running it at all."""
    best: dict[int, tuple[int, Choice]] = {}
    for s, c in enumerate(job.choices):
        if c.gpus > capacity:
            continue
        held = best.get(c.gpus)
        if held is None or c.value > held[1].value or (
            c.value == held[1].value and c.batch_size < held[1].batch_size
        ):
            best[c.gpus] = (s, c)
    frontier: list[tuple[int, Choice]] = []
    floor = -math.inf if job.required else 0.0
    for gpus in sorted(best):
        s, c = best[gpus]
        if c.value > floor:
            frontier.append((s, c))
            floor = c.value
    return frontier


def _is_concave_run(frontier: list[Choice]) -> bool:
    """GPU counts 1..m with non-increasing marginal value."""
    previous_gain = math.inf
    last = 0.0
    for expected, c in enumerate(frontier, start=1):
        gain = c.value - last
        if c.gpus != expected or gain > previous_gain:
            return False
        previous_gain, last = gain, c.value
    return True


def _greedy(f: _Frontiers, capacity: int) -> list[tuple[int, int]]:
    """(job, flat index) of the picks: the ``capacity`` largest marginal gains, taken in order."""
    job_of = np.repeat(np.arange(len(f.offsets) - 1), np.diff(f.offsets))
    first = np.zeros(len(f.values), dtype=bool)
    first[f.offsets[:-1][np.diff(f.offsets) > 0]] = True
    last = np.where(first, 0.0, np.roll(f.values, 1))
    # Concavity makes each job's gains arrive in order, so taking the largest ``capacity`` of them
    # hands every job a prefix of its curve. Ties: earlier job, then fewer GPUs (flat order).
    neg_gain = last - f.values
    taken = np.argsort(neg_gain, kind="stable")[:capacity]
    taken = np.sort(taken[neg_gain[taken] < 0])
    # the last taken entry of each job is where its prefix ends
    ends = taken[np.flatnonzero(np.append(job_of[taken][1:] != job_of[taken][:-1], True))]
    return list(zip(job_of[ends].tolist(), ends.tolist(), strict=True))


def _dynamic_programme(f: _Frontiers, active: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Max-plus programme over the active jobs' frontiers; (job, flat index) of the picks."""
    offsets, required = _rows(f, active)
    rows = np.empty((len(active) + 1, capacity + 1))
    rows[0] = 0.0
    if _maxplus is None:
        _forward_numpy(offsets, f.gpus, f.values, required, rows)
        picks = _backtrack(offsets, f.gpus, f.values, required, rows, _fewest_optimal_gpus(rows))
    else:
        picks = _solve_c(offsets, f.gpus, f.values, required, rows)
    rows_picked = np.flatnonzero(picks >= 0)
    return list(zip(active[rows_picked].tolist(), picks[rows_picked].tolist(), strict=True))


def _solve_c(offsets: np.ndarray, gpus: np.ndarray, values: np.ndarray, required: np.ndarray,
             rows: np.ndarray) -> np.ndarray:
    """Forward pass and backtrack in C; ``picks[r]`` is row ``r``'s flat choice index, or -1."""
    capacity = rows.shape[1] - 1
    picks = np.empty(len(offsets) - 1, dtype=np.int64)
    req = required.astype(np.uint8).tobytes()
    _maxplus.forward(rows, capacity + 1, offsets, gpus, values, req)
    _maxplus.backtrack(rows, capacity + 1, _fewest_optimal_gpus(rows), offsets, gpus, values,
                       req, picks)
    return picks


def _fewest_optimal_gpus(rows: np.ndarray) -> int:
    final = rows[-1]
    return int(np.flatnonzero(final == final[-1])[0])


def _forward_numpy(offsets: np.ndarray, gpus: np.ndarray, values: np.ndarray,
                   required: np.ndarray, rows: np.ndarray) -> None:
    """The C kernel's forward pass with one numpy operation per choice (same arithmetic)."""
    capacity = rows.shape[1] - 1
    scratch = np.empty(capacity + 1)
    reach = 0  # beyond the GPUs all jobs so far could use, best[] is flat: skip that tail
    for r in range(1, len(offsets)):
        prev, cur = rows[r - 1], rows[r]
        lo, hi = offsets[r - 1], offsets[r]
        reach = min(capacity, reach + int(gpus[hi - 1]))
        span = reach + 1
        if required[r - 1]:
            cur[:span] = -np.inf
        else:
            cur[:span] = prev[:span]
        for c in range(lo, hi):
            n = span - int(gpus[c])
            if n <= 0:
                break
            np.add(prev[:n], values[c], out=scratch[:n])
            np.maximum(cur[gpus[c]:span], scratch[:n], out=cur[gpus[c]:span])
        cur[span:] = cur[reach]


def _backtrack(offsets: np.ndarray, gpus: np.ndarray, values: np.ndarray, required: np.ndarray,
               rows: np.ndarray, k: int) -> np.ndarray:
    """The C kernel's backtrack: later jobs yield on ties, then fewest GPUs (same rule).
    ``picks[r]`` is row ``r``'s flat choice index, or -1."""
    picks = np.full(len(offsets) - 1, -1, dtype=np.int64)
    for r in range(len(offsets) - 1, 0, -1):
        prev, target = rows[r - 1], rows[r][k]
        if not required[r - 1] and prev[k] == target:
            continue
        for c in range(offsets[r - 1], offsets[r]):
            if gpus[c] <= k and prev[k - gpus[c]] + values[c] == target:
                picks[r - 1] = c
                k -= int(gpus[c])
                break
        else:  # pragma: no cover - the forward pass guarantees a witness
            raise AssertionError(f"no witness for job row {r} at {k} GPUs")
    return picks
