"""Writes ``pollux-wN-deadlines.csv``: Pollux's workloads 1-8 with a ``deadline`` column.

Each job's deadline is ``K[i % 3]`` times its isolated run time: the job alone, at its requested
GPUs and batch, on the V100 nodes of ``examples/clusters/spot-v100.yaml`` (on-demand, never
preempted), plus one restart. Run from the repository root:
``python -m examples.workloads.spot.make_workload``.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from broker.sim.cluster import fleet_capacity, parse_cluster
from broker.sim.engine import SimConfig, SimState, SimulationError, make_job
from broker.sim.workload import read_workload
from policies.choices import TypeCapacity, placement_for

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ROOT / "examples" / "workloads" / "pollux-osdi21" / "workloads"
WORKLOADS = range(1, 9)
K = (1.5, 2.0, 3.0)  # tight, medium, loose


def isolated_s(state: SimState, types: Sequence[TypeCapacity]) -> float:
    """Seconds of work of the job alone at its requested GPUs (capped at the type's) and batch,
    on its fastest type of the cluster."""
    eff = state.app.efficiency
    bounds = eff.boundaries
    best = math.inf
    for cap in types:
        if cap.accelerator not in state.app.throughput:
            continue
        placement = placement_for(min(state.workload_gpus, cap.gpus), cap.gpus_per_node)
        seconds = 0.0
        for e in range(eff.max_epochs):
            rate, _ = state.app.rate(cap.accelerator, placement, state.workload_batch, e)
            seconds += (bounds[e + 1] - bounds[e]) * (state.slowdown / rate if rate > 0
                                                      else math.inf)
        best = min(best, seconds)
    if not math.isfinite(best):
        raise SimulationError(f"job {state.id}: {state.app.name} cannot run at its requested "
                              f"{state.workload_gpus} GPUs and batch {state.workload_batch}")
    return best


def main() -> None:
    cfg = SimConfig()
    types = fleet_capacity(parse_cluster("v100:4x8"))
    for n in WORKLOADS:
        rows = []
        for i, w in enumerate(read_workload(SOURCES / f"workload-{n}.csv")):
            state = make_job(w, cfg).state
            alone_s = isolated_s(state, types) + state.restart_s
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
