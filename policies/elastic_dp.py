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
Time O(jobs x choices x capacity), memory O(jobs x capacity) float64.

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

__all__ = ["Choice", "InfeasibleAllocation", "JobChoices", "allocate"]


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
    _validate(jobs, capacity)
    frontier = [_frontier(job, capacity) for job in jobs]
    result: dict[str, Choice | None] = {job.job_id: None for job in jobs}

    needed = sum(f[0].gpus for job, f in zip(jobs, frontier, strict=True) if job.required and f)
    unplaceable = [job.job_id for job, f in zip(jobs, frontier, strict=True)
                   if job.required and not f]
    if unplaceable or needed > capacity:
        required = unplaceable or [job.job_id for job in jobs if job.required]
        raise InfeasibleAllocation(required, capacity, max(needed, capacity + 1))

    active = [i for i, f in enumerate(frontier) if f]
    if not active or capacity == 0:
        return result
    if all(_is_concave_run(frontier[i]) and not jobs[i].required for i in active):
        picks = _greedy(frontier, active, capacity)
    else:
        picks = _dynamic_programme(
            [(frontier[i], jobs[i].required) for i in active], capacity, active
        )
    for i, choice in picks.items():
        result[jobs[i].job_id] = choice
    return result


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


def _frontier(job: JobChoices, capacity: int) -> list[Choice]:
    """The job's undominated choices that fit, by increasing GPUs and strictly increasing value.

    For an optional job a choice worth <= 0 loses to not running it at all.
    """
    best: dict[int, Choice] = {}
    for c in job.choices:
        if c.gpus > capacity:
            continue
        held = best.get(c.gpus)
        if held is None or c.value > held.value or (
            c.value == held.value and c.batch_size < held.batch_size
        ):
            best[c.gpus] = c
    frontier: list[Choice] = []
    floor = -math.inf if job.required else 0.0
    for gpus in sorted(best):
        c = best[gpus]
        if c.value > floor:
            frontier.append(c)
            floor = c.value
    return frontier


def _is_concave_run(frontier: list[Choice]) -> bool:
    """GPU counts 1..m with non-increasing marginal value (greedy is then exact)."""
    previous_gain = math.inf
    last = 0.0
    for expected, c in enumerate(frontier, start=1):
        gain = c.value - last
        if c.gpus != expected or gain > previous_gain:
            return False
        previous_gain, last = gain, c.value
    return True


def _greedy(frontier: list[list[Choice]], active: list[int], capacity: int) -> dict[int, Choice]:
    gains = []
    for i in active:
        last = 0.0
        for n, c in enumerate(frontier[i]):
            gains.append((last - c.value, i, n))
            last = c.value
    # Concavity makes each job's gains arrive in order, so taking the largest ``capacity`` of them
    # hands every job a prefix of its curve. Ties: earlier job, then fewer GPUs.
    gains.sort()
    held: dict[int, int] = {}
    for neg_gain, i, n in gains[:capacity]:
        if neg_gain >= 0:
            break
        held[i] = n
    return {i: frontier[i][n] for i, n in held.items()}


def _dynamic_programme(
    options: Sequence[tuple[list[Choice], bool]], capacity: int, ids: Sequence[int]
) -> dict[int, Choice]:
    """Max-plus programme over ``options`` = (choices by increasing GPUs, must be placed)."""
    rows = np.empty((len(options) + 1, capacity + 1))
    rows[0] = 0.0
    if _maxplus is None:
        _forward_numpy(options, rows)
        return _backtrack(options, ids, rows, _fewest_optimal_gpus(rows))
    flat = [c for choices, _ in options for c in choices]
    offsets = np.zeros(len(options) + 1, dtype=np.int64)
    np.cumsum([len(choices) for choices, _ in options], out=offsets[1:])
    gpus = np.array([c.gpus for c in flat], dtype=np.int64)
    values = np.array([c.value for c in flat], dtype=np.float64)
    required = bytes(bool(req) for _, req in options)
    picks = np.empty(len(options), dtype=np.int64)
    _maxplus.forward(rows, capacity + 1, offsets, gpus, values, required)
    _maxplus.backtrack(rows, capacity + 1, _fewest_optimal_gpus(rows), offsets, gpus, values,
                       required, picks)
    return {ids[r]: flat[p] for r, p in enumerate(picks.tolist()) if p >= 0}


def _fewest_optimal_gpus(rows: np.ndarray) -> int:
    final = rows[-1]
    return int(np.flatnonzero(final == final[-1])[0])


def _forward_numpy(options: Sequence[tuple[list[Choice], bool]], rows: np.ndarray) -> None:
    """The C kernel's forward pass with one numpy operation per choice (same arithmetic)."""
    capacity = rows.shape[1] - 1
    scratch = np.empty(capacity + 1)
    reach = 0  # beyond the GPUs all jobs so far could use, best[] is flat: skip that tail
    for r, (choices, required) in enumerate(options, start=1):
        prev, cur = rows[r - 1], rows[r]
        reach = min(capacity, reach + choices[-1].gpus)
        span = reach + 1
        if required:
            cur[:span] = -np.inf
        else:
            cur[:span] = prev[:span]
        for c in choices:
            n = span - c.gpus
            if n <= 0:
                break
            np.add(prev[:n], c.value, out=scratch[:n])
            np.maximum(cur[c.gpus:span], scratch[:n], out=cur[c.gpus:span])
        cur[span:] = cur[reach]


def _backtrack(
    options: Sequence[tuple[list[Choice], bool]], ids: Sequence[int], rows: np.ndarray, k: int
) -> dict[int, Choice]:
    """The C kernel's backtrack: later jobs yield on ties, then fewest GPUs (same rule)."""
    picks: dict[int, Choice] = {}
    for r in range(len(options), 0, -1):
        choices, required = options[r - 1]
        prev, target = rows[r - 1], rows[r][k]
        if not required and prev[k] == target:
            continue
        for c in choices:
            if c.gpus <= k and prev[k - c.gpus] + c.value == target:
                picks[ids[r - 1]] = c
                k -= c.gpus
                break
        else:  # pragma: no cover - the forward pass guarantees a witness
            raise AssertionError(f"no witness for job index {ids[r - 1]} at {k} GPUs")
    return picks
