"""What the spot benches share: the policy variants, one simulation, the goal's checks and the
results table (``bench_spot`` on the tuning clusters, ``bench_spot_heldout`` on held-out ones).

The goal (issue 12): at least 60% cheaper than on-demand only, no deadline missed, and cheaper
than both SkyPilot-like policies at an equal or better average JCT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.sim.cluster import read_pool_specs
from broker.sim.engine import SimConfig
from broker.sim.rounds import MarketPolicy, SpotConfig, SpotResult, sim_pools, simulate_spot
from broker.sim.workload import read_workload

NOTICE = "fleet + checkpoint on notice"  # FleetBroker's agent; SkyPilot polls (FACTS.md 4)
VARIANTS = [(m.value, m, False) for m in MarketPolicy] + [(NOTICE, MarketPolicy.FLEET, True)]
SKY = [m.value for m in (MarketPolicy.FAILOVER, MarketPolicy.EAGER)]
FLEET_ROWS = (MarketPolicy.FLEET.value, NOTICE)


def simulate(cluster: Path, workload: Path, market: MarketPolicy, checkpoint_s: float,
             notice: bool) -> SpotResult:
    """One workload on one cluster file under one variant."""
    pools = sim_pools(read_pool_specs(str(cluster)))
    return simulate_spot(read_workload(workload), pools, SimConfig(),
                         SpotConfig(market, checkpoint_s, notice))


def checks(fleet: dict[str, Any], od: dict[str, Any], sky: list[dict[str, Any]],
           ) -> dict[str, bool]:
    """Each part of the goal for one fleet summary against the others'."""
    return {
        "saving >= 60%": fleet["cost_usd"] <= 0.4 * od["cost_usd"],
        "no deadline missed": fleet["deadline_misses"] == 0,
        "cheaper than both SkyPilot-like": all(fleet["cost_usd"] < s["cost_usd"] for s in sky),
        "JCT equal or better than both": all(fleet["avg_jct_h"] <= s["avg_jct_h"] for s in sky),
    }


def goal(rows: dict[str, dict[str, Any]], fleet_row: str) -> str:
    """The goal on the totals, and in how many workloads each part holds on its own."""
    per = {k: r["per_workload"] for k, r in rows.items()}
    n = len(per[fleet_row])
    overall = checks(rows[fleet_row], rows["ondemand"], [rows[s] for s in SKY])
    counts = {k: 0 for k in overall}
    for i in range(n):
        one = checks(per[fleet_row][i], per["ondemand"][i], [per[s][i] for s in SKY])
        for k, ok in one.items():
            counts[k] += ok
    verdict = "holds" if all(overall.values()) else "does NOT hold"
    return f"{fleet_row}: goal {verdict} over the {n} workloads: " + "; ".join(
        f"{k} {'ok' if ok else 'FAILS'} ({counts[k]}/{n} workloads)"
        for k, ok in overall.items())


def table(rows: dict[str, dict[str, Any]]) -> None:
    """One markdown row per variant; the saving is against the ondemand row's cost."""
    od = rows["ondemand"]["cost_usd"]
    print("| policy | avg JCT h | cost $ | saving vs ondemand % | deadline misses | migrations | "
          "preemptions | lost GPU-h | on-demand GPU-h |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['avg_jct_h']:.4f} | {r['cost_usd']:.0f} | "
              f"{100 * (1 - r['cost_usd'] / od):.1f} | {r['deadline_misses']} | "
              f"{r['migrations']} | {r['preemptions']} | {r['lost_work_gpu_h']:.1f} | "
              f"{r['ondemand_gpu_h']:.1f} |")
