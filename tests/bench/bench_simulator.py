"""Simulator tables: the live round's policies and the Tiresias baseline across loads on 64 T4,
with the JCT-vs-load plot.

Every policy but Tiresias is the live broker's scheduling round (``broker.sim.driver``) with the
broker's default settings; Tiresias is a baseline, for comparison only. Writes
``examples/results/``; the seed paper's claim is ``bench_seed_claim``, the heterogeneous
comparison ``bench_hetero``.

Run: ``python -m tests.bench simulator`` (``BENCH_WORKERS`` processes, default 2).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from broker.scheduler import Policy
from broker.sim.batch import run_files
from broker.sim.cluster import read_pool_specs
from broker.sim.engine import Baseline, SimConfig
from broker.sim.report import summary
from broker.sim.rounds import classic_pools

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "examples" / "workloads"
RESULTS = ROOT / "examples" / "results"
LOADS = {0.5: "workloads-0.5", 1.0: "workloads", 1.5: "workloads-1.5", 2.0: "workloads-2.0"}
# (label, policy); labels are the rows of the tables and the plot's lines
VARIANTS = [
    ("elastic", Policy.ELASTIC),
    ("fixed-batch", Policy.FIXED_BATCH),
    ("static", Policy.STATIC),
    ("tiresias (baseline)", Baseline.TIRESIAS),
]
PUBLISHED = {  # Pollux (OSDI'21), its simulator on 64 T4: average JCT per load
    "Pollux (published)": {0.5: 0.43, 1.0: 0.764, 1.5: 1.02, 2.0: 1.47},
    "Tiresias (published)": {0.5: 0.58, 1.0: 1.122, 1.5: 1.72, 2.0: 2.79},
}
WORKERS = int(os.environ.get("BENCH_WORKERS", "2"))


def _run(folder: Path, cluster: str, cfg: SimConfig) -> dict:
    t0 = time.perf_counter()
    paths = sorted(folder.glob("*.csv"))
    pools = classic_pools(read_pool_specs(cluster))
    # workloads named as in the repository, not by where this checkout lies
    runs = [(os.path.relpath(name, ROOT), r) for name, r in run_files(paths, pools, cfg, WORKERS)]
    out = summary(runs,
                  {"policy": cfg.policy.value, "cluster": cluster,
                   "admission": cfg.admission.value,
                   "restart_penalty": cfg.restart_penalty or "per-model",
                   "slowdown": "sia" if cfg.sia_slowdown else "none"})
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _loads(results: dict) -> None:
    print("| policy | " + " | ".join(f"{x}x" for x in LOADS) + " | wall |")
    print("|---|" + "---|" * (len(LOADS) + 1))
    for label in results:
        row = [f"{results[label][str(x)]['avg_jct_h']:.3f} h" for x in LOADS]
        wall = sum(results[label][str(x)]["wall_s"] for x in LOADS)
        print(f"| {label} | " + " | ".join(row) + f" | {wall:.0f} s |")
    for name, ref in PUBLISHED.items():
        print(f"| {name} | " + " | ".join(f"{ref[x]} h" for x in LOADS) + " | |")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = list(LOADS)
    for label in results:
        ax.plot(xs, [results[label][str(x)]["avg_jct_h"] for x in xs], marker="o",
                label=label)
    for name, ref in PUBLISHED.items():
        ax.plot(xs, [ref[x] for x in xs], linestyle="--", marker="x", label=name)
    ax.set_xlabel("job load (x the Pollux trace rate)")
    ax.set_ylabel("average JCT (h, mean of 8 workloads)")
    ax.set_title("64 T4 (t4:16x4), 60 s rounds, 30 s restarts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict = {"loads": {}}
    for label, pol in VARIANTS:
        out["loads"][label] = {
            str(x): _run(WORKLOADS / "pollux-osdi21" / d, "t4:16x4", SimConfig(policy=pol))
            for x, d in LOADS.items()
        }
    _loads(out["loads"])
    _plot(out["loads"], RESULTS / "jct_vs_load.png")

    (RESULTS / "simulator.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {RESULTS / 'simulator.json'} and {RESULTS / 'jct_vs_load.png'}")
