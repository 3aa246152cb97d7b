"""Writes ``pollux-wN-deadlines.csv``: Pollux's workloads 1-8 with a ``deadline`` column.

Each job's deadline is ``K[i % 3]`` times its isolated run time: the job alone, at its requested
GPUs and batch, on the V100 nodes of ``examples/clusters/spot-v100.yaml`` (on-demand, never
preempted), plus one restart. Run from the repository root:
``python -m examples.workloads.spot.make_workload``. ``deadline_rows`` takes other factors or one
fixed deadline (the held-out workloads of ``examples/workloads/spot/heldout/``).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from broker.sim.cluster import fleet_capacity, parse_cluster
from broker.sim.engine import SimConfig, SimState, SimulationError, make_job
from broker.sim.workload import read_workload
from policies.type_assignment import TypeCapacity, placement_for

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


def deadline_rows(source: Path, factors: Sequence[float] = K,
                  fixed_s: float | None = None) -> list[list]:
    """The rows of ``source`` with a ``deadline`` column: ``fixed_s`` seconds for every job when
    given, else ``factors[i % len(factors)]`` times job i's isolated run time plus one restart."""
    cfg = SimConfig()
    types = fleet_capacity(parse_cluster("v100:4x8"))
    rows = []
    for i, w in enumerate(read_workload(source)):
        if fixed_s is None:
            state = make_job(w, cfg).state
            deadline = round(factors[i % len(factors)] * (isolated_s(state, types)
                                                          + state.restart_s))
        else:
            deadline = round(fixed_s)
        rows.append([w.name, int(w.time), w.application, w.num_replicas, w.batch_size, deadline])
    return rows


def write_rows(path: Path, rows: Sequence[Sequence]) -> None:
    """A workload CSV with the ``deadline`` column."""
    with path.open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["name", "time", "application", "num_replicas", "batch_size", "deadline"])
        out.writerows(rows)
    print(f"wrote {path} ({len(rows)} jobs)")


def main() -> None:
    for n in WORKLOADS:
        write_rows(Path(__file__).with_name(f"pollux-w{n}-deadlines.csv"),
                   deadline_rows(SOURCES / f"workload-{n}.csv"))


if __name__ == "__main__":
    main()
