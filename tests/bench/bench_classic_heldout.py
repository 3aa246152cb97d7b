"""The live round's value settings on data they were not chosen on: tuned on half of the
workloads, reported on the other half and on a cluster nothing was tuned on.

Protocol: ``SchedulerConfig.speedup_exponent`` and ``restart_horizon_s`` were chosen on Pollux's
workloads 1-4 (TUNING); this bench reports them there and on workloads 5-8 (HELD-OUT) at every
load of Pollux's 64 T4 (``t4:16x4``, 60 s rounds, 30 s restarts), and on the heterogeneous
cluster with Sia's conventions (``t4:6x4,2080ti:3x8,a100:2x8``, Philly traces, per-model restarts,
Sia's slowdowns), on which nothing was tuned. Everything runs at the product's defaults, the
``elastic`` policy. Writes ``examples/results/classic_heldout.json``.

Run: ``python -m tests.bench classic_heldout`` (``BENCH_WORKERS`` processes, default 2).
"""

from __future__ import annotations

import json
import time
from datetime import date
from pathlib import Path

from broker.sim.batch import run_files
from broker.sim.cluster import read_pool_specs
from broker.sim.engine import SimConfig
from broker.sim.report import summary
from broker.sim.rounds import classic_pools
from tests.bench.bench_hetero import HETERO
from tests.bench.bench_simulator import LOADS, PUBLISHED, RESULTS, WORKERS, WORKLOADS

SIDES = {"tuning": range(1, 5), "held-out": range(5, 9)}


def _avg(paths: list[Path], cluster: str, cfg: SimConfig) -> dict:
    t0 = time.perf_counter()
    out = summary(run_files(paths, classic_pools(read_pool_specs(cluster)), cfg, WORKERS), {})
    return {"avg_jct_h": out["avg_jct_h"], "per_workload_h": [
        p["avg_jct_h"] for p in out["per_workload"]], "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict = {"date": date.today().isoformat(), "pollux_t4": {}, "hetero": None}
    print("| load | tuning (workloads 1-4) | held-out (5-8) | all eight | Pollux (published) |")
    print("|---|---|---|---|---|")
    for load, folder in LOADS.items():
        row = {side: _avg([WORKLOADS / "pollux-osdi21" / folder / f"workload-{i}.csv"
                           for i in ids], "t4:16x4", SimConfig())
               for side, ids in SIDES.items()}
        both = (row["tuning"]["avg_jct_h"] + row["held-out"]["avg_jct_h"]) / 2
        out["pollux_t4"][str(load)] = {**row, "all_avg_jct_h": round(both, 4)}
        print(f"| {load}x | {row['tuning']['avg_jct_h']:.3f} h | "
              f"{row['held-out']['avg_jct_h']:.3f} h | {both:.3f} h | "
              f"{PUBLISHED['Pollux (published)'][load]} h |", flush=True)
    paths = sorted((WORKLOADS / "sia-sosp23" / "philly").glob("*.csv"))
    out["hetero"] = _avg(paths, HETERO, SimConfig(restart_penalty=None, sia_slowdown=True))
    print(f"\nheterogeneous {HETERO}, Philly, Sia's conventions (held out): "
          f"{out['hetero']['avg_jct_h']:.3f} h (Sia published 0.6 h)")
    (RESULTS / "classic_heldout.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS / 'classic_heldout.json'}")


if __name__ == "__main__":
    main()
