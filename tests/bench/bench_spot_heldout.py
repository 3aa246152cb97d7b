"""Spot policy on data it was not tuned on: the five ``--spot-policy`` variants on held-out
clusters and workloads, next to the tuning side (DESIGN.md: "Generalise, don't tune").

Protocol (issue 12 item 6):

- TUNING side, what the market and region rule was developed on: the shipped clusters
  ``examples/clusters/spot-v100.yaml`` and ``spot-v100-zones.yaml`` (the 4-node preemption traces
  of 2023-08-03 and the 16-node traces of 2023-08-27 as recorded) with Pollux's workloads 1-4 and
  the shipped deadlines (``examples/workloads/spot/pollux-w{1..4}-deadlines.csv``: 1.5, 2 and 3
  times each job's isolated run time).
- HELD-OUT side: the four clusters of ``examples/clusters/heldout/`` (``make_clusters.py`` there:
  1-node traces no shipped cluster replays, and the 16-node us-west-2a/us-west-2c ones, which
  ``spot-v100-zones.yaml`` replays as recorded; each re-sampled in 12 h blocks in a seeded order
  and scaled to its pool's nodes), with workloads the rule was not tuned on: Pollux's 5-8 at the
  shipped factors, 5-6 at tighter factors (1.25, 1.5, 2), 7-8 at looser ones (2, 3, 5), and the
  issue's probe workloads (the first two 0.5x-load workloads, a 24 h deadline on every job)
  (``examples/workloads/spot/heldout/make_workloads.py``).
- PROBE: the issue's own probe cluster (three 16-node zones as recorded, 4 nodes each, one
  on-demand pool of 4) with the held-out workloads. Its traces also feed the tuning clusters, so
  it is reported apart from both sides.

Nothing here is tuned: the policy and its defaults are the live round's as they stand, and no
setting changes between the sides. One checkpoint interval, 100 s (the job spec's default;
``bench_spot`` also runs 600 s on the tuning clusters). Every (cluster, workload, variant) is one
simulation, in parallel processes: 290 in all, about 50 CPU-minutes (``cpu_s`` in the JSON; about
25 minutes on two cores).

Prints, per cluster, the table of ``bench_spot`` over its workloads (cost summed, JCT the mean of
the per-workload means), the saving the cheapest spot price allows there at most, and a verdict
line per fleet variant for the goal (cheaper than both SkyPilot-like, JCT no worse, no miss
beyond the all-on-demand run's, 60% saving; the raw misses beside it); then the totals of each
side next to each other, with the goal on each, and on the held-out side per deadline set.
Writes ``examples/results/spot_heldout.json``. Deterministic (but for the wall and CPU times).
Run: ``python -m tests.bench spot_heldout``.
"""

from __future__ import annotations

import json
import resource
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.sim.cluster import read_pool_specs
from broker.sim.report import spot_summary
from broker.sim.rounds import SpotResult, sim_pools
from policies.models import Market
from tests.bench.spot_common import (
    FLEET_ROWS,
    VARIANTS,
    add_beyond_ondemand,
    goal,
    misses_beyond,
    simulate,
    table,
)

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
WORKLOADS = ROOT / "examples" / "workloads" / "spot"
RESULTS = ROOT / "examples" / "results"
CHECKPOINT_S = 100.0
HELDOUT_WORKLOADS = (
    *(WORKLOADS / f"pollux-w{n}-deadlines.csv" for n in (5, 6, 7, 8)),
    *(WORKLOADS / "heldout" / f"pollux-w{n}-{kind}.csv"
      for n, kind in ((5, "tight"), (6, "tight"), (7, "loose"), (8, "loose"))),
    *(WORKLOADS / "heldout" / f"pollux-0.5-w{n}-24h.csv" for n in (1, 2)),
)
DEADLINE_SETS = {"deadlines": "shipped factors 1.5/2/3", "tight": "tight factors 1.25/1.5/2",
                 "loose": "loose factors 2/3/5", "24h": "0.5x load, 24 h deadlines"}


@dataclass(frozen=True)
class Side:
    name: str
    clusters: tuple[Path, ...]
    workloads: tuple[Path, ...]


SIDES = (
    Side("tuning", (CLUSTERS / "spot-v100.yaml", CLUSTERS / "spot-v100-zones.yaml"),
         tuple(WORKLOADS / f"pollux-w{n}-deadlines.csv" for n in (1, 2, 3, 4))),
    Side("held-out", tuple(CLUSTERS / "heldout" / f"{n}.yaml" for n in (
        "aws-1node-2023-zones", "aws-1node-2022-v100x8", "gcp-aws-1node-zones",
        "aws-16node-west-scaled")), HELDOUT_WORKLOADS),
    Side("probe", (CLUSTERS / "heldout" / "probe-16node-raw.yaml",), HELDOUT_WORKLOADS),
)

Key = tuple[Path, Path, str]  # cluster, workload, variant label


def deadline_set(workload: Path) -> str:
    """``deadlines``, ``tight``, ``loose`` or ``24h``: the file name's last part."""
    return workload.stem.rsplit("-", 1)[1]


