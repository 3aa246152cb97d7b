"""The spot simulation on tiny cases: traces, preemptions, costs by hand, spot policies, errors."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from broker.cli.app import app
from broker.scheduler import Policy
from broker.sim.baselines import MarketBaseline
from broker.sim.cluster import ClusterError, fleet_capacity, read_pool_specs
from broker.sim.engine import Assignment, SimConfig, make_job
from broker.sim.rounds import MarketPolicy, SimPool, SpotConfig, sim_pools, simulate_spot
from broker.sim.traces import TraceError, read_trace
from broker.sim.workload import WorkloadError, WorkloadJob, read_workload
from examples.workloads.spot.make_workload import isolated_s
from policies.models import Accelerator
from policies.type_assignment import placement_for
from tests.bench.spot_common import beyond_ondemand

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "clusters" / "spot-v100.yaml"
CFG = SimConfig(max_hours=4)


def _trace(path: Path, values: list[int], gap: float = 600) -> str:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": values}))
    return path.name


def _cluster(tmp_path: Path, *pools: str) -> list[SimPool]:
    y = tmp_path / "cluster.yaml"
    y.write_text("pools:\n" + "".join(f"  - {{{p}}}\n" for p in pools))
    return sim_pools(read_pool_specs(str(y)))


def _v100(region: str, market: str, price: float, nodes: int = 1, extra: str = "") -> str:
    return (f"cloud: aws, region: {region}, accelerator: V100, nodes: {nodes}, gpus_per_node: 8,"
            f" market: {market}, price_per_gpu_hour: {price}{extra}")


def test_trace_bounds_nodes_and_wraps_around(tmp_path: Path) -> None:
    t = read_trace(tmp_path / _trace(tmp_path / "t.json", [3, 0, 1], gap=300))
    assert [t.at(s) for s in (0, 299, 300, 600, 900, 1200)] == [3, 3, 0, 1, 3, 0]
    name = _trace(tmp_path / "t.json", [3, 0, 1], gap=300)
    (pool,) = _cluster(tmp_path, _v100("us-east-1", "spot", 0.5, nodes=2, extra=f", trace: {name}"))
    assert [pool.gpus_at(s) for s in (0, 300, 600)] == [16, 0, 8]  # min(nodes, value) x 8


@pytest.mark.parametrize("doc, message", [
    ({"data": [1]}, "gap_seconds"),
    ({"metadata": {"gap_seconds": 60}, "data": []}, "non-empty list"),
    ({"metadata": {"gap_seconds": 60}, "data": [1, -1]}, r"data\[1\]"),
    ({"metadata": {"gap_seconds": 60}, "data": [1, math.inf]}, r"data\[1\] = inf is not"),
    ({"metadata": {"gap_seconds": 60}, "data": [math.nan]}, r"data\[0\] = nan is not"),
    ({"metadata": {"gap_seconds": math.inf}, "data": [1]}, "gap_seconds > 0"),
])
def test_bad_trace_files_say_what_is_wrong(tmp_path: Path, doc: dict, message: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=message):
        read_trace(f)


def test_prices_come_from_the_catalog_unless_given(tmp_path: Path) -> None:
    spot, od = _cluster(tmp_path,
                        "cloud: aws, region: us-east-1, accelerator: V100, nodes: 1, "
                        "gpus_per_node: 8, market: spot",
                        _v100("us-east-1", "on-demand", 2.5))
    # p3.16xlarge spot in us-east-1's cheapest zone, per GPU; on-demand reference: the pool's
    assert spot.pool.price_per_gpu_hour == pytest.approx(2.7531 / 8)
    assert spot.ondemand_price == 2.5 and od.ondemand_price == 2.5
    with pytest.raises(ClusterError, match=r"pools\[0\].*no catalog price.*price_per_gpu_hour"):
        _cluster(tmp_path, "cloud: sim, region: r, accelerator: V100, nodes: 1, "
                           "gpus_per_node: 8, market: spot")


def _job(name: str = "j", app: str = "deepspeech2", gpus: int = 8, batch: int = 160,
         deadline: float | None = None) -> WorkloadJob:
    return WorkloadJob(name, 0.0, app, gpus, batch, deadline)


def test_costs_add_up_by_hand(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.5),
                     _v100("us-east-1", "on-demand", 2.0))
    spot = simulate_spot([_job()], pools, CFG, SpotConfig(MarketPolicy.FAILOVER))
    gpu_h = spot.result.records[0].gpu_seconds / 3600
    assert spot.cost_usd == pytest.approx(gpu_h * 0.5)
    assert spot.ondemand_cost_usd == pytest.approx(gpu_h * 2.0)
    assert spot.spot_gpu_h == pytest.approx(gpu_h) and spot.ondemand_gpu_h == 0
    od = simulate_spot([_job()], pools, CFG, SpotConfig(MarketPolicy.ONDEMAND))
    assert od.cost_usd == od.ondemand_cost_usd == pytest.approx(
        od.result.records[0].gpu_seconds / 3600 * 2.0)


def test_a_preemption_evicts_and_loses_the_work_since_the_checkpoint(tmp_path: Path) -> None:
    # The spot pool is gone from 600 s to 1200 s. The job starts at 60 s on 4 GPUs (fixed-batch
    # keeps that size), restarts for 30 s and checkpoints at the first round end with 300 s of
    # progress since the last: rounds end at 120 (30 s), ..., 420 (330 s: checkpoint), 480,
    # 540, 600 (180 s): 4 GPUs x 180 s are lost.
    name = _trace(tmp_path / "t.json", [1, 0] + [1] * 50, gap=600)
    od = _v100("us-east-1", "on-demand", 2.0)
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.5, extra=f", trace: {name}"), od)
    cfg = SimConfig(policy=Policy.FIXED_BATCH, max_hours=4)
    hit = simulate_spot([_job()], pools, cfg, SpotConfig(MarketPolicy.FAILOVER, 300))
    calm = simulate_spot([_job()], _cluster(tmp_path, _v100("us-east-1", "spot", 0.5), od),
                         cfg, SpotConfig(MarketPolicy.FAILOVER, 300))
    assert hit.preemptions == 1 and calm.preemptions == 0
    assert hit.lost_work_gpu_h == pytest.approx(4 * 180 / 3600)
    assert hit.migrations == 0  # it came back in the region it was preempted from
    noticed = simulate_spot([_job()], pools, cfg, SpotConfig(MarketPolicy.FAILOVER, 300, True))
    assert noticed.preemptions == 1 and noticed.lost_work_gpu_h == 0
    assert noticed.result.records[0].jct < hit.result.records[0].jct
    # it waited for the pool to come back (600 s), lost 180 s and paid one more restart
    assert hit.result.records[0].jct >= calm.result.records[0].jct + 600 + 180 + 30 - 60


def _two_regions(tmp_path: Path) -> list[SimPool]:
    """Region us-east-1 has a cheap zone that is preempted at 600 s and a dear zone; us-west-2
    sits in between in price."""
    name = _trace(tmp_path / "t.json", [1, 0, 0, 0], gap=600)
    return _cluster(tmp_path,
                    _v100("us-east-1", "spot", 0.3, extra=f", zone: a, trace: {name}"),
                    _v100("us-east-1", "spot", 0.8, extra=", zone: b"),
                    _v100("us-west-2", "spot", 0.5),
                    _v100("us-east-1", "on-demand", 3.0), _v100("us-west-2", "on-demand", 3.0))


def test_failover_stays_in_region_eager_moves(tmp_path: Path) -> None:
    pools = _two_regions(tmp_path)
    fail = simulate_spot([_job()], pools, CFG, SpotConfig(MarketPolicy.FAILOVER))
    eager = simulate_spot([_job()], pools, CFG, SpotConfig(MarketPolicy.EAGER))
    assert fail.preemptions == eager.preemptions == 1
    assert fail.migrations == 0  # us-east-1 zone b, though us-west-2 is cheaper
    assert eager.migrations == 1  # us-west-2 first
    assert eager.cost_usd < fail.cost_usd


def test_fleet_moving_a_running_job_to_another_region_counts_as_a_migration(
        tmp_path: Path) -> None:
    """No preemption: us-west-2's spot pool, far cheaper, opens at 600 s and fleet moves the job
    there; that move restarts it in another region, as a preemption's relaunch there would."""
    name = _trace(tmp_path / "t.json", [0] + [1] * 50, gap=600)
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.9),
                     _v100("us-west-2", "spot", 0.1, extra=f", trace: {name}"),
                     _v100("us-east-1", "on-demand", 3.0))
    res = simulate_spot([_job()], pools, CFG, SpotConfig(MarketPolicy.FLEET))
    assert res.preemptions == 0 and res.migrations == 1
    assert res.cost_usd < 0.9 * res.spot_gpu_h  # part of it ran at us-west-2's price


