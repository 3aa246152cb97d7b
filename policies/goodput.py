"""Statistical efficiency of a batch size from measured gradient statistics (Pollux's model).

Progress is counted in iterations at the job's initial batch ``M0``. One iteration at batch
``M = s x M0`` adds ``gain = (var + sqr) / (var / s + sqr)`` (``grad_var``, ``grad_sqr`` from the
``validation-<bsz>.csv`` runs, interpolated between measured batch sizes, at the current epoch).
Efficiency model ``none`` is the seed paper's assumption: ``gain = s`` inside the batch range.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class EfficiencyModel(StrEnum):
    GNS = "gns"  # gradient-noise-scale efficiency (Pollux)
    NONE = "none"  # no statistical loss inside the batch range (seed paper)


@dataclass(frozen=True)
class ValidationTable:
    """Per measured global batch size: epoch-end progress and gradient statistics per epoch.

    ``batch_sizes`` ascending; ``progress``, ``grad_sqr``, ``grad_var`` have one row per batch
    size and one column per epoch.
    """

    model: str
    batch_sizes: np.ndarray
    progress: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray


@dataclass(frozen=True)
class Efficiency:
    """Epoch bookkeeping and per-iteration gain for one model trained for ``max_epochs``."""

    table: ValidationTable
    max_epochs: int
    model: EfficiencyModel = EfficiencyModel.GNS

    @property
    def init_batch_size(self) -> int:
        return int(self.table.batch_sizes[0])

    @functools.cached_property
    def boundaries(self) -> np.ndarray:
        """Progress at the start of epochs 0..max_epochs (the minimum over the runs, as Pollux)."""
        ends = self.table.progress[:, : self.max_epochs].min(axis=0)
        return np.concatenate([[0.0], ends])

    @functools.cached_property
    def target(self) -> float:
        """Progress (M0 iterations) at which the job is complete."""
        return float(self.boundaries[-1])

    def epoch(self, progress: float) -> int:
        """The epoch a job at ``progress`` is in (0-based, capped at the last epoch)."""
        e = int(np.searchsorted(self.boundaries, progress, side="right")) - 1
        return min(max(e, 0), self.max_epochs - 1)

    def noise_scale(self, batch_size: float, epoch: int) -> float:
        """The gradient noise scale in samples at ``batch_size`` during ``epoch``, what a job's
        runtime would measure: the table's gradient variance over its squared norm (in initial
        batches) times the initial batch."""
        xs = self.table.batch_sizes.astype(float)
        sqr = float(np.interp(batch_size, xs, self.table.grad_sqr[:, epoch]))
        var = float(np.interp(batch_size, xs, self.table.grad_var[:, epoch]))
        return var / sqr * self.init_batch_size if sqr > 0 else math.inf

    def gain(self, batch_size: np.ndarray | float, epoch: int) -> np.ndarray:
        """M0-iterations of progress per iteration at ``batch_size`` during ``epoch``."""
        bsz = np.asarray(batch_size, dtype=float)
        scale = bsz / self.init_batch_size
        if self.model is EfficiencyModel.NONE:
            return scale
        xs = self.table.batch_sizes.astype(float)
        sqr = np.interp(bsz, xs, self.table.grad_sqr[:, epoch])
        var = np.interp(bsz, xs, self.table.grad_var[:, epoch])
        return (var + sqr) / (var / scale + sqr)
