"""Heterogeneous fleet with Sia's conventions (per-model restarts, calibration slowdowns): the
eight Philly-derived workloads on ``t4:6x4,2080ti:3x8,a100:2x8``, against Sia's published table.
The live round's policies with the broker's default settings, and the Tiresias baseline. Writes
``examples/results/hetero.json``. Run: ``python -m tests.bench hetero``.
"""

from __future__ import annotations

import json

from broker.scheduler import Policy
from broker.sim.engine import Baseline, SimConfig
from tests.bench.bench_simulator import RESULTS, WORKLOADS, _run

HETERO = "t4:6x4,2080ti:3x8,a100:2x8"
VARIANTS = [
    ("elastic", Policy.ELASTIC),
    ("fixed-batch", Policy.FIXED_BATCH),
    ("tiresias (baseline)", Baseline.TIRESIAS),
]


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {}
    print(f"| policy on {HETERO}, philly, Sia conventions | avg JCT | p99 | makespan | "
          "rescales | wall |")
    print("|---|---|---|---|---|---|")
    for label, pol in VARIANTS:
        r = _run(WORKLOADS / "sia-sosp23" / "philly", HETERO,
                 SimConfig(policy=pol, restart_penalty=None, sia_slowdown=True))
        out[label] = r
        print(f"| {label} | {r['avg_jct_h']:.3f} h | {r['p99_jct_h']:.2f} h | "
              f"{r['makespan_h']:.2f} h | {r['rescales']} | {r['wall_s']:.0f} s |", flush=True)
    print("| Sia / Pollux / Gavel (published) | 0.6 / 1.0 / 1.9 h | | | | |")
    (RESULTS / "hetero.json").write_text(json.dumps(out, indent=1) + "\n")