# The live round (``broker.scheduler.plan_round``, which fleet runs) still misses these deadlines:
# its throughput estimate is a generic model calibrated by one clamped factor, so configurations
# it has not measured look better than those it has, and it moves the job to a new one nearly
# every round, a restart each time (16 for the job of the second test, which ends 733 s late);
# the first test's job then asks for 8 GPUs at batch 64, below the smallest per-GPU batch the
# tables measured for deepspeech2, where the simulated job fails.
def test_fleet_falls_back_to_on_demand_to_meet_a_deadline(tmp_path: Path) -> None:
    name = _trace(tmp_path / "t.json", [0])  # no spot at all
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3, extra=f", trace: {name}"),
                     _v100("us-east-1", "on-demand", 3.0))
    job = _job(deadline=2 * 3600)
    fleet = simulate_spot([job], pools, CFG, SpotConfig(MarketPolicy.FLEET))
    sky = simulate_spot([job], pools, CFG, SpotConfig(MarketPolicy.FAILOVER))
    assert fleet.deadline_misses == 0 and fleet.ondemand_gpu_h > 0
    assert sky.deadline_misses == 1 and sky.result.unfinished == 1


def test_fleet_prefers_spot_when_the_deadline_allows(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3),
                     _v100("us-east-1", "on-demand", 3.0))
    fleet = simulate_spot([_job(deadline=10 * 3600)], pools, CFG, SpotConfig(MarketPolicy.FLEET))
    assert fleet.ondemand_gpu_h == 0 and fleet.spot_gpu_h > 0 and fleet.deadline_misses == 0


