"""Data order and batch plans: which samples each rank sees, from (seed, epoch, index) only.

The sample stream is the concatenation of one permutation of the data set per epoch; global
position ``p`` is sample ``perm(seed, p // n)[p % n]``. A step with global batch ``B`` takes the
next ``B`` positions; rank ``r`` of ``W`` takes the contiguous slice ``[r*B//W, (r+1)*B//W)`` of
them and splits it into micro-batches of at most ``max_micro_batch`` samples (gradient
accumulation). The world size therefore decides who computes a sample, never which samples a step
contains, so a resize neither repeats nor skips data.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the ``n`` samples in ``epoch`` (PCG64, stable across numpy versions)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_indices(seed: int, n: int, start: int, stop: int) -> np.ndarray:
    """Data-set indices at global stream positions ``[start, stop)``."""
    out = np.empty(stop - start, dtype=np.int64)
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos, n)
        take = min(stop - pos, n - offset)
        out[pos - start : pos - start + take] = epoch_permutation(seed, epoch, n)[
            offset : offset + take
        ]
        pos += take
    return out


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of one rank: its samples and its share of the global batch."""

    indices: np.ndarray
    weight: float  # len(indices) / global batch: the factor its mean-loss gradient carries
    last: bool  # the optimizer steps after this one


def rank_slice(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    return rank * global_batch // world_size, (rank + 1) * global_batch // world_size


def step_plan(
    seed: int,
    n: int,
    samples_done: int,
    global_batch: int,
    world_size: int,
    rank: int,
    max_micro_batch: int | None,
    *,
    pad: bool = False,
    even: bool = False,
) -> list[MicroBatch]:
    """The micro-batches rank ``rank`` runs for the step that starts at ``samples_done``.

    ``pad``: a step of fewer samples than ranks (a job's last step after a resize to more
    ranks than samples left) gives a rank without a sample the step's first one with weight 0:
    it joins the step's collectives and adds nothing, and the step holds exactly its samples.

    ``even``: every rank runs the same number of micro-batches (the widest rank's), as FSDP
    needs, since each forward and backward is a collective (all-gather, reduce-scatter); a
    rank with fewer samples than micro-batches pads with such weight-0 micro-batches.
    """
    if global_batch < world_size and not pad:
        raise ValueError(
            f"global batch size {global_batch} is smaller than the world size {world_size}; "
            "give every worker at least one sample (raise the batch size or use fewer workers)"
        )
    lo, hi = rank_slice(global_batch, world_size, rank)
    local = hi - lo
    widest = -(-global_batch // world_size) if even else local
    parts = max(1, -(-widest // max_micro_batch)) if max_micro_batch else 1
    idx = sample_indices(seed, n, samples_done + lo, samples_done + hi)
    first = sample_indices(seed, n, samples_done, samples_done + 1)
    bounds = [local * i // parts for i in range(parts + 1)]
    return [
        MicroBatch(idx[a:b], (b - a) / global_batch, i == parts - 1)
        if b > a
        else MicroBatch(first, 0.0, i == parts - 1)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
