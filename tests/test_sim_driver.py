"""The spot simulation's ``fleet`` policy drives the live round (``broker.sim.driver``): the same
answers twice, jobs that complete, evictions that resume from the checkpoint, the deadline rule's
on-demand fallback, and ``plan_round`` as the one that decides."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import broker.sim.driver as driver
from broker.models import JobState
from broker.sim.driver import LiveRoundDriver, scheduler_config
from broker.sim.engine import Assignment, SimConfig
from broker.sim.rounds import (
    MarketPolicy,
    SimPool,
    SpotConfig,
    SpotJob,
    SpotResult,
    simulate_spot,
)
from broker.sim.workload import WorkloadJob
from policies.models import Market, Regions
from tests.test_spot_sim import _cluster, _trace, _v100

CFG = SimConfig(max_hours=4)
FLEET = SpotConfig(MarketPolicy.FLEET)


def _job(name: str, app: str = "bert", gpus: int = 2, batch: int = 12, time: float = 0.0,
         deadline: float | None = None) -> WorkloadJob:
    return WorkloadJob(name, time, app, gpus, batch, deadline)


def _outcome(res) -> tuple:
    """Everything a run reports but the solver's wall times."""
    r = res.result
    return (res.cost_usd, res.ondemand_cost_usd, res.deadline_misses, res.migrations,
            res.preemptions, res.lost_work_gpu_h, res.spot_gpu_h, res.ondemand_gpu_h,
            r.end_time, r.rounds, r.unfinished, r.records)


def _traced(tmp_path: Path, values: list[int], *extra: str) -> list[SimPool]:
    name = _trace(tmp_path / "t.json", values, gap=600)
    return _cluster(tmp_path, _v100("us-east-1", "spot", 0.3, extra=f", trace: {name}"), *extra)


def test_the_same_workload_gives_the_same_answers(tmp_path: Path) -> None:
    pools = _traced(tmp_path, [1, 0, 1, 1, 0] * 4, _v100("us-west-2", "spot", 0.5),
                    _v100("us-east-1", "on-demand", 3.0))
    jobs = [_job("a"), _job("b", "cifar10", 4, 512, 100.0, 3600.0),
            _job("c", "ncf", 1, 256, 200.0), _job("d", "bert", 2, 12, 700.0, 7200.0)]
    first, second = (simulate_spot(jobs, pools, CFG, FLEET) for _ in range(2))
    assert _outcome(first) == _outcome(second)
    assert first.preemptions > 0 and first.result.unfinished == 0


def test_every_job_completes_where_capacity_never_goes(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3), _v100("us-west-2", "spot", 0.5),
                     _v100("us-east-1", "on-demand", 3.0))
    jobs = [_job("a"), _job("b", "cifar10", 4, 512, 30.0), _job("c", "ncf", 1, 256, 90.0),
            _job("d", "bert", 1, 24, 400.0)]
    sim = LiveRoundDriver(jobs, pools, CFG, FLEET)
    res = sim.run()
    assert res.result.unfinished == 0 and res.preemptions == 0 and res.lost_work_gpu_h == 0
    assert all(r.jct is not None and r.jct > 0 for r in res.result.records)
    for job in sim.jobs:
        rec = sim.records[job.state.id]
        # the broker's record as the agent left it: done, all its samples, at batch M0
        assert rec.state is JobState.COMPLETED and rec.finished_at == job.sim.record.completed
        m0 = job.state.app.init_batch_size
        assert rec.samples_done == rec.spec.work_samples == math.ceil(
            job.state.app.efficiency.target * m0)
        assert rec.spec.model == job.state.app.name and rec.spec.batch_size.min == m0
        assert rec.measured and rec.samples_per_sec and rec.attempt >= 1