def test_fleet_meets_a_deadline_with_little_slack_on_spot(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3),
                     _v100("us-east-1", "on-demand", 3.0))
    state = make_job(_job(), CFG).state
    total_s = isolated_s(state, fleet_capacity([p.pool for p in pools]))
    # slack of two preemptions, each a round until the broker reacts + the restart, and a
    # restart onto spot, less 5 s: near the safety net from the start
    slack = 2 * (CFG.interval + state.restart_s) + state.restart_s - 5
    job = _job(deadline=total_s + slack)
    res = simulate_spot([job], pools, CFG,
                        SpotConfig(MarketPolicy.FLEET, checkpoint_on_notice=True))
    assert res.deadline_misses == 0


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spot=st.floats(0.05, 2.0), markup=st.floats(1.01, 5.0),
       values=st.lists(st.integers(0, 2), min_size=1, max_size=6),
       policy=st.sampled_from([MarketPolicy.FAILOVER, MarketPolicy.EAGER]))
def test_spot_only_costs_no_more_than_on_demand(tmp_path: Path, spot: float, markup: float,
                                                values: list[int], policy: MarketPolicy) -> None:
    name = _trace(tmp_path / "t.json", values, gap=900)
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", spot, nodes=2, extra=f", trace: {name}"),
                     _v100("us-east-1", "on-demand", spot * markup))
    res = simulate_spot([_job("a"), _job("b", "cifar10", 4, 512)], pools,
                        SimConfig(max_hours=2), SpotConfig(policy))
    # SkyPilot-like policies run on spot only; the trace wraps within the 2 h, so any sample
    # with an instance gives the jobs spot GPU-hours, and none leaves them waiting
    assert res.ondemand_gpu_h == 0
    if any(values):
        assert res.spot_gpu_h > 0 and res.cost_usd < res.ondemand_cost_usd
    else:
        assert res.spot_gpu_h == res.cost_usd == 0
        assert all(r.completed is None for r in res.result.records)
    assert res.spot_gpu_h == pytest.approx(sum(r.gpu_seconds for r in res.result.records) / 3600)


def test_deadline_column_and_its_errors(tmp_path: Path) -> None:
    f = tmp_path / "w.csv"
    f.write_text("name,time,application,num_replicas,batch_size,deadline\n"
                 "a,0,ncf,1,256,3600\nb,5,ncf,1,256,\n")
    assert [j.deadline for j in read_workload(f)] == [3600.0, None]
    f.write_text("name,time,application,num_replicas,batch_size,deadline\na,0,ncf,1,256,soon\n")
    with pytest.raises(WorkloadError, match=r"line 2, column 'deadline': 'soon' is not a number"):
        read_workload(f)


# --- the CLI -----------------------------------------------------------------------------------

def _run(*args: str):
    return CliRunner().invoke(app, ["simulate", *args])


def _slice(tmp_path: Path, n: int = 6) -> Path:
    lines = (ROOT / "examples" / "workloads" / "spot" / "pollux-w1-deadlines.csv").read_text()
    f = tmp_path / "w.csv"
    f.write_text("\n".join(lines.splitlines()[: n + 1]) + "\n")
    return f


