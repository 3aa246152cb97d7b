"""The classic simulation is the live round: a classic cluster is plain on-demand pools, every
round of ``elastic``, ``fixed-batch`` and ``static`` is ``broker.scheduler.plan_round`` with the
broker's settings, admission drop is the live rule, and Tiresias is a baseline beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import broker.sim.driver as driver
from broker.cli.app import app
from broker.models import Intent, IntentKind
from broker.scheduler import Admission, Policy, SchedulerConfig
from broker.sim.cluster import read_pool_specs
from broker.sim.driver import LiveRoundDriver, scheduler_config
from broker.sim.engine import Assignment, Baseline, SimConfig
from broker.sim.rounds import SimPool, SpotConfig, SpotJob, classic_pools, simulate
from broker.sim.workload import WorkloadJob, read_workload
from policies.models import Accelerator, Market

ROOT = Path(__file__).resolve().parents[1]
POLLUX = ROOT / "examples" / "workloads" / "pollux-osdi21" / "workloads"


def _slice(n: int) -> list[WorkloadJob]:
    return read_workload(POLLUX / "workload-3.csv")[:n]


def _t4(nodes: int) -> list[SimPool]:
    return classic_pools(read_pool_specs(f"t4:{nodes}x4"))


def test_a_classic_cluster_is_one_on_demand_pool_per_type() -> None:
    t4, a100 = classic_pools(read_pool_specs("t4:2x4, a100:1x8, t4:1x4"))
    assert (t4.pool.accelerator, t4.pool.nodes, t4.pool.gpus_per_node) == (Accelerator.T4, 3, 4)
    assert (a100.pool.accelerator, a100.pool.capacity) == (Accelerator.A100, 8)
    for p in (t4, a100):
        assert (p.pool.cloud, p.pool.region, p.pool.market) == ("sim", "sim", Market.ON_DEMAND)
        assert p.pool.price_per_gpu_hour == 0 and p.trace is None


def _spied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, list[IntentKind]]]:
    """Each live round the driver runs: its time and the kinds of the intents it planned."""
    rounds: list[tuple[float, list[IntentKind]]] = []
    live = driver.plan_round

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        res = live(*args, **kw)
        rounds.append((args[3], [Intent.model_validate_json(i["json"]).kind
                                 for i in res.plan.intents_add]))
        return res

    monkeypatch.setattr(driver, "plan_round", spy)
    return rounds


@pytest.mark.parametrize("policy", list(Policy))
def test_every_classic_round_is_plan_round(monkeypatch: pytest.MonkeyPatch,
                                           policy: Policy) -> None:
    rounds = _spied(monkeypatch)
    cfg = SimConfig(policy=policy)
    res = simulate(_slice(8), _t4(4), cfg)
    assert res.unfinished == 0 and rounds
    # every tick with jobs is one live round (and the rounds its settles wake), no other
    ticks = {t for t, _ in rounds}
    assert len(ticks) == len(res.solve_seconds) and all(t % cfg.interval == 0 for t in ticks)
    assert any(IntentKind.LAUNCH in kinds for _, kinds in rounds)
    again = simulate(_slice(8), _t4(4), cfg)
    assert again.records == res.records and again.end_time == res.end_time  # deterministic


def test_tiresias_is_a_baseline_beside_the_live_round(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = _spied(monkeypatch)
    res = simulate(_slice(8), _t4(4), SimConfig(policy=Baseline.TIRESIAS))
    assert res.unfinished == 0 and not rounds
    with pytest.raises(ValueError, match="baseline"):
        scheduler_config(SimConfig(policy=Baseline.TIRESIAS))


def test_the_round_gets_the_simulations_policy_and_admission_and_the_products_rest() -> None:
    config = scheduler_config(SimConfig(Policy.FIXED_BATCH, Admission.DROP))
    assert (config.policy, config.admission) == (Policy.FIXED_BATCH, Admission.DROP)
    default = SchedulerConfig()
    for name in ("speedup_exponent", "restart_horizon_s", "min_rescale_interval_s", "max_failures",
                 "move_margin"):
        assert getattr(config, name) == getattr(default, name), name


def test_admission_drop_never_suspends_a_running_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve jobs within minutes on four GPUs: under drop, what does not fit on arrival is
    dropped (never started) and every admitted job runs to the end without being suspended for
    a newcomer; under queue the same jobs all finish, running jobs shrunk or suspended on the
    way to make room for the newcomers."""
    jobs = [WorkloadJob(f"j{i}", 30.0 * i, w.application, w.num_replicas, w.batch_size)
            for i, w in enumerate(_slice(12))]
    rounds = _spied(monkeypatch)
    drop = simulate(jobs, _t4(1), SimConfig(admission=Admission.DROP))
    assert not any(IntentKind.SUSPEND in kinds for _, kinds in rounds)
    dropped = [r for r in drop.records if r.dropped]
    assert dropped and all(r.gpu_seconds == 0 and r.completed is None for r in dropped)
    assert drop.unfinished == 0
    assert all(r.completed is not None for r in drop.records if not r.dropped)
    rounds.clear()
    queue = simulate(jobs, _t4(1), SimConfig())
    assert queue.unfinished == 0 and not any(r.dropped for r in queue.records)
    assert any({IntentKind.SUSPEND, IntentKind.RESIZE} & set(kinds) for _, kinds in rounds)


def test_static_runs_each_job_at_its_rows_gpus_and_batch_and_never_rescales() -> None:
    starts: list[tuple[str, Assignment]] = []

    class Noted(LiveRoundDriver):
        def _launch(self, job: SpotJob, a: Assignment, pool: SimPool, now: float) -> None:
            starts.append((job.state.id, a))
            super()._launch(job, a, pool, now)

    jobs = _slice(8)
    sim = Noted(jobs, _t4(4), SimConfig(policy=Policy.STATIC), SpotConfig())
    res = sim.run().result
    assert res.unfinished == 0 and all(r.restarts == 0 for r in res.records)
    rows = {w.name: w for w in jobs}
    assert sorted(k for k, _ in starts) == sorted(rows)  # one start each
    for name, a in starts:
        spec = sim.records[name].spec
        assert a.gpus == rows[name].num_replicas and a.batch_size == spec.batch_size.initial


def test_the_cli_says_which_allocator_options_are_gone(tmp_path: Path) -> None:
    w = tmp_path / "w.csv"
    w.write_text("name,time,application,num_replicas,batch_size\na,0,ncf,1,256\n")
    r = CliRunner().invoke(app, ["simulate", str(w), "--value", "fair", "--migrate"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    said = " ".join(r.output.split())
    assert "--value, --migrate" in said and "live broker's round" in said
