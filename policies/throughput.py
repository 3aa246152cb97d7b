"""A simple job throughput model: samples/s of a data-parallel job on ``gpus`` GPUs at a global
batch size, from the job spec alone, refined by the throughput the job's agent measures.

Step time = fixed overhead + per-GPU batch x per-sample compute + all-reduce time that grows with
log2(GPUs); above ``per_gpu_max`` the step runs as several micro-steps (gradient accumulation),
each paying compute again but the all-reduce once. Value for the allocator is the normalised
throughput: the speed-up over the best single-GPU configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ThroughputModel:
    """Constants of the step-time model (seconds); defaults are a small CNN on a T4-class GPU."""

    sample_time_s: float = 0.002  # compute per sample on one GPU
    step_overhead_s: float = 0.01  # per micro-step fixed cost (kernel launches, data loading)
    sync_s: float = 0.015  # one all-reduce round (x log2(GPUs)); 0 on a single GPU
    scale: float = 1.0  # measured / modelled throughput, from agent heartbeats

    def step_time(self, gpus: int, batch_size: int, per_gpu_max: int | None = None) -> float:
        per_gpu = batch_size / gpus
        micro = max(1, math.ceil(per_gpu / per_gpu_max)) if per_gpu_max else 1
        compute = micro * self.step_overhead_s + per_gpu * self.sample_time_s
        sync = self.sync_s * math.log2(gpus) if gpus > 1 else 0.0
        return compute + sync

    def throughput(self, gpus: int, batch_size: int, per_gpu_max: int | None = None) -> float:
        """Samples per second."""
        return self.scale * batch_size / self.step_time(gpus, batch_size, per_gpu_max)

    def calibrated(self, gpus: int | None, batch_size: int | None,
                   samples_per_sec: float | None, per_gpu_max: int | None = None,
                   ) -> ThroughputModel:
        """The model rescaled so it predicts the measured throughput at the measured
        configuration (clamped to [0.05, 20] so one noisy sample cannot swing it wildly)."""
        if not gpus or not batch_size or not samples_per_sec or samples_per_sec <= 0:
            return self
        base = ThroughputModel(self.sample_time_s, self.step_overhead_s, self.sync_s, 1.0)
        ratio = samples_per_sec / base.throughput(gpus, batch_size, per_gpu_max)
        return ThroughputModel(self.sample_time_s, self.step_overhead_s, self.sync_s,
                               min(20.0, max(0.05, ratio)))


def batch_candidates(lo: int, hi: int, gpus: int) -> list[int]:
    """Global batch sizes worth trying in [lo, hi] on ``gpus`` GPUs: both ends and the powers of
    two between, each at least one sample per GPU."""
    out = {lo, hi}
    b = 1
    while b < hi:
        if b > lo:
            out.add(b)
        b *= 2
    return sorted(x for x in out if x >= gpus)