def test_cli_json_has_the_spot_fields(tmp_path: Path) -> None:
    r = _run(str(_slice(tmp_path)), "--cluster", str(EXAMPLE), "--spot-policy",
             "skypilot-eager", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for key in ("cost_usd", "ondemand_cost_usd", "deadline_misses", "migrations",
                "lost_work_gpu_h"):
        assert key in out and key in out["per_workload"][0]
    assert out["spot_policy"] == "skypilot-eager" and out["completed"] == 6
    assert 0 < out["cost_usd"] < out["ondemand_cost_usd"]


def test_cli_defaults_to_fleet_on_spot_clusters_and_stays_classic_otherwise(tmp_path: Path) -> None:
    w = _slice(tmp_path, 3)
    spot = json.loads(_run(str(w), "--cluster", str(EXAMPLE), "--json").stdout)
    assert spot["spot_policy"] == "fleet"
    classic = json.loads(_run(str(w), "--cluster", "v100:4x8", "--json").stdout)
    assert "spot_policy" not in classic and "cost_usd" not in classic


@pytest.mark.parametrize("setup, message", [
    ("trace", "field 'trace': trace file"),
    ("infinite trace", "data[1] = inf is not a count >= 0"),
    ("deadline", "line 2, column 'deadline'"),
    ("policy", "--spot-policy 'cheap' is not one of"),
    ("ondemand", "needs on-demand pools"),
])
def test_cli_bad_inputs_fail_clearly(tmp_path: Path, setup: str, message: str) -> None:
    w = _slice(tmp_path, 2)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("pools:\n  - {" + _v100("us-east-1", "spot", 0.5) + "}\n")
    args = [str(w), "--cluster", str(cluster)]
    if setup == "trace":
        cluster.write_text("pools:\n  - {" + _v100("us-east-1", "spot", 0.5,
                                                   extra=", trace: nowhere.json") + "}\n")
    elif setup == "infinite trace":
        (tmp_path / "inf.json").write_text(
            '{"metadata": {"gap_seconds": 60}, "data": [1, Infinity]}')
        cluster.write_text("pools:\n  - {" + _v100("us-east-1", "spot", 0.5,
                                                   extra=", trace: inf.json") + "}\n")
    elif setup == "deadline":
        w.write_text("name,time,application,num_replicas,batch_size,deadline\na,0,ncf,1,256,-5\n")
    elif setup == "policy":
        args += ["--spot-policy", "cheap"]
    else:
        args += ["--spot-policy", "ondemand"]
    r = _run(*args)
    assert r.exit_code == 2
    assert message in " ".join(r.output.split()) and "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_running_job_whose_growth_fits_nowhere_keeps_its_seat(tmp_path: Path) -> None:
    # A runs 16 GPUs in the cheap pool and the allocator offers it 32, which no pool has room
    # for (the big pool is busy with C); B, new, must not take A's seat: it goes to the dear pool
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3, nodes=2),
                     _v100("us-west-2", "spot", 0.5, nodes=2),
                     _v100("eu-west-1", "spot", 0.6, nodes=4))
    cheap, dear, big = pools
    sim = MarketBaseline([_job("a"), _job("b"), _job("c")], pools, CFG,
                         SpotConfig(MarketPolicy.FAILOVER))
    a, b, c = sim.jobs

    def run(job, pool, gpus: int) -> Assignment:
        job.pool = pool
        job.state.current = Assignment(Accelerator.V100, gpus, 256, placement_for(gpus, 8))
        return job.state.current

    run(a, cheap, 16)
    keep_c = run(c, big, 32)
    assigned = {"a": Assignment(Accelerator.V100, 32, 512, placement_for(32, 8)),
                "b": Assignment(Accelerator.V100, 16, 256, placement_for(16, 8)), "c": keep_c}
    free = {p.pool.id: p.gpus_at(0) for p in pools}
    out = sim._place([a, b, c], assigned, pools, free)
    assert out["b"][1] is dear and out["c"][1] is big and "a" not in out
    assert free[cheap.pool.id] == 16  # A's seat goes back to the next allocation, not to B


def test_a_miss_all_on_demand_also_has_is_not_counted_beyond_it(tmp_path: Path) -> None:
    """The job's deadline is half its isolated run time on the whole cluster: all-on-demand
    misses it too, so fleet's miss is none beyond the on-demand reference; against a reference
    that meets the deadline (ten times as long) it is one beyond."""
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3, nodes=2),
                     _v100("us-east-1", "on-demand", 3.0))
    state = make_job(_job(), CFG).state
    total_s = isolated_s(state, fleet_capacity([p.pool for p in pools]))
    lost = [_job("lost", deadline=total_s / 2)]
    fleet = simulate_spot(lost, pools, CFG, SpotConfig(MarketPolicy.FLEET))
    ondemand = simulate_spot(lost, pools, CFG, SpotConfig(MarketPolicy.ONDEMAND))
    assert fleet.missed == ondemand.missed == ("lost",) and fleet.deadline_misses == 1
    assert beyond_ondemand(fleet, ondemand) == 0
    met = simulate_spot([_job("lost", deadline=10 * total_s)], pools, CFG,
                        SpotConfig(MarketPolicy.ONDEMAND))
    assert met.missed == () and beyond_ondemand(fleet, met) == 1
