"""A job's model, fitted online: useful samples per second over (accelerator, GPUs, global batch).

"Useful" samples are those that count toward the job's ``work_samples``: plain samples for a job
without statistical-efficiency data, samples at the initial batch's efficiency for a job whose
spec names a measured model (Pollux's goodput: throughput x statistical efficiency of the batch).

Prior, before the job reports anything:

- :class:`TablePrior` when the spec names a measured model (``policies.apps``): step times per
  placement from the public tables and the gradient-noise-scale gain at the job's epoch;
- :class:`GenericPrior` otherwise: ``policies.throughput.ThroughputModel``'s step-time form
  (overhead per micro-step + compute per sample + all-reduce x log2 GPUs).

Fit, from what the job's agent measured (useful samples/s per configuration, on the accelerator
the job ran on, and the gradient noise scale the runtime measures from its replicas' gradients):
a generic prior takes the measured noise scale, and its three step-time constants (and, while no
noise scale was measured, the noise scale itself) are refitted (:func:`refit`: non-negative
least squares, held towards the prior by a ridge term so that one measurement moves them only a
little and many pin them down, as Pollux fits its throughput and efficiency models from the
job's own reports); every prior is then rescaled by the geometric mean of measured / predicted;
and a configuration that was measured is predicted as measured. Pure: the tables come in as objects.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import nnls

from policies.apps import ACCELERATOR_TRACES, Application
from policies.models import Accelerator
from policies.throughput import ThroughputModel
from policies.trace_throughput import packed_placement

MIN_SCALE, MAX_SCALE = 0.05, 20.0  # one noisy sample must not swing the model wildly
RIDGE = 0.3  # weight of the prior's constants against each measurement in the refit

Measurement = tuple[int, int, float]  # (GPUs, global batch, samples/s)


@dataclass(frozen=True)
class GenericPrior:
    """The step-time model from the spec alone (``per_gpu_max``: gradient accumulation above),
    times the statistical efficiency of the batch against the job's initial batch
    ``init_batch``: ``(noise + 1) / (noise + batch / init_batch)``, where ``noise`` is the
    gradient noise scale in initial batches (infinite: no loss, the prior's assumption)."""

    model: ThroughputModel = field(default_factory=ThroughputModel)
    per_gpu_max: int | None = None
    init_batch: int = 1
    noise: float = math.inf

    def rate(self, accelerator: Accelerator | None, gpus: int, batch: int) -> float:
        return self.model.throughput(gpus, batch, self.per_gpu_max) * self.efficiency(batch)

    def efficiency(self, batch: int) -> float:
        if math.isinf(self.noise):
            return 1.0
        return (self.noise + 1) / (self.noise + batch / self.init_batch)

    def measured_on(self, accelerator: Accelerator | None) -> bool:
        """Every accelerator shares the generic form, so measurements anywhere inform it."""
        return True


@dataclass(frozen=True)
class TablePrior:
    """The measured tables of ``name`` (``policies.apps.Application``) at ``epoch``: goodput in
    samples at the initial batch per second; accelerators without tables use ``fallback``."""

    name: str
    epoch: int
    app: Application = field(compare=False, hash=False, repr=False)
    fallback: GenericPrior = field(default_factory=GenericPrior)

    def rate(self, accelerator: Accelerator | None, gpus: int, batch: int) -> float:
        if accelerator not in self.app.throughput:
            return self.fallback.rate(accelerator, gpus, batch)
        return _table_rate(self, accelerator, gpus, batch)

    def measured_on(self, accelerator: Accelerator | None) -> bool:
        return accelerator in self.app.throughput


@functools.lru_cache(maxsize=262_144)
def _table_rate(prior: TablePrior, accelerator: Accelerator, gpus: int, batch: int) -> float:
    """A table's goodput in samples at the initial batch per second (the tables interpolate,
    so every configuration is looked up once)."""
    per_node = ACCELERATOR_TRACES[accelerator][1]
    goodput, _ = prior.app.rate(accelerator, packed_placement(gpus, per_node), batch, prior.epoch)
    return goodput * prior.app.init_batch_size if goodput > 0 else 0.0


Prior = GenericPrior | TablePrior


@dataclass(frozen=True)
class JobModel:
    """Useful samples/s of one job anywhere: its prior rescaled by ``scale`` (fitted on
    ``accelerator``), the measured configurations exactly there."""

    prior: Prior
    scale: float = 1.0
    accelerator: Accelerator | None = None  # where the measurements were taken
    measured: tuple[Measurement, ...] = ()

    def rate(self, accelerator: Accelerator | None, gpus: int, batch: int) -> float:
        if accelerator == self.accelerator:
            for g, b, y in self.measured:
                if (g, b) == (gpus, batch):
                    return y
        return self.scale * self.prior.rate(accelerator, gpus, batch)


def fit(prior: Prior, measured: Sequence[Measurement],
        accelerator: Accelerator | None = None, noise_known: bool = False) -> JobModel:
    """The job's model from its prior and what it measured on ``accelerator`` (``noise_known``:
    the generic prior's noise scale was measured, not assumed)."""
    obs = tuple(sorted((g, b, y) for g, b, y in measured if g > 0 and b > 0 and y > 0))
    if not obs:
        return JobModel(prior, 1.0, accelerator)
    if isinstance(prior, GenericPrior):
        prior = refit(prior, obs, noise_known)
    ratios = [y / p for g, b, y in obs if (p := prior.rate(accelerator, g, b)) > 0]
    scale = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0
    return JobModel(prior, min(MAX_SCALE, max(MIN_SCALE, scale)), accelerator, obs)


# gradient noise scales tried by the refit, in initial batches (infinite: no statistical loss)
NOISE_GRID = (math.inf, *np.geomspace(0.05, 2000, 28).tolist())


def refit(prior: GenericPrior, obs: Sequence[Measurement],
          noise_known: bool = False) -> GenericPrior:
    """The step-time constants (overhead per micro-step, compute per sample, all-reduce per
    log2 GPU) and the gradient noise scale that best explain the measured samples/s. For each
    noise scale of ``NOISE_GRID`` the step time is linear in the constants, fitted by
    non-negative least squares in relative error with each constant held towards the prior's by
    ``RIDGE``; the noise scale with the smallest residual wins (only batches that differ tell
    it: with one batch size, or ``noise_known``, measured, the prior's stays)."""
    model = prior.model
    base = np.array([model.step_overhead_s, model.sample_time_s, model.sync_s])
    ref = np.where(base > 0, base, 1.0)
    ridge_a, ridge_b = RIDGE * np.diag(1 / ref), RIDGE * base / ref
    searched = not noise_known and len({b for _, b, _ in obs}) > 1
    grid = NOISE_GRID if searched else (prior.noise,)
    best: tuple[float, np.ndarray, float] | None = None
    for noise in grid:
        eff = replace(prior, noise=noise)
        rows = []
        for g, b, y in obs:
            step = b * eff.efficiency(b) / y  # seconds a step takes, the efficiency taken out
            micro = max(1, math.ceil(b / g / prior.per_gpu_max)) if prior.per_gpu_max else 1
            rows.append([micro / step, (b / g) / step,
                         (math.log2(g) if g > 1 else 0.0) / step])
        a = np.vstack([np.array(rows), ridge_a])
        rhs = np.concatenate([np.ones(len(rows)), ridge_b])
        x, residual = nnls(a, rhs)
        if best is None or residual < best[2] - 1e-12:
            best = (noise, x, residual)
    assert best is not None
    noise, x, _ = best
    return replace(prior, noise=noise,
                   model=ThroughputModel(sample_time_s=float(x[1]), step_overhead_s=float(x[0]),
                                         sync_s=float(x[2])))


def measurement_key(accelerator: Accelerator, gpus: int, batch: int) -> str:
    """How a measured configuration is keyed in a job's record: ``"T4:2x64"``."""
    return f"{accelerator.value}:{gpus}x{batch}"


def measurements(measured: Mapping[str, float],
                 accelerator: Accelerator) -> tuple[Measurement, ...]:
    """The measurements on ``accelerator`` of an agent-reported ``measurement_key -> samples/s``
    map."""
    out = []
    prefix = f"{accelerator.value}:"
    for key, y in measured.items():
        if key.startswith(prefix):
            g, _, b = key[len(prefix):].partition("x")
            if g.isdigit() and b.isdigit():
                out.append((int(g), int(b), float(y)))
    return tuple(sorted(out))
