"""Spot simulation: the four ``--spot-policy`` values side by side on the example V100 fleets.

Workloads ``examples/workloads/spot/pollux-w{1..8}-deadlines.csv`` (Pollux's eight workloads with
deadlines, 160 jobs each); clusters ``examples/clusters/spot-v100.yaml`` (one spot pool per region)
and ``spot-v100-zones.yaml`` (AWS regions split into zones); checkpoint intervals 100 s (the job
spec's default) and 600 s. Every policy loses the work since the last periodic checkpoint on a
preemption; one more row shows fleet with FleetBroker's checkpoint on the preemption notice.

Writes ``examples/results/spot.json`` and prints, per (cluster, checkpoint interval), one table
over all eight workloads (cost summed, JCT the mean of the per-workload means, as ``fleet
simulate`` reports several workloads) and whether the issue's goal holds there: at least 60%
cheaper than on-demand only, no deadline missed, and cheaper than both SkyPilot-like policies at
an equal or better average JCT; and in how many of the eight workloads each part holds alone.
Deterministic. Run: ``python -m tests.bench spot``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from broker.sim.cluster import read_pool_specs
from broker.sim.engine import SimConfig
from broker.sim.report import spot_summary
from broker.sim.spot import MarketPolicy, SpotConfig, SpotResult, sim_pools, simulate_spot
from broker.sim.workload import read_workload

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = sorted((ROOT / "examples" / "workloads" / "spot").glob("pollux-w*-deadlines.csv"))
CLUSTERS = [ROOT / "examples" / "clusters" / n for n in ("spot-v100.yaml", "spot-v100-zones.yaml")]
CHECKPOINTS = (100.0, 600.0)
RESULTS = ROOT / "examples" / "results"
NOTICE = "fleet + checkpoint on notice"  # FleetBroker's agent; SkyPilot polls (FACTS.md 4)
VARIANTS = [(m.value, m, False) for m in MarketPolicy] + [(NOTICE, MarketPolicy.FLEET, True)]
SKY = [m.value for m in (MarketPolicy.FAILOVER, MarketPolicy.EAGER)]


def _simulate(cluster: Path, workload: Path, market: MarketPolicy, checkpoint_s: float,
              notice: bool) -> SpotResult:
    pools = sim_pools(read_pool_specs(str(cluster)))
    return simulate_spot(read_workload(workload), pools, SimConfig(),
                         SpotConfig(market, checkpoint_s, notice))


def run(cluster: Path, checkpoint_s: float, pool: ProcessPoolExecutor) -> dict[str, dict]:
    """Every variant on every workload; one summary per variant (the workloads inside)."""
    out = {}
    for label, market, notice in VARIANTS:
        t0 = time.perf_counter()
        results = list(pool.map(_simulate, [cluster] * len(WORKLOADS), WORKLOADS,
                                [market] * len(WORKLOADS), [checkpoint_s] * len(WORKLOADS),
                                [notice] * len(WORKLOADS)))
        row = spot_summary([(w.name, r) for w, r in zip(WORKLOADS, results, strict=True)],
                           {"spot_policy": market.value, "cluster": str(cluster.relative_to(ROOT)),
                            "checkpoint_interval": checkpoint_s, "checkpoint_on_notice": notice})
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        out[label] = row
    return out


def _checks(fleet: dict[str, Any], od: dict[str, Any], sky: list[dict[str, Any]],
            ) -> dict[str, bool]:
    return {
        "saving >= 60%": fleet["cost_usd"] <= 0.4 * od["cost_usd"],
        "no deadline missed": fleet["deadline_misses"] == 0,
        "cheaper than both SkyPilot-like": all(fleet["cost_usd"] < s["cost_usd"] for s in sky),
        "JCT equal or better than both": all(fleet["avg_jct_h"] <= s["avg_jct_h"] for s in sky),
    }


def goal(rows: dict[str, dict[str, Any]], fleet_row: str) -> str:
    """The goal on the totals, and in how many workloads each part holds on its own."""
    per = {k: r["per_workload"] for k, r in rows.items()}
    overall = _checks(rows[fleet_row], rows["ondemand"], [rows[s] for s in SKY])
    counts = {k: 0 for k in overall}
    for i in range(len(WORKLOADS)):
        one = _checks(per[fleet_row][i], per["ondemand"][i], [per[s][i] for s in SKY])
        for k, ok in one.items():
            counts[k] += ok
    verdict = "holds" if all(overall.values()) else "does NOT hold"
    return f"{fleet_row}: goal {verdict} over the {len(WORKLOADS)} workloads: " + "; ".join(
        f"{k} {'ok' if ok else 'FAILS'} ({counts[k]}/{len(WORKLOADS)} workloads)"
        for k, ok in overall.items())


def table(rows: dict[str, dict[str, Any]]) -> None:
    od = rows["ondemand"]["cost_usd"]
    print("| policy | avg JCT h | cost $ | saving vs ondemand % | deadline misses | migrations | "
          "preemptions | lost GPU-h | on-demand GPU-h |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['avg_jct_h']:.4f} | {r['cost_usd']:.0f} | "
              f"{100 * (1 - r['cost_usd'] / od):.1f} | {r['deadline_misses']} | "
              f"{r['migrations']} | {r['preemptions']} | {r['lost_work_gpu_h']:.1f} | "
              f"{r['ondemand_gpu_h']:.1f} |")


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor() as pool:
        for cluster in CLUSTERS:
            for ckpt in CHECKPOINTS:
                rows = run(cluster, ckpt, pool)
                out.setdefault(cluster.name, {})[f"checkpoint_{ckpt:.0f}s"] = rows
                print(f"\n### {cluster.name}, checkpoint every {ckpt:.0f} s, "
                      f"{len(WORKLOADS)} workloads\n")
                table(rows)
                print()
                for fleet_row in ("fleet", NOTICE):
                    print(f"- {goal(rows, fleet_row)}", flush=True)
    (RESULTS / "spot.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