class _Watched(LiveRoundDriver):
    """The driver, noting each eviction as it happens (the job's GPUs, its seconds of progress
    since the last checkpoint, that checkpoint, its progress before and right after, whether
    the location is blocked then) and each start (time, pool, progress)."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.evictions: list[tuple[int, float, float, float, float, bool]] = []
        self.starts: list[tuple[float, str, float]] = []

    def _evict(self, job: SpotJob, now: float) -> None:
        assert job.state.current is not None
        before = (job.state.current.gpus, job.since_checkpoint, job.checkpoint,
                  job.state.progress)
        super()._evict(job, now)
        self.evictions.append((*before, job.state.progress,
                               self.blocklist.is_blocked("aws:us-east-1", now)))

    def _launch(self, job: SpotJob, a: Assignment, pool: SimPool, now: float) -> None:
        self.starts.append((now, pool.pool.id, job.state.progress))
        super()._launch(job, a, pool, now)


def _evicted(tmp_path: Path, notice: bool) -> tuple[_Watched, SpotResult]:
    # us-east-1's spot pool, the cheapest, is gone from 600 s to 1200 s; the others stay (three
    # locations: SpotHedge lifts every mark when fewer than two would stay open)
    pools = _traced(tmp_path, [1, 0] + [1] * 20, _v100("us-west-2", "spot", 0.9),
                    _v100("eu-west-1", "spot", 1.0))
    sim = _Watched([_job("a")], pools, CFG, SpotConfig(MarketPolicy.FLEET, 300.0, notice))
    return sim, sim.run()


def test_a_trace_drop_evicts_and_the_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    sim, res = _evicted(tmp_path, notice=False)
    ((gpus, since, checkpoint, before, after, blocked),) = sim.evictions
    assert res.preemptions == 1 and since > 0 and before > checkpoint
    assert res.lost_work_gpu_h == pytest.approx(gpus * since / 3600)
    assert after == checkpoint  # back to the last checkpoint
    # the reconciler's bookkeeping: the job's and the pool's count, SpotHedge's mark
    east = next(p.pool.id for p in sim.pools if p.pool.region == "us-east-1")
    assert sim.stats.preemptions == {east: 1} and sim.stats.node_hours[east] > 0
    assert blocked
    # the round relaunches it at once, from that checkpoint, in the region still there
    first, *later = sim.starts
    assert first[1] == east and later[0][0] == 600 and later[0][2] == checkpoint
    assert "us-west-2" in later[0][1] and res.migrations >= 1
    rec = sim.records["a"]
    assert rec.state is JobState.COMPLETED and rec.preemptions == 1


def test_a_checkpoint_on_the_notice_loses_nothing(tmp_path: Path) -> None:
    sim, res = _evicted(tmp_path, notice=True)
    ((_, since, _, before, after, _),) = sim.evictions
    assert res.preemptions == 1 and since > 0 and res.lost_work_gpu_h == 0
    assert after == before and sim.starts[1][2] == before  # resumed where it stopped
    assert sim.records["a"].state is JobState.COMPLETED


def test_a_deadline_job_goes_to_on_demand_when_spot_vanishes(tmp_path: Path) -> None:
    # spot there for the first 600 s only; on-demand ten times dearer
    pools = _traced(tmp_path, [1] + [0] * 50, _v100("us-east-1", "on-demand", 3.0))
    job = _job("a", deadline=2 * 3600)
    fleet = simulate_spot([job], pools, CFG, FLEET)
    sky = simulate_spot([job], pools, CFG, SpotConfig(MarketPolicy.FAILOVER))
    assert fleet.preemptions == 1 and fleet.spot_gpu_h > 0 and fleet.ondemand_gpu_h > 0
    assert fleet.deadline_misses == 0 and fleet.result.unfinished == 0
    assert sky.deadline_misses == 1 and sky.result.unfinished == 1


def test_plan_round_decides_every_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    live = driver.plan_round

    def spy(*args, **kw):
        calls.append(args[3])
        return live(*args, **kw)

    monkeypatch.setattr(driver, "plan_round", spy)
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3),
                     _v100("us-east-1", "on-demand", 3.0))
    res = simulate_spot([_job("a"), _job("b", "ncf", 1, 256, 120.0)], pools, CFG, FLEET)
    assert res.result.unfinished == 0 and calls
    # every tick with jobs is one live round (and the rounds its settles wake), no other
    assert sorted(set(calls)) == [60.0 * k for k in range(1, len(res.result.solve_seconds) + 1)]


def test_a_denied_region_is_never_used(tmp_path: Path) -> None:
    """us-east-1 is far cheaper; a job whose spec denies it runs in us-west-2 only: the
    placement rules are the live round's, fed the job's own record."""
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.1), _v100("us-west-2", "spot", 0.9),
                     _v100("us-west-2", "on-demand", 3.0))
    starts: list[tuple[str, str]] = []

    class Noted(LiveRoundDriver):
        def _launch(self, job: SpotJob, a: Assignment, pool: SimPool, now: float) -> None:
            starts.append((job.state.id, pool.pool.id))
            super()._launch(job, a, pool, now)

    sim = Noted([_job("free"), _job("kept")], pools, CFG, FLEET)
    rec = sim.records["kept"]
    sim.records["kept"] = rec.model_copy(update={"spec": rec.spec.model_copy(
        update={"regions": Regions(deny=["aws:us-east-1"])})})
    res = sim.run()
    assert res.result.unfinished == 0
    assert {p for j, p in starts if j == "free"} == {"aws:us-east-1:spot:V100"}
    assert starts and all(not p.startswith("aws:us-east-1:") for j, p in starts if j == "kept")


def test_the_round_runs_with_the_products_defaults_but_restart_and_reaction() -> None:
    cfg = scheduler_config(SimConfig(interval=60, restart_penalty=25), checkpoint_on_notice=False)
    assert cfg.restart_s == 25 and cfg.reaction_s == 60 and not cfg.checkpoint_on_notice
    default = type(cfg)()
    for field in type(cfg).model_fields:
        if field not in ("restart_s", "reaction_s", "checkpoint_on_notice"):
            assert getattr(cfg, field) == getattr(default, field), field


def test_the_round_never_asks_for_a_configuration_the_tables_cannot_run(tmp_path: Path) -> None:
    """A job whose only configuration (8 GPUs at batch 128: 16 per GPU, below cifar10's smallest
    measured 32) its table cannot run: the job's model (the table, its prior) values it at
    nothing, so the round never launches it; it waits and costs nothing."""
    pools = _cluster(tmp_path, _v100("us-east-1", "on-demand", 3.0))
    sim = LiveRoundDriver([_job("a", "cifar10", 8, 128)], pools, SimConfig(max_hours=0.1), FLEET)
    rec = sim.records["a"]
    sim.records["a"] = rec.model_copy(update={"spec": rec.spec.model_copy(update={
        "gpus": rec.spec.gpus.model_copy(update={"min": 8}),
        "batch_size": rec.spec.batch_size.model_copy(update={"max": 128, "default": 128})})})
    res = sim.run()
    waiting = sim.records["a"]
    assert waiting.state is JobState.QUEUED and waiting.attempt == 0 and waiting.failures == 0
    assert res.result.unfinished == 1 and res.cost_usd == 0


def test_pools_share_an_id_is_refused(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3), _v100("us-east-1", "spot", 0.4))
    with pytest.raises(ValueError, match="share an id"):
        simulate_spot([_job("a")], pools, CFG, FLEET)


def test_reports_are_in_samples_at_the_initial_batch(tmp_path: Path) -> None:
    pools = _cluster(tmp_path, _v100("us-east-1", "on-demand", 3.0))
    sim = LiveRoundDriver([_job("a", "ncf", 1, 256)], pools, SimConfig(max_hours=0.05), FLEET)
    sim.run()
    (job,) = sim.jobs
    rec = sim.records["a"]
    a = job.state.current
    assert a is not None and rec.state is JobState.RUNNING and rec.pool is not None
    m0 = job.state.app.init_batch_size
    rate, _ = job.state.app.rate(a.accelerator, a.placement, a.batch_size, job.state.epoch)
    assert rec.samples_per_sec == pytest.approx(rate * m0)
    assert rec.measured[f"V100:{a.gpus}x{a.batch_size}"] == rec.samples_per_sec
    # the gradient noise scale its runtime would measure, from the same tables
    eff = job.state.app.efficiency
    assert rec.grad_noise_scale == pytest.approx(eff.noise_scale(a.batch_size, job.state.epoch))
    phi = rec.grad_noise_scale / m0
    assert eff.gain(a.batch_size, job.state.epoch) == pytest.approx(
        (phi + 1) / (phi * m0 / a.batch_size + 1))
    assert (rec.measured_gpus, rec.measured_batch_size) == (a.gpus, a.batch_size)
    assert rec.samples_done == int(job.state.progress * m0) > 0
    assert json.loads(rec.model_dump_json())["state"] == "running"
    assert sim.pools[0].pool.market is Market.ON_DEMAND


class _Storm(driver.LiveRoundDriver):
    """Records every reclaim (when, where, how long the job had run) and every start."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.reclaims: list[tuple[float, str, float | None, bool]] = []
        self.starts: list[tuple[float, str]] = []

    def _evict(self, job, now: float) -> None:
        rec = self.records[job.state.id]
        pool = job.pool.pool.id
        super()._evict(job, now)
        ran = None if rec.launched_at is None else now - rec.launched_at
        self.reclaims.append((now, pool, ran, self.blocklist.is_refused(pool, now)))

    def _launch(self, job: SpotJob, a: Assignment, pool: SimPool, now: float) -> None:
        self.starts.append((now, pool.pool.id))
        super()._launch(job, a, pool, now)