def spot_ceiling(cluster: Path) -> float:
    """The saving, in %, of the cheapest spot price against the cheapest on-demand reference."""
    pools = sim_pools(read_pool_specs(str(cluster)))
    spot = min(p.pool.price_per_gpu_hour for p in pools if p.pool.market is Market.SPOT)
    return 100 * (1 - spot / min(p.ondemand_price for p in pools))


def simulate_all(pool: ProcessPoolExecutor) -> dict[Key, SpotResult]:
    """Every side's (cluster, workload, variant), the slow fleet runs and big workloads first."""
    keys = [(c, w, label) for side in SIDES for c in side.clusters for w in side.workloads
            for label, _, _ in VARIANTS]
    variant = {label: (market, notice) for label, market, notice in VARIANTS}
    keys.sort(key=lambda k: (k[2] not in FLEET_ROWS, deadline_set(k[1]) == "24h"))
    futures: dict[Key, Future[SpotResult]] = {
        k: pool.submit(simulate, k[0], k[1], variant[k[2]][0], CHECKPOINT_S, variant[k[2]][1])
        for k in keys}
    return {k: f.result() for k, f in futures.items()}


def summarise(results: dict[Key, SpotResult], pairs: list[tuple[Path, Path]],
              settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One ``spot_summary`` per variant over the (cluster, workload) pairs, with its misses
    beyond the on-demand reference."""
    rows = {label: spot_summary(
        [(f"{c.stem}/{w.stem}", results[c, w, label]) for c, w in pairs],
        {**settings, "spot_policy": market.value, "checkpoint_interval": CHECKPOINT_S,
         "checkpoint_on_notice": notice})
        for label, market, notice in VARIANTS}
    add_beyond_ondemand(rows, {label: [results[c, w, label] for c, w in pairs]
                               for label, _, _ in VARIANTS})
    return rows


def side_by_side(totals: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Cost, saving, JCT, misses and on-demand GPU-h of every variant, one column group a side."""
    names = list(totals)
    print("| policy | " + " | ".join(f"{s}: cost $ | saving % | avg JCT h | misses | misses "
                                     "beyond on-demand's | on-demand GPU-h" for s in names) + " |")
    print("|---|" + "---|" * 6 * len(names))
    for label, _, _ in VARIANTS:
        cells = []
        for s in names:
            r, od = totals[s][label], totals[s]["ondemand"]["cost_usd"]
            cells += [f"{r['cost_usd']:.0f}", f"{100 * (1 - r['cost_usd'] / od):.1f}",
                      f"{r['avg_jct_h']:.4f}", str(r["deadline_misses"]),
                      str(misses_beyond(r)),
                      f"{r['ondemand_gpu_h']:.1f}"]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor() as pool:
        results = simulate_all(pool)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker processes, joined
    cpu = usage.ru_utime + usage.ru_stime
    out: dict[str, Any] = {"checkpoint_interval": CHECKPOINT_S, "sides": {}}
    totals = {}
    for side in SIDES:
        doc: dict[str, Any] = {"workloads": [str(w.relative_to(ROOT)) for w in side.workloads],
                               "clusters": {}}
        for c in side.clusters:
            rows = summarise(results, [(c, w) for w in side.workloads],
                             {"cluster": str(c.relative_to(ROOT))})
            ceiling = spot_ceiling(c)
            doc["clusters"][c.stem] = {"spot_ceiling_saving_pct": round(ceiling, 1),
                                       "variants": rows}
            print(f"\n### {side.name}: {c.stem}, {len(side.workloads)} workloads, checkpoint "
                  f"every {CHECKPOINT_S:.0f} s (cheapest spot saves at most {ceiling:.0f}%)\n")
            table(rows)
            print()
            for fleet_row in FLEET_ROWS:
                print(f"- {goal(rows, fleet_row)}")
        pairs = [(c, w) for c in side.clusters for w in side.workloads]
        totals[side.name] = doc["totals"] = summarise(results, pairs, {"side": side.name})
        if side.name == "held-out":
            doc["by_deadlines"] = {
                k: summarise(results, [p for p in pairs if deadline_set(p[1]) == k],
                             {"side": side.name, "deadlines": about})
                for k, about in DEADLINE_SETS.items()}
        out["sides"][side.name] = doc
    print(f"\n### Totals, tuning vs held-out (and the issue's probe), checkpoint every "
          f"{CHECKPOINT_S:.0f} s\n")
    side_by_side(totals)
    print()
    for side in SIDES:
        for fleet_row in FLEET_ROWS:
            print(f"- {side.name}, {goal(totals[side.name], fleet_row)}")
    print("\nHeld-out side by deadline set (all four held-out clusters):\n")
    for k, about in DEADLINE_SETS.items():
        for fleet_row in FLEET_ROWS:
            print(f"- {about}: {goal(out['sides']['held-out']['by_deadlines'][k], fleet_row)}")
    out["wall_s"], out["cpu_s"] = round(wall, 1), round(cpu, 1)
    print(f"\n{len(results)} simulations in {wall:.0f} s wall, {cpu:.0f} s CPU")
    (RESULTS / "spot_heldout.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
