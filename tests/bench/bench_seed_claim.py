"""The seed paper's claim (elastic vs fixed-batch, admission drop) with and without gradient
accumulation, across loads 0.5x-2.0x on 64 T4. Writes ``examples/results/seed_claim.json``.

Run: ``python -m tests.bench seed_claim``.
"""

from __future__ import annotations

import json

from broker.sim.engine import SimConfig
from policies.schedulers import Admission, PolicyName
from tests.bench.bench_simulator import FAIR, LOADS, RESULTS, WORKLOADS, _run

SETTINGS = {  # label: (elastic may accumulate, fixed-batch may accumulate)
    "both accumulate": (True, True),
    "neither accumulates": (False, False),
    "only elastic accumulates": (True, False),
}


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    print("| setting | load | elastic completed | fixed-batch completed | ratio | elastic JCT | "
          "fixed-batch JCT | JCT ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for label, (acc_e, acc_f) in SETTINGS.items():
        out[label] = {}
        for x, d in LOADS.items():
            folder = WORKLOADS / "pollux-osdi21" / d
            e = _run(folder, "t4:16x4", SimConfig(PolicyName.ELASTIC, Admission.DROP,
                                                  value=FAIR, accumulation=acc_e))
            f = _run(folder, "t4:16x4", SimConfig(PolicyName.FIXED_BATCH, Admission.DROP,
                                                  value=FAIR, accumulation=acc_f))
            out[label][str(x)] = {"elastic": e, "fixed-batch": f}
            print(f"| {label} | {x}x | {e['completed']} | {f['completed']} | "
                  f"{e['completed'] / f['completed']:.2f} | {e['avg_jct_h']:.3f} h | "
                  f"{f['avg_jct_h']:.3f} h | {f['avg_jct_h'] / e['avg_jct_h']:.2f} |", flush=True)
    (RESULTS / "seed_claim.json").write_text(json.dumps(out, indent=1) + "\n")