def test_a_pool_under_reclaim_is_backed_off_as_live(tmp_path: Path) -> None:
    """Two spot regions each take their capacity back 120 s after it returns (a storm), an
    on-demand one stays: as the live reconciler does (policies.migration.mark_reclaimed), a
    pool's second reclaim within 300 s of a launch, within 600 s of its first, refuses the
    pool for 600 s, and nothing is started there meanwhile."""
    east = _trace(tmp_path / "east.json", [1, 0] * 40, gap=120)
    west = _trace(tmp_path / "west.json", [0, 1] * 40, gap=120)
    pools = _cluster(tmp_path, _v100("us-east-1", "spot", 0.3, extra=f", trace: {east}"),
                     _v100("us-west-2", "spot", 0.35, extra=f", trace: {west}"),
                     _v100("eu-west-1", "on-demand", 3.0))
    sim = _Storm([_job("a", gpus=8, batch=96)], pools, SimConfig(max_hours=3), FLEET)
    sim.run()
    early: dict[str, list[float]] = {}
    backoffs = []
    for t, pool, ran, refused in sim.reclaims:
        assert ran is not None
        second = ran <= 300 and any(t - e < 600 for e in early.get(pool, []))
        assert refused == second, (t, pool, ran, sim.reclaims)
        if ran <= 300:
            early.setdefault(pool, []).append(t)
        if second:
            backoffs.append((t, pool))
    assert backoffs, sim.reclaims  # the storm did reach the rule
    for t, pool in backoffs:
        assert not [s for s in sim.starts if s[1] == pool and t <= s[0] < t + 600], sim.starts
