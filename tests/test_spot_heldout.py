"""The held-out spot data of ``tests/bench/bench_spot_heldout.py``: the cluster files parse, the
generators are deterministic and up to date, re-sampling keeps each trace's availability, and the
held-out traces stay off the tuning clusters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.sim.cluster import read_pool_specs
from broker.sim.rounds import sim_pools
from examples.clusters.heldout import make_clusters as mc
from examples.workloads.spot.heldout import make_workloads as mw
from policies.models import Market
from tests.bench.spot_common import goal

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "examples" / "clusters" / n for n in ("spot-v100.yaml", "spot-v100-zones.yaml")]
TOLERANCE = 0.02  # availability fraction, re-sampled and scaled vs the source trace
NAMES = [c.name for c in mc.CLUSTERS]


@pytest.mark.parametrize("cluster", mc.CLUSTERS, ids=NAMES)
def test_cluster_file_parses_with_a_trace_per_spot_pool(cluster: mc.Cluster) -> None:
    pools = sim_pools(read_pool_specs(str(mc.HERE / f"{cluster.name}.yaml")))
    spot = [p for p in pools if p.pool.market is Market.SPOT]
    assert len(spot) == len(cluster.spot)
    assert all(p.trace is not None and p.pool.price_per_gpu_hour > 0 for p in spot)
    assert [p.pool.nodes for p in spot] == [s.nodes for s in cluster.spot]
    assert any(p.pool.market is Market.ON_DEMAND for p in pools)


@pytest.mark.parametrize("cluster", mc.CLUSTERS, ids=NAMES)
def test_generator_is_deterministic_and_committed_files_match(cluster: mc.Cluster) -> None:
    files = mc.render(cluster)
    assert files == mc.render(cluster)
    for path, text in files.items():
        assert path.read_text() == text, f"{path} is stale: run make_clusters"


@pytest.mark.parametrize("cluster", [c for c in mc.CLUSTERS if c.resample],
                         ids=[c.name for c in mc.CLUSTERS if c.resample])
def test_resampled_traces_keep_the_source_availability(cluster: mc.Cluster) -> None:
    for pool in cluster.spot:
        gap, source = mc.read_values(pool.trace)
        order = mc.block_order(mc.n_blocks(len(source), gap), f"{cluster.name}/{pool.collection}")
        shuffled = mc.resample(source, gap, order)
        assert sorted(shuffled) == sorted(source)  # a permutation of the samples
        assert order != sorted(order)  # and not the identity
        out_gap, values = mc.pool_trace(cluster, pool)
        assert out_gap == gap and len(values) == len(source)
        assert max(values) <= pool.nodes
        assert (abs(mc.availability(values, pool.nodes) - mc.availability(source, pool.capacity))
                <= TOLERANCE), pool.trace


def test_scale_rounds_half_up_and_keeps_all_or_nothing() -> None:
    assert mc.scale([0, 1, 2, 3, 8, 16], 16, 4) == [0, 0, 1, 1, 2, 4]
    assert mc.scale([0, 1, 1, 0], 1, 2) == [0, 2, 2, 0]


def test_zones_recorded_together_share_one_block_order() -> None:
    cluster = next(c for c in mc.CLUSTERS if c.name == "aws-16node-west-scaled")
    for pool in cluster.spot:
        gap, source = mc.read_values(pool.trace)
        order = mc.block_order(mc.n_blocks(len(source), gap), f"{cluster.name}/{mc.N16}")
        assert mc.pool_trace(cluster, pool) == (gap, mc.scale(mc.resample(source, gap, order),
                                                              16, 4))


def test_heldout_traces_stay_off_the_tuning_clusters() -> None:
    tuning = {str((y.parent / p["trace"]).resolve().relative_to(mc.TRACES))
              for y in SHIPPED for p in yaml.safe_load(y.read_text())["pools"] if "trace" in p}
    overlap = {"aws-16node-west-scaled", "probe-16node-raw"}  # documented in make_clusters
    for cluster in mc.CLUSTERS:
        used = {p.trace for p in cluster.spot}
        assert bool(used & tuning) == (cluster.name in overlap), cluster.name


def test_heldout_workloads_are_up_to_date() -> None:
    files = mw.workloads()
    assert len(files) == 6
    for path, rows in files.items():
        lines = path.read_text().splitlines()
        assert lines[1:] == [",".join(map(str, r)) for r in rows], f"{path} is stale"
    assert {r[-1] for r in files[mw.HERE / "pollux-0.5-w1-24h.csv"]} == {86400}


def _row(cost: float, misses: int, beyond: int, jct: float = 1.0) -> dict[str, Any]:
    per = {"cost_usd": cost, "deadline_misses": misses, "misses_beyond_ondemand": beyond,
           "avg_jct_h": jct}
    return {**per, "per_workload": [per]}


def test_the_goal_counts_misses_beyond_the_on_demand_reference_and_reports_the_raw_count(
        ) -> None:
    rows = {"ondemand": _row(100, 5, 0), "skypilot-failover": _row(50, 9, 6),
            "skypilot-eager": _row(45, 8, 5), "fleet": _row(30, 5, 0, jct=0.9),
            "fleet + checkpoint on notice": _row(30, 6, 1, jct=0.9)}
    line = goal(rows, "fleet")
    assert line.startswith("fleet: goal holds")
    assert "(misses: 5 raw, 0 beyond on-demand's; on-demand alone misses 5)" in line
    assert goal(rows, "fleet + checkpoint on notice").startswith(
        "fleet + checkpoint on notice: goal does NOT hold")
