"""Spot simulation: the four ``--spot-policy`` values side by side on the example V100 fleets.

Workload ``examples/workloads/spot/pollux-w1-deadlines.csv`` (Pollux workload-1 with deadlines);
clusters ``examples/clusters/spot-v100.yaml`` (one spot pool per region) and
``spot-v100-zones.yaml`` (AWS regions split into zones); checkpoint intervals 100 s (the job spec's
default) and 600 s. Writes ``examples/results/spot.json`` and prints one table per (cluster,
checkpoint interval) plus whether the issue's goal holds there: fleet at least 60% cheaper than
on-demand only, no deadline missed, and cheaper than both SkyPilot-like policies at an equal or
better average JCT. Every policy loses the work since the last periodic checkpoint on a
preemption; one more row shows fleet with FleetBroker's checkpoint on the preemption notice.
Run: ``python -m tests.bench spot``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from broker.sim.cluster import read_pool_specs
from broker.sim.engine import SimConfig
from broker.sim.report import spot_summary
from broker.sim.spot import MarketPolicy, SpotConfig, sim_pools, simulate_spot
from broker.sim.workload import read_workload

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "examples" / "workloads" / "spot" / "pollux-w1-deadlines.csv"
CLUSTERS = [ROOT / "examples" / "clusters" / n for n in ("spot-v100.yaml", "spot-v100-zones.yaml")]
CHECKPOINTS = (100.0, 600.0)
RESULTS = ROOT / "examples" / "results"
NOTICE = "fleet + checkpoint on notice"  # FleetBroker's agent; SkyPilot polls (FACTS.md 4)


def run(cluster: Path, checkpoint_s: float) -> dict[str, dict[str, Any]]:
    pools = sim_pools(read_pool_specs(str(cluster)))
    jobs = read_workload(WORKLOAD)
    out = {}
    variants = [(m.value, m, False) for m in MarketPolicy] + [(NOTICE, MarketPolicy.FLEET, True)]
    for label, market, notice in variants:
        t0 = time.perf_counter()
        res = simulate_spot(jobs, pools, SimConfig(), SpotConfig(market, checkpoint_s, notice))
        row = spot_summary([(str(WORKLOAD.relative_to(ROOT)), res)],
                           {"spot_policy": market.value, "cluster": str(cluster.relative_to(ROOT)),
                            "checkpoint_interval": checkpoint_s, "checkpoint_on_notice": notice})
        row.pop("per_workload")
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        out[label] = row
    return out


def goal(rows: dict[str, dict[str, Any]], fleet_row: str) -> str:
    fleet, od = rows[fleet_row], rows["ondemand"]
    sky = [rows[m.value] for m in (MarketPolicy.FAILOVER, MarketPolicy.EAGER)]
    saving = 100 * (1 - fleet["cost_usd"] / od["cost_usd"])
    checks = {
        f"saving {saving:.1f}% >= 60%": saving >= 60,
        f"{fleet['deadline_misses']} deadline misses": fleet["deadline_misses"] == 0,
        "cheaper than both SkyPilot-like": all(fleet["cost_usd"] < s["cost_usd"] for s in sky),
        "JCT equal or better than both": all(fleet["avg_jct_h"] <= s["avg_jct_h"] for s in sky),
    }
    verdict = "holds" if all(checks.values()) else "does NOT hold"
    return f"{fleet_row}: goal {verdict}: " + "; ".join(
        f"{k} {'ok' if v else 'FAILS'}" for k, v in checks.items())


def table(rows: dict[str, dict[str, Any]]) -> None:
    od = rows["ondemand"]["cost_usd"]
    print("| policy | avg JCT h | cost $ | saving vs ondemand % | deadline misses | migrations | "
          "preemptions | lost GPU-h |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['avg_jct_h']:.3f} | {r['cost_usd']:.0f} | "
              f"{100 * (1 - r['cost_usd'] / od):.1f} | {r['deadline_misses']} | "
              f"{r['migrations']} | {r['preemptions']} | {r['lost_work_gpu_h']:.2f} |")


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for cluster in CLUSTERS:
        for ckpt in CHECKPOINTS:
            rows = run(cluster, ckpt)
            out.setdefault(cluster.name, {})[f"checkpoint_{ckpt:.0f}s"] = rows
            print(f"\n### {cluster.name}, checkpoint every {ckpt:.0f} s\n")
            table(rows)
            print()
            for fleet_row in ("fleet", NOTICE):
                print(f"- {goal(rows, fleet_row)}", flush=True)
    (RESULTS / "spot.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
