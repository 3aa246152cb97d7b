"""Writes ``pollux-wN-deadlines.csv``: Pollux's workloads 1-8 with a ``deadline`` column.

Each job's deadline is ``K[i % 3]`` times its isolated run time: the job alone, at its requested
GPUs and batch, on the V100 nodes of ``examples/clusters/spot-v100.yaml`` (on-demand, never
preempted), plus one restart. Run from the repository root:
``python -m examples.workloads.spot.make_workload``.
"""

from __future__ import annotations

import csv
from pathlib import Path

from broker.sim.cluster import fleet_capacity, parse_cluster
from broker.sim.engine import SimConfig, make_job
from broker.sim.spot import isolated_pace
from broker.sim.workload import read_workload

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ROOT / "examples" / "workloads" / "pollux-osdi21" / "workloads"
WORKLOADS = range(1, 9)
K = (1.5, 2.0, 3.0)  # tight, medium, loose


def main() -> None:
    cfg = SimConfig()
    types = fleet_capacity(parse_cluster("v100:4x8"))
    for n in WORKLOADS:
        rows = []
        for i, w in enumerate(read_workload(SOURCES / f"workload-{n}.csv")):
            state = make_job(w, cfg).state
            pace = isolated_pace(state, types)
            alone_s = pace.hours(state.app.efficiency.target) * 3600 + state.restart_s
            rows.append([w.name, int(w.time), w.application, w.num_replicas, w.batch_size,
                         round(K[i % len(K)] * alone_s)])
        out_path = Path(__file__).with_name(f"pollux-w{n}-deadlines.csv")
        with out_path.open("w", newline="") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(["name", "time", "application", "num_replicas", "batch_size", "deadline"])
            out.writerows(rows)
        print(f"wrote {out_path} ({len(rows)} jobs)")


if __name__ == "__main__":
    main()
