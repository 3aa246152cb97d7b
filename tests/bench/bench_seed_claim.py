"""The seed paper's claim, elastic vs fixed-batch under admission drop, across loads 0.5x-2.0x on
64 T4: the live round's two policies with the broker's default settings (gradient accumulation
allowed, as the job model always allows it). Writes ``examples/results/seed_claim.json``.

Run: ``python -m tests.bench seed_claim``.
"""

from __future__ import annotations

import json

from broker.scheduler import Admission, Policy
from broker.sim.engine import SimConfig
from tests.bench.bench_simulator import LOADS, RESULTS, WORKLOADS, _run


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    print("| load | elastic completed | fixed-batch completed | ratio | elastic JCT | "
          "fixed-batch JCT | JCT ratio | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for x, d in LOADS.items():
        folder = WORKLOADS / "pollux-osdi21" / d
        e = _run(folder, "t4:16x4", SimConfig(Policy.ELASTIC, Admission.DROP))
        f = _run(folder, "t4:16x4", SimConfig(Policy.FIXED_BATCH, Admission.DROP))
        out[str(x)] = {"elastic": e, "fixed-batch": f}
        print(f"| {x}x | {e['completed']} | {f['completed']} | "
              f"{e['completed'] / f['completed']:.2f} | {e['avg_jct_h']:.3f} h | "
              f"{f['avg_jct_h']:.3f} h | {f['avg_jct_h'] / e['avg_jct_h']:.2f} | "
              f"{e['wall_s'] + f['wall_s']:.0f} s |", flush=True)
    (RESULTS / "seed_claim.json").write_text(json.dumps(out, indent=1) + "\n")
