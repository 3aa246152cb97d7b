"""The six reference training jobs of the Pollux/Sia traces and their per-model constants.

An ``Application`` joins a model's efficiency (progress, gain) with its throughput model on every
accelerator type it was measured on. Constants from Pollux's and Sia's simulators (their
artifacts, cited in ``providers/data/sia-sosp23/SOURCE.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.goodput import Efficiency
from policies.models import Accelerator
from policies.trace_throughput import Placement, ThroughputModel


@dataclass(frozen=True)
class AppSpec:
    name: str
    max_batch_size: int
    max_epochs: int
    restart_s: float  # Sia's per-model checkpoint-restore delay
    sia_slowdown: float  # Sia's calibration of simulated to real goodput


APP_SPECS: dict[str, AppSpec] = {
    s.name: s
    for s in (
        AppSpec("cifar10", 4096, 100, 50, 1.8),
        AppSpec("imagenet", 12800, 90, 250, 1.2),
        AppSpec("deepspeech2", 640, 80, 25, 1.2),
        AppSpec("bert", 384, 2, 120, 1.2),
        AppSpec("yolov3", 512, 50, 80, 1.2),
        AppSpec("ncf", 32768, 10, 15, 1.5),
    )
}

# File suffix of each accelerator's measurements, and its GPUs per node in those measurements.
ACCELERATOR_TRACES: dict[Accelerator, tuple[str, int]] = {
    Accelerator.T4: ("aws", 4),
    Accelerator.V100: ("azure", 8),
    Accelerator.A100: ("dgx-ext", 8),
    Accelerator.RTX6000: ("quad", 4),
    Accelerator.RTX2080TI: ("rtx", 8),
}

# Per-GPU batch limits the simulators set by hand (memory), overriding the measured maximum.
MAX_LOCAL_BSZ_OVERRIDES: dict[tuple[str, Accelerator], int] = {
    ("yolov3", Accelerator.T4): 8,  # Pollux's simulator
    ("deepspeech2", Accelerator.RTX2080TI): 57,  # Sia's simulator
}


@dataclass
class Application:
    """One model: its constants, efficiency and a throughput model per accelerator type."""

    spec: AppSpec
    efficiency: Efficiency
    throughput: dict[Accelerator, ThroughputModel] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def init_batch_size(self) -> int:
        return self.efficiency.init_batch_size

    def on(self, accelerator: Accelerator) -> ThroughputModel:
        try:
            return self.throughput[accelerator]
        except KeyError:
            known = ", ".join(a.value for a in self.throughput)
            raise ValueError(
                f"no measurements of {self.name} on {accelerator.value}; measured on: {known}"
            ) from None

    def rate(self, accelerator: Accelerator, placement: Placement, batch_size: int,
             epoch: int) -> tuple[float, int]:
        """(goodput in M0-iterations per second, effective global batch); NaN if not runnable.

        The effective batch is what the GPUs really run: per-GPU micro-batch x accumulation
        steps x GPUs, capped so that it never exceeds the model's maximum batch.
        """
        model = self.on(accelerator)
        seconds, atomic, accum = model.iteration(placement, batch_size, self.spec.max_batch_size)
        effective = sum(placement) * atomic * (accum + 1)
        if not seconds > 0:
            return math.nan, effective
        return float(self.efficiency.gain(effective, epoch)) / seconds, effective
