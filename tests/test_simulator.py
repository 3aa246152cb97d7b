"""The classic simulator on small slices: exact physics of one job, determinism, admission, the
Tiresias baseline, the CLI. That its policies are the live round's: ``test_classic_live.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.scheduler import Admission, Policy
from broker.sim.baselines import TiresiasPolicy
from broker.sim.cluster import ClusterError, fleet_capacity, parse_cluster, read_pool_specs
from broker.sim.engine import Baseline, SimConfig, SimState, SimulationError
from broker.sim.rounds import SimPool, classic_pools, simulate
from broker.sim.workload import WorkloadError, WorkloadJob, read_workload
from policies.goodput import EfficiencyModel
from policies.models import Accelerator
from policies.type_assignment import TypeCapacity
from providers.measurements import load_application

ROOT = Path(__file__).resolve().parents[1]
POLLUX = ROOT / "examples" / "workloads" / "pollux-osdi21" / "workloads"


def _t4(nodes: int = 2) -> list[SimPool]:
    return classic_pools(read_pool_specs(f"t4:{nodes}x4"))


def test_one_job_alone_finishes_when_its_epochs_add_up() -> None:
    """Static policy, one ncf job on 1 GPU: JCT = wait for the round + restart + sum of epochs."""
    job = WorkloadJob("ncf-0", 0.0, "ncf", 1, 256)
    res = simulate([job], _t4(1), SimConfig(policy=Policy.STATIC, interval=60,
                                            restart_penalty=30))
    app = load_application("ncf")
    eff, b = app.efficiency, app.efficiency.boundaries
    run = sum((b[e + 1] - b[e]) / app.rate(Accelerator.T4, (1,), 256, e)[0]
              for e in range(eff.max_epochs))
    assert res.records[0].jct == pytest.approx(60 + 30 + run, rel=1e-9)
    assert res.records[0].restarts == 0


def test_restart_penalty_delays_completion_by_exactly_its_length() -> None:
    job = [WorkloadJob("c", 0.0, "cifar10", 4, 512)]
    slow = simulate(job, _t4(1), SimConfig(policy=Policy.STATIC, restart_penalty=90))
    fast = simulate(job, _t4(1), SimConfig(policy=Policy.STATIC, restart_penalty=0))
    assert slow.records[0].jct - fast.records[0].jct == pytest.approx(90)


def test_no_statistical_loss_is_faster_at_large_batch() -> None:
    job = [WorkloadJob("c", 0.0, "cifar10", 4, 2048)]
    gns = simulate(job, _t4(1), SimConfig(policy=Policy.STATIC))
    none = simulate(job, _t4(1), SimConfig(policy=Policy.STATIC,
                                           efficiency=EfficiencyModel.NONE))
    assert none.records[0].jct < gns.records[0].jct


def _slice(n: int = 12) -> list[WorkloadJob]:
    return read_workload(POLLUX / "workload-3.csv")[:n]


@pytest.mark.parametrize("policy", [*Policy, *Baseline])
def test_every_policy_completes_a_slice_deterministically(policy: Policy | Baseline) -> None:
    cfg = SimConfig(policy=policy)
    a = simulate(_slice(), _t4(4), cfg)
    b = simulate(_slice(), _t4(4), cfg)
    assert a.unfinished == 0
    assert [r.completed for r in a.records] == [r.completed for r in b.records]
    assert all(r.jct > 0 for r in a.records)


def test_elastic_beats_static_on_a_slice() -> None:
    jobs = _slice(20)
    el = simulate(jobs, _t4(4), SimConfig(policy=Policy.ELASTIC))
    st = simulate(jobs, _t4(4), SimConfig(policy=Policy.STATIC))
    mean = lambda r: sum(x.jct for x in r.records) / len(r.records)  # noqa: E731
    assert mean(el) < mean(st)


def test_drop_admission_drops_what_does_not_fit_on_arrival() -> None:
    jobs = [WorkloadJob(f"n{i}", 0.0, "ncf", 1, 256) for i in range(6)]
    res = simulate(jobs, _t4(1), SimConfig(policy=Policy.STATIC, admission=Admission.DROP))
    assert sum(r.dropped for r in res.records) == 2
    assert sum(r.completed is not None for r in res.records) == 4
    el = simulate(jobs, _t4(1), SimConfig(policy=Policy.ELASTIC, admission=Admission.DROP))
    assert sum(r.dropped for r in el.records) == 2
    assert all(r.restarts == 0 or not r.dropped for r in el.records)


def test_heterogeneous_fleet_runs_every_job_once_per_type_rules() -> None:
    pools = classic_pools(read_pool_specs("t4:1x4,2080ti:1x8,a100:1x8"))
    res = simulate(_slice(10), pools, SimConfig(restart_penalty=None, sia_slowdown=True))
    assert res.unfinished == 0


def test_rigid_job_larger_than_the_cluster_is_refused() -> None:
    with pytest.raises(SimulationError, match="needs 48 GPUs"):
        simulate([WorkloadJob("i", 0, "imagenet", 48, 6400)], _t4(2),
                 SimConfig(policy=Baseline.TIRESIAS))


def test_cluster_specs_and_their_errors(tmp_path: Path) -> None:
    caps = fleet_capacity(parse_cluster("t4:6x4, 2080ti:3x8,a100:2x8"))
    assert [(c.accelerator, c.gpus) for c in caps] == [
        (Accelerator.T4, 24), (Accelerator.RTX2080TI, 24), (Accelerator.A100, 16)]
    y = tmp_path / "c.yaml"
    y.write_text("pools:\n  - {accelerator: t4, nodes: 2, gpus_per_node: 4, cloud: aws,"
                 " region: us-east-1, market: spot}\n  - {accelerator: T4, nodes: 1,"
                 " gpus_per_node: 4}\n")
    assert fleet_capacity(parse_cluster(str(y)))[0].gpus == 12
    with pytest.raises(ClusterError, match="TYPE:NODESxGPUS"):
        parse_cluster("t4-16")
    with pytest.raises(ClusterError, match="measured with 4 GPUs per node"):
        fleet_capacity(parse_cluster("t4:2x8"))
    with pytest.raises(ClusterError, match="no throughput measurements for H100"):
        fleet_capacity(parse_cluster("h100:1x8"))
    y.write_text("pools:\n  - {accelerator: t4, nodes: 2, gpus_per_node: 4, colour: red}\n")
    with pytest.raises(ClusterError, match="unknown field"):
        parse_cluster(str(y))


def test_workload_errors_name_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "w.csv"
    f.write_text("name,time,application,num_replicas,batch_size\na,0,ncf,1,256\nb,x,ncf,1,256\n")
    with pytest.raises(WorkloadError, match=r"line 3, column 'time': 'x' is not a number"):
        read_workload(f)
    f.write_text("name,time,application,num_replicas,batch_size\na,0,gpt,1,256\n")
    with pytest.raises(WorkloadError, match=r"line 2, column 'application': unknown"):
        read_workload(f)
    f.write_text("name,time,application\na,0,ncf\n")
    with pytest.raises(WorkloadError, match="missing column"):
        read_workload(f)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", "simulate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_json_report_and_jobs_file(tmp_path: Path) -> None:
    w = tmp_path / "slice.csv"
    rows = (POLLUX / "workload-3.csv").read_text().splitlines()[:9]
    w.write_text("\n".join(rows) + "\n")
    out = tmp_path / "jobs.csv"
    p = _cli(str(w), "--cluster", "t4:4x4", "--policy", "tiresias", "--json", "--jobs-out",
             str(out))
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    for key in ("policy", "workloads", "jobs", "completed", "dropped", "avg_jct_h", "p99_jct_h",
                "makespan_h", "gpu_hours_per_job", "rescales", "per_workload"):
        assert key in rep
    assert rep["jobs"] == rep["completed"] == 8
    assert len(out.read_text().splitlines()) == 9


@pytest.mark.parametrize(("args", "message"), [
    (["--cluster", "t4:2x8"], "measured with 4 GPUs per node"),
    (["--policy", "pollux"], "--policy 'pollux' is not one of"),
    (["--restart-penalty", "soon"], "must be seconds"),
    (["--interval", "0"], "interval must be positive, got 0"),  # SimulationError
])
def test_cli_bad_options_exit_2_without_traceback(args: list[str], message: str) -> None:
    p = _cli(str(POLLUX / "workload-1.csv"), *args)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_cli_malformed_workload_exits_2(tmp_path: Path) -> None:
    w = tmp_path / "bad.csv"
    w.write_text("name,time,application,num_replicas,batch_size\na,0,ncf,one,256\n")
    p = _cli(str(w))
    assert p.returncode == 2
    assert "line 2, column 'num_replicas'" in p.stderr


def _state(name: str, app: str, gpus: int, batch: int, t: float = 0.0) -> SimState:
    return SimState(name, load_application(app), t, gpus, batch)


def test_tiresias_demotes_after_its_threshold_and_lets_the_next_job_run() -> None:
    pol = TiresiasPolicy([TypeCapacity(Accelerator.T4, 1, 4)], threshold_gpu_s=4 * 120)
    a, b = _state("a", "cifar10", 4, 512, 0), _state("b", "cifar10", 4, 512, 1)
    plan = pol.schedule([a, b], now=60)
    assert plan["a"] is not None and plan["b"] is None  # first come, first served in Q0
    a.current = plan["a"]
    for now in (120, 180):
        plan = pol.schedule([a, b], now=now)
    assert plan["a"] is None and plan["b"] is not None  # a used 4 GPUs x 120 s: demoted


def test_tiresias_skips_ahead_to_a_job_that_fits() -> None:
    pol = TiresiasPolicy([TypeCapacity(Accelerator.T4, 2, 4)])
    big, small = _state("big", "cifar10", 8, 2048, 0), _state("small", "ncf", 1, 256, 1)
    running = _state("run", "ncf", 1, 256, -1)
    running.current = pol.schedule([running], now=0)["run"]
    plan = pol.schedule([running, big, small], now=60)
    assert plan["big"] is None and plan["small"] is not None
