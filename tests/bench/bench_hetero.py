"""Heterogeneous fleet with Sia's conventions (per-model restarts, calibration slowdowns): the
eight Philly-derived workloads on ``t4:6x4,2080ti:3x8,a100:2x8``, against Sia's published table.
Writes ``examples/results/hetero.json``. Run: ``python -m tests.bench hetero``.
"""

from __future__ import annotations

import json

from broker.sim.engine import SimConfig
from policies.choices import ValueConfig, ValueFunction
from policies.schedulers import PolicyName
from tests.bench.bench_simulator import FAIR, RESULTS, SPEEDUP, WORKLOADS, _run

HETERO = "t4:6x4,2080ti:3x8,a100:2x8"
VARIANTS = [
    ("elastic, fair p=0.5", PolicyName.ELASTIC, ValueConfig(ValueFunction.FAIR, 0.5)),
    ("elastic, fair p=0.25", PolicyName.ELASTIC, FAIR),
    ("elastic, fair p=0.25, migrate", PolicyName.ELASTIC, FAIR),
    ("elastic, speedup value", PolicyName.ELASTIC, SPEEDUP),
    ("fixed-batch, fair p=0.5", PolicyName.FIXED_BATCH, ValueConfig(ValueFunction.FAIR, 0.5)),
    ("tiresias", PolicyName.TIRESIAS, SPEEDUP),
]


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {}
    print(f"| policy on {HETERO}, philly, Sia conventions | avg JCT | p99 | makespan | "
          "rescales |")
    print("|---|---|---|---|---|")
    for label, pol, value in VARIANTS:
        r = _run(WORKLOADS / "sia-sosp23" / "philly", HETERO,
                 SimConfig(policy=pol, restart_penalty=None, sia_slowdown=True, value=value,
                           migrate=label.endswith("migrate")))
        out[label] = r
        print(f"| {label} | {r['avg_jct_h']:.3f} h | {r['p99_jct_h']:.2f} h | "
              f"{r['makespan_h']:.2f} h | {r['rescales']} |", flush=True)
    print("| Sia / Pollux / Gavel (published) | 0.6 / 1.0 / 1.9 h | | | |")
    (RESULTS / "hetero.json").write_text(json.dumps(out, indent=1) + "\n")
