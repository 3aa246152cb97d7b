"""Step time and throughput of a data-parallel job from measured tables (Pollux's conventions).

Pure: the tables come in as arrays (``providers.measurements`` reads the CSVs). A placement is a
tuple of GPUs per node. Lookup: the measured placement (lexicographically smallest rotation),
interpolated linearly in per-GPU batch; otherwise a linear interpolation over
(nodes, GPUs, per-GPU batch) of all measurements. Beyond the per-GPU batch limit the job uses
gradient accumulation: ``a`` extra micro-steps cost ``a x (step_time - sync_time)`` each.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.interpolate import LinearNDInterpolator

from policies.models import Accelerator

Placement = tuple[int, ...]


@dataclass(frozen=True)
class StepTable:
    """Measured (per-GPU batch -> step, sync seconds) for one model on one accelerator type.

    ``placements`` maps a canonical placement to rows sorted by per-GPU batch;
    ``scalability`` holds rows ``(nodes, gpus, local_bsz, step_time, sync_time)``.
    """

    model: str
    accelerator: Accelerator
    gpus_per_node: int
    placements: dict[Placement, np.ndarray]  # rows (local_bsz, step_time, sync_time)
    scalability: np.ndarray
    max_local_bsz_override: int | None = None


def canonical(placement: Placement) -> Placement:
    """Drop empty nodes and rotate to the lexicographically smallest rotation."""
    p = tuple(n for n in placement if n)
    if not p:
        raise ValueError("a placement needs at least one GPU")
    return min(p[i:] + p[:i] for i in range(len(p)))


def packed_placement(gpus: int, gpus_per_node: int) -> Placement:
    """The placement of ``gpus`` filling whole nodes first (the remainder on one node)."""
    full, rest = divmod(gpus, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


@dataclass
class ThroughputModel:
    """Step time for any (placement, per-GPU batch) of one model on one accelerator type."""

    table: StepTable
    _interp: LinearNDInterpolator | None = field(default=None, init=False, repr=False)
    _cache: dict[tuple[Placement, int], tuple[float, float]] = field(
        default_factory=dict, init=False, repr=False
    )

    @functools.cached_property
    def min_local_bsz(self) -> int:
        return int(min(rows[0, 0] for rows in self.table.placements.values()))

    @functools.cached_property
    def max_local_bsz(self) -> int:
        measured = int(max(rows[-1, 0] for rows in self.table.placements.values()))
        override = self.table.max_local_bsz_override
        return min(measured, override) if override else measured

    def local_bsz_limit(self, placement: Placement) -> int:
        """Largest per-GPU batch measured for this placement (or for larger ones), as in Sia."""
        p = canonical(placement)
        rows = self.table.placements.get(p)
        if rows is not None:
            limit = int(rows[-1, 0])
        else:
            sc = self.table.scalability
            ok = (sc[:, 0] >= len(p)) & (sc[:, 1] >= sum(p))
            limit = int(sc[ok, 2].max()) if ok.any() else int(sc[:, 2].max())
        return min(limit, self.max_local_bsz)

    def step_sync(self, placement: Placement, local_bsz: int) -> tuple[float, float]:
        """(step_time, sync_time) seconds of one iteration; NaN where the tables cannot tell."""
        p = canonical(placement)
        key = (p, int(local_bsz))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rows = self.table.placements.get(p)
        if rows is not None:
            xs = rows[:, 0]
            if xs[0] <= local_bsz <= xs[-1]:
                out = (float(np.interp(local_bsz, xs, rows[:, 1])),
                       float(np.interp(local_bsz, xs, rows[:, 2])))
            else:
                out = (math.nan, math.nan)
        else:
            nodes = min(len(p), 16)  # the measurements stop at 16 nodes (Pollux clamps the same)
            val = self._interpolator()([[nodes, sum(p), local_bsz]])[0]
            out = (float(val[0]), float(val[1]))
        self._cache[key] = out
        return out

    def _interpolator(self) -> LinearNDInterpolator:
        if self._interp is None:
            pts, vals = [], []
            for p, rows in self.table.placements.items():
                for bsz, step, sync in rows:
                    pts.append((len(p), sum(p), bsz))
                    vals.append((step, sync))
            # Pollux averages the placement rows per (nodes, gpus, bsz) before adding scalability.
            grouped: dict[tuple[float, float, float], list[tuple[float, float]]] = {}
            for pt, v in zip(pts, vals, strict=True):
                grouped.setdefault(pt, []).append(v)
            xs = [list(k) for k in grouped]
            ys = [list(np.mean(v, axis=0)) for v in grouped.values()]
            sc = self.table.scalability
            xs += sc[:, :3].tolist()
            ys += sc[:, 3:5].tolist()
            self._interp = LinearNDInterpolator(np.array(xs, float), np.array(ys, float))
        return self._interp

    def iteration(self, placement: Placement, batch_size: int,
                  max_batch_size: int | None = None) -> tuple[float, int, int]:
        """(seconds per iteration, per-GPU micro-batch, accumulation steps) at a global batch.

        Splits ``batch_size`` over the GPUs; what exceeds the per-GPU limit runs as extra
        accumulation micro-steps. NaN seconds when the configuration is not runnable.
        """
        gpus = sum(placement)
        local = math.ceil(batch_size / gpus - 1e-8)
        limit = self.local_bsz_limit(placement)
        accum = math.ceil(local / limit - 1e-8) - 1
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        if max_batch_size is not None:
            atomic = min(atomic, int(max_batch_size / (gpus * (accum + 1))))
        if atomic < self.min_local_bsz:
            return math.nan, atomic, accum
        step, sync = self.step_sync(placement, atomic)
        return step + accum * (step - sync), atomic, accum

    def throughput(self, placement: Placement, batch_size: int) -> float:
        """Samples per second at a global batch size (NaN when not runnable)."""
        seconds, atomic, accum = self.iteration(placement, batch_size)
        return sum(placement) * atomic * (accum + 1) / seconds
