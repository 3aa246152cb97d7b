"""Scheduling rounds: launches, shrink on arrival, stop on cancel, admission drop; what
placement is told about each job and pool; the deadline rule's market, spot: never jobs kept
whole, moves past the stickiness margin, refusal marks and region filters. What planning decides
is tested on the pure round (``builders.planned``); a real redis-server serves the tests of what
needs the store (a stale fence refused, agents' measurements, resizes in place, several rounds
carried out)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import pytest

from broker.api import resize_owed
from broker.models import IntentKind, JobRecord, JobState
from broker.scheduler import (
    WAIT_FOR_ON_DEMAND,
    WAIT_FOR_SPOT,
    Admission,
    Marks,
    Paced,
    Policy,
    Scheduler,
    SchedulerConfig,
    checkpoint_interval_s,
    deadline_job,
    job_choices,
    placement_request,
    plan_round,
    pool_risk,
    refused_pools,
    requested_choice,
    samples_per_sec,
)
from broker.scheduler.pacing import spare_on_demand, with_recovery, work_hours
from broker.store import Plan, PoolStats, StaleFence, Store
from policies.elastic_dp import Choice
from policies.migration import Blocklist, mark_refused
from policies.models import (
    Accelerator,
    BatchRange,
    CheckpointSpec,
    GpuRange,
    JobSpec,
    Market,
    Pool,
    SpotPolicy,
)
from policies.region_score import Candidate, hazard_per_hour
from policies.spot import choose_market, holds_pace
from policies.throughput import batch_candidates
from policies.trace_throughput import packed_placement
from providers.measurements import load_application
from tests import builders
from tests.builders import NOW, planned, record

# The jobs here take one to four GPUs and a global batch of 32-512 unless a test says otherwise.
spec = partial(builders.spec, gpus=(1, 4), batch=(32, 512), samples=1_000)


POOLS = [
    Pool(cloud="aws", region="east", accelerator=Accelerator.T4, market=Market.SPOT, nodes=1,
         gpus_per_node=4, price_per_gpu_hour=0.2),
    Pool(cloud="aws", region="west", accelerator=Accelerator.T4, market=Market.ON_DEMAND,
         nodes=1, gpus_per_node=2, price_per_gpu_hour=0.9),
]


def run_all(store: Store, fence: int) -> None:
    """Stand in for the actuator: every launching job starts running."""
    for job in store.list_jobs(states=["launching"]):
        plan = Plan(intents_del=[i.id for i in store.intents() if i.job_id == job.id])
        plan.change(job, JobState.RUNNING, launched_at=0.0)
        store.apply(plan, fence=fence)


def test_round_launches_fills_cheapest_pool_then_shrinks_for_newcomer(store: Store) -> None:
    store.set_pools(POOLS)
    fence = store.acquire_lease("t", ttl_s=30)
    sched = Scheduler(store, SchedulerConfig(min_rescale_interval_s=0))
    a = store.submit(spec("a"), team="t")
    res = sched.run_round(fence)
    assert res.launches == 1
    job = store.get_job(a.id)
    assert job is not None and job.state is JobState.LAUNCHING
    assert job.pool == POOLS[0].id and job.gpus == 4 and job.attempt == 1
    (intent,) = store.intents()
    assert intent.kind is IntentKind.LAUNCH and intent.key == f"{a.id}:{fence}:1"
    run_all(store, fence)
    assert sched.run_round(fence).plan.empty()  # stable: nothing to change
    others = [store.submit(spec(n), team="t") for n in ("b", "c", "d")]
    sched.run_round(fence)
    # Three newcomers and 6 GPUs: the 4-GPU job shrinks; the newcomers that fit in the free
    # on-demand GPUs start now, the rest wait until the shrinking job has checkpointed.
    assert store.get_job(a.id).state is JobState.SUSPENDING  # type: ignore[union-attr]
    kinds = [i.kind for i in store.intents() if i.job_id == a.id]
    assert kinds == [IntentKind.RESIZE]
    launched = [j for j in (store.get_job(o.id) for o in others)
                if j and j.state is JobState.LAUNCHING]
    assert launched and all(j.pool == POOLS[1].id for j in launched)
    assert sum(j.gpus for j in launched) <= 2


def test_cancel_running_job_becomes_stop_intent(store: Store) -> None:
    store.set_pools(POOLS)
    fence = store.acquire_lease("t", ttl_s=30)
    sched = Scheduler(store)
    a = store.submit(spec("a"), team="t")
    sched.run_round(fence)
    run_all(store, fence)
    store.request_cancel(a.id)
    res = sched.run_round(fence)
    assert res.stops == 1
    assert [i.kind for i in store.intents()] == [IntentKind.STOP]


def test_admission_drop_and_static_policy() -> None:
    jobs = [record(f"j{i}", spec(f"j{i}")) for i in range(3)]
    got = planned(jobs, POOLS[1:],  # 2 GPUs
                           SchedulerConfig(policy=Policy.STATIC, admission=Admission.DROP))
    states = [got.states.get(j.id) for j in jobs]
    assert states.count(JobState.LAUNCHING) == 2 and states.count(JobState.DROPPED) == 1


def test_stale_fence_writes_nothing(store: Store) -> None:
    store.set_pools(POOLS)
    old = store.acquire_lease("old", ttl_s=30)
    store.r.delete(store.p + "leader")
    store.acquire_lease("new", ttl_s=30)
    a = store.submit(spec("a"), team="t")
    with pytest.raises(StaleFence):
        Scheduler(store).run_round(old)
    assert store.get_job(a.id).state is JobState.QUEUED  # type: ignore[union-attr]
    assert store.intents() == []


def test_choices_elastic_vs_fixed_batch() -> None:
    from broker.models import JobRecord
    job = JobRecord(id="x-1", spec=spec("x"), team="t")
    elastic = job_choices(job, Policy.ELASTIC, 4)
    fixed = job_choices(job, Policy.FIXED_BATCH, 4)
    assert [c.gpus for c in elastic] == [1, 2, 3, 4]
    assert {c.batch_size for c in fixed} == {32}
    assert elastic[0].value == pytest.approx(1.0)
    assert all(e.value >= f.value for e, f in zip(elastic, fixed, strict=True))


def test_measured_throughput_replaces_the_model(store: Store) -> None:
    """A job whose agent measured no gain from a second GPU is valued that way."""
    job = store.submit(spec("slow", gpus=(1, 2), batch_mode="fixed"), team="t")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1)
    store.apply(plan)
    for gpus, sps in ((1, 100.0), (2, 101.0)):
        store.record_heartbeat(job.id, 1, samples_done=10, samples_per_sec=sps,
                               world_size=gpus, global_batch_size=32, accelerator=Accelerator.T4)
    got = store.get_job(job.id)
    assert got is not None and got.measured == {"T4:1x32": 100.0, "T4:2x32": 101.0}
    one, two = job_choices(got, Policy.ELASTIC, 4)
    assert one.value == pytest.approx(1.0) and two.value == pytest.approx(1.01)
    modelled = job_choices(job, Policy.ELASTIC, 4)[1].value
    assert modelled > 1.2  # the model alone expected a real speed-up


def test_placement_request_and_pool_risk_from_the_job_and_the_counts() -> None:
    """What placement weighs: hours left at the chosen size (throughput estimate), the checkpoint
    interval (a step count at the step rate), the checkpoint's region (the last pool's), and per
    pool the prior, the counted preemptions and node-hours (closed plus those running now)."""
    from broker.models import JobRecord

    steps = spec("s").model_copy(update={"work_samples": 3_600_000,
                                         "checkpoint": CheckpointSpec(interval="500steps")})
    job = JobRecord(id="s-1", spec=steps, team="t", state=JobState.SUSPENDED, attempt=2,
                    pool="gcp:west/b:spot:T4", samples_done=1_800_000,
                    measured={"T4:2x64": 1000.0})  # the agent measured 1000 samples/s at 2x64
    assert samples_per_sec(job, 2, 64) == 1000.0
    assert checkpoint_interval_s(steps, 64, 1000.0) == pytest.approx(32.0)
    assert checkpoint_interval_s(spec("t"), 64, 1000.0) == 100.0  # the spec's default, 100s
    config = SchedulerConfig(restart_s=120, checkpoint_gb=5, checkpoint_on_notice=False)
    req = placement_request(job, Choice(2, 64, 1.0), [1], Marks(), {}, config)
    assert req.remaining_h == pytest.approx(0.5) and req.restart_h == pytest.approx(120 / 3600)
    assert req.checkpoint_interval_h == pytest.approx(32 / 3600)
    on_notice = config.model_copy(update={"checkpoint_on_notice": True})
    assert placement_request(job, Choice(2, 64, 1.0), [1], Marks(), {},
                             on_notice).checkpoint_interval_h == 0  # a preemption loses none
    assert (req.checkpoint_cloud, req.checkpoint_region, req.checkpoint_gb) == ("gcp", "west", 5)
    assert req.current_pool is None  # suspended: it is placed again, not kept
    fresh = placement_request(job.model_copy(update={"attempt": 0, "pool": None}),
                              Choice(2, 64, 1.0), [], Marks(), {}, config)
    assert fresh.checkpoint_cloud is None and fresh.checkpoint_gb == 0  # nothing to carry yet
    east = POOLS[0].id
    running = job.model_copy(update={"state": JobState.RUNNING, "pool": east,
                                     "launched_at": 1000.0, "node_ids": ["n1"]})
    risk = pool_risk(POOLS, {east: 0.25}, PoolStats({east: 3}, {east: 2.0}), [running],
                     now=1000.0 + 1800)
    assert risk[east].prior_monthly_rate == 0.25 and risk[east].preemptions_seen == 3
    assert risk[east].node_hours_seen == pytest.approx(2.5)
    assert risk[POOLS[1].id].preemptions_seen == 0 and risk[POOLS[1].id].prior_monthly_rate == 0
    # a pool the advisor has no figure for takes scheduler.unknown_reclaim_rate; no priors at
    # all (no advisor): 0 everywhere
    unknown = SchedulerConfig(unknown_reclaim_rate=0.3).unknown_reclaim_rate
    risk = pool_risk(POOLS, {east: 0.25}, PoolStats(), [], now=0.0, unknown_rate=unknown)
    assert (risk[east].prior_monthly_rate, risk[POOLS[1].id].prior_monthly_rate) == (0.25, 0.3)
    assert pool_risk(POOLS, None, PoolStats(), [], now=0.0,
                     unknown_rate=unknown)[east].prior_monthly_rate == 0
    assert SchedulerConfig().unknown_reclaim_rate == 0.15
    # the prior's weight (scheduler.prior_weight_h): light, the pool's own 3 reclaims in 2.5
    # node-hours dominate its hazard; heavy, the prior's 0.25 a month does
    def hazard(weight: float) -> float:
        r = pool_risk(POOLS, {east: 0.25}, PoolStats({east: 3}, {east: 2.0}), [running],
                      now=1000.0 + 1800, prior_weight_h=weight)[east]
        return hazard_per_hour(Candidate(pool=POOLS[0], **asdict(r)))
    assert hazard(1e-3) == pytest.approx(3 / 2.5, rel=1e-3)
    assert hazard(1e9) == pytest.approx(-math.log1p(-0.25) / 730, rel=1e-3)
    assert hazard(SchedulerConfig().prior_weight_h) == pytest.approx(
        hazard(24.0))  # the default


def test_only_gpu_counts_an_instance_type_offers_are_chosen_and_placed(store: Store) -> None:
    """A cloud pool of 8 GPUs whose V100 types hold 1, 4 or 8: a 3-GPU job gets 1 (never the 2
    or 3 no instance type has), and two 3-GPU jobs fill it as 1 + 1, not 2 + 3 + ..."""
    cloud = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100,
                 market=Market.SPOT, nodes=1, gpus_per_node=8, price_per_gpu_hour=0.9,
                 gpu_prices={1: 1.2, 4: 1.0, 8: 0.9})
    store.set_pools([cloud])
    fence = store.acquire_lease("t", ttl_s=30)
    sched = Scheduler(store, SchedulerConfig(min_rescale_interval_s=0))
    jobs = [store.submit(spec(n, gpus=(1, 3), accelerators=[Accelerator.V100]), team="t")
            for n in ("a", "b")]
    sched.run_round(fence)
    for j in jobs:
        got = store.get_job(j.id)
        assert got is not None and got.state is JobState.LAUNCHING and got.gpus == 1
    wide = store.submit(spec("c", gpus=(1, 6), accelerators=[Accelerator.V100]), team="t")
    run_all(store, fence)
    sched.run_round(fence)
    # c may take 1 or 4 (6 is no instance type's count, 8 is above its max); a and b keep 1 each,
    # the only count <= 3 offered, so 1 + 1 + 4 = 6 <= 8 fits and 4 GPUs are worth more than 1
    assert store.get_job(wide.id).gpus == 4  # type: ignore[union-attr]
    assert [store.get_job(j.id).gpus for j in jobs] == [1, 1]  # type: ignore[union-attr]
    assert not cloud.launchable(2) and cloud.launchable(4)
    # a job no instance size fits waits with a reason that names the field (or is dropped)
    odd = store.submit(spec("odd", gpus=(2, 3), accelerators=[Accelerator.V100]),
                       team="t")
    sched.run_round(fence)
    waiting = store.get_job(odd.id)
    assert waiting is not None and waiting.state is JobState.QUEUED
    assert waiting.reason is not None and "gpus 2:3: no V100 instance type" in waiting.reason
    assert "sizes 1, 4, 8" in waiting.reason
    version = waiting.version
    sched.run_round(fence)
    assert store.get_job(odd.id).version == version  # type: ignore[union-attr]  # said once
    dropper = Scheduler(store, SchedulerConfig(admission=Admission.DROP))
    dropped = dropper.run_round(fence)
    assert store.get_job(odd.id).state is JobState.DROPPED  # type: ignore[union-attr]
    assert (dropped.dropped, dropped.changed.count(odd.id)) == (1, 1)  # one change, one event
    assert [e.type for e in store.events(job_id=odd.id)].count("dropped") == 1
    assert Pool(cloud="local", region="lab", accelerator=Accelerator.T4, nodes=1,
                gpus_per_node=4).launchable(3)  # no instance types: any count that fits


EAST = Pool(cloud="aws", region="east", accelerator=Accelerator.T4, market=Market.SPOT,
            nodes=1, gpus_per_node=4, price_per_gpu_hour=0.2)
WEST = EAST.model_copy(update={"cloud": "gcp", "region": "west", "price_per_gpu_hour": 0.201})


def suspended_after_a_run(job_spec: JobSpec, pool: Pool,
                          checkpoint_bytes: int | None) -> JobRecord:
    """A job that ran once in ``pool`` (its agent measured ``checkpoint_bytes``) and is
    suspended: the next round places it again."""
    measured = {} if checkpoint_bytes is None else {
        "samples_done": 1000, "checkpoint_step": 10, "checkpoint_bytes": checkpoint_bytes}
    return record(job_spec.name, job_spec.model_copy(update={"work_samples": 10**7}),
                  state=JobState.SUSPENDED, attempt=1, gpus=1, pool=pool.id, **measured)


def test_a_measured_checkpoint_size_prices_the_move() -> None:
    """Three suspended jobs whose checkpoints live in gcp:west, with aws:east slightly cheaper
    and a fleet-wide estimate of 50 GB: the job whose agent measured 50 GB stays (4.50 USD of
    internet egress to leave), the one that measured 1 MB moves (the measurement beats the
    estimate), and the one without a measurement stays on the estimate."""
    jobs = {name: suspended_after_a_run(spec(name, gpus=1), WEST, size) for name, size in
            (("big", 50_000_000_000), ("small", 1_000_000), ("unmeasured", None))}
    config = SchedulerConfig(min_rescale_interval_s=0, checkpoint_gb=50)
    assert placement_request(jobs["big"], Choice(1, 32, 1.0), [], Marks(), {},
                             config).checkpoint_gb == 50
    got = planned(list(jobs.values()), [EAST, WEST], config)
    where = {n: got.launches[j.id][0] for n, j in jobs.items()}
    assert where == {"big": WEST.id, "small": EAST.id, "unmeasured": WEST.id}


def test_a_named_checkpoint_bucket_is_where_a_move_restores_from() -> None:
    """The job last ran in aws:east, but its 50 GB checkpoint lives in a gcp:west bucket
    (``checkpoint.region``): placement prices the restore from gcp:west, so the job goes there
    over aws:east at a price 0.5 % lower (4.50 USD of internet egress to read it in aws)."""
    jobs = {}
    for name, bucket in (("bucket", "gcp:west"), ("local", None)):
        base = spec(name, gpus=1)
        ck = base.checkpoint.model_copy(update={"uri": "gs://ck/" + name, "region": bucket})
        jobs[name] = suspended_after_a_run(base.model_copy(update={"checkpoint": ck}), EAST,
                                           50_000_000_000)
    req = placement_request(jobs["bucket"], Choice(1, 32, 1.0), [], Marks(), {},
                            SchedulerConfig())
    assert (req.checkpoint_cloud, req.checkpoint_region, req.checkpoint_gb) == ("gcp", "west", 50)
    got = planned(list(jobs.values()), [EAST, WEST], SchedulerConfig(min_rescale_interval_s=0))
    assert {n: got.launches[j.id][0] for n, j in jobs.items()} == {
        "bucket": WEST.id, "local": EAST.id}


def test_a_named_bucket_draws_a_new_job_to_its_region() -> None:
    """Before its first run a job has nothing to restore, but it will write every checkpoint
    to its gcp:west bucket: with 50 GB checkpoints that keeps it out of aws:east, 0.5 % cheaper
    per GPU-hour. The same job without a named bucket goes to aws:east."""
    config = SchedulerConfig(checkpoint_gb=50)
    jobs = {}
    for name, bucket in (("bucket", "gcp:west"), ("local", None)):
        base = spec(name, gpus=1)
        ck = base.checkpoint.model_copy(update={"uri": "gs://ck/" + name, "region": bucket})
        jobs[name] = record(name, base.model_copy(update={"checkpoint": ck}))
    req = placement_request(jobs["bucket"], Choice(1, 32, 1.0), [], Marks(), {}, config)
    assert (req.checkpoint_cloud, req.bucket_cloud, req.bucket_region, req.checkpoint_gb) == (
        None, "gcp", "west", 50)
    got = planned(list(jobs.values()), [EAST, WEST], config)
    assert {n: got.launches[j.id][0] for n, j in jobs.items()} == {
        "bucket": WEST.id, "local": EAST.id}


# ---- deadlines (policies.spot.choose_market), spot: never, stickiness in the live broker ------

HOUR = 3600.0
SPOT_T4 = Pool(cloud="aws", region="east", accelerator=Accelerator.T4, market=Market.SPOT,
               nodes=1, gpus_per_node=4, price_per_gpu_hour=0.2)
OD_T4 = Pool(cloud="aws", region="west", accelerator=Accelerator.T4, market=Market.ON_DEMAND,
             nodes=1, gpus_per_node=4, price_per_gpu_hour=0.9)


def paced(name: str, deadline_h: float | None, elapsed_h: float = 1.0, done_h: float = 0.5,
          total_h: float = 2.0, running_in: Pool | None = None, spot: str = "allowed",
          gpus: int = 1, batch: int = 32) -> JobRecord:
    """A ``gpus``-GPU job (fixed ``batch``) its agent measured at 1000 samples/s a GPU:
    ``total_h`` hours of work at that size of which ``done_h`` are done, submitted ``elapsed_h``
    before ``NOW``; suspended after its first attempt, or running in ``running_in``. At batch
    32 the model has 3 GPUs about as fast as 4 (8 GPUs split the batch too finely); at 256
    more is faster."""
    rate = 1000.0 * gpus
    job_spec = spec(name, gpus=(1, gpus), batch_mode="fixed", spot=spot,
                    deadline_s=None if deadline_h is None else deadline_h * HOUR).model_copy(
        update={"work_samples": int(total_h * HOUR * rate),
                "batch_size": BatchRange(min=32, max=512, default=batch)})
    where: dict[str, Any] = {"state": JobState.SUSPENDED} if running_in is None else {
        "state": JobState.RUNNING, "gpus": gpus, "pool": running_in.id, "launched_at": 0.0}
    return record(name, job_spec, attempt=1, batch_size=batch,
                  submitted_at=NOW - elapsed_h * HOUR, samples_done=int(done_h * HOUR * rate),
                  samples_per_sec=rate, measured_gpus=gpus, measured_batch_size=batch, **where)


def test_deadline_job_in_hours_of_work_at_the_measured_rate() -> None:
    job = paced("d", deadline_h=2.55)
    view = deadline_job(job, Choice(1, 32, 1.0), {}, SchedulerConfig(), now=NOW)
    assert view.total_h == pytest.approx(2.0) and view.progress_h == pytest.approx(0.5)
    assert view.elapsed_h == pytest.approx(1.0) and view.deadline_h == 2.55
    # a preemption costs the reaction (6 s), the restart (60 s) and a checkpoint interval (100 s)
    assert view.restart_h == pytest.approx(166 / HOUR)
    assert view.behind_pace and view.slack_h == pytest.approx(0.05)
    assert not view.must_not_preempt and view.current is None
    never = job.model_copy(update={"spec": job.spec.model_copy(update={"spot": SpotPolicy.NEVER})})
    assert deadline_job(never, Choice(1, 32, 1.0), {}, SchedulerConfig(), 0.0).must_not_preempt


def test_a_tight_deadline_behind_pace_takes_on_demand_while_ample_slack_takes_spot() -> None:
    """Both pools have room. 1.5 h of work left, 1 h after submission: with the deadline at
    2.55 h its slack (3 min) is under two preemptions' cost (2 x 166 s), so it finishes on
    on-demand; with the deadline at 10 h it runs on the cheaper spot."""
    tight, ample = paced("tight", 2.55), paced("ample", 10.0)
    got = planned([tight, ample], [SPOT_T4, OD_T4])
    assert got.states == {tight.id: JobState.LAUNCHING, ample.id: JobState.LAUNCHING}
    assert (got.launches[tight.id][0], got.launches[ample.id][0]) == (OD_T4.id, SPOT_T4.id)


def test_a_lost_deadline_buys_no_on_demand() -> None:
    """Both pools have room. With 1.5 h of work left 1 h after submission, a deadline at
    2.55 h can still be met (3 min of slack) and takes on-demand; one at 2.4 h cannot be, even
    on on-demand (no larger size runs faster), so the job runs as one without a deadline, on
    the cheaper spot, leaving the on-demand room to jobs whose deadlines it can save."""
    tight, lost = paced("tight", 2.55), paced("lost", 2.4)
    got = planned([tight, lost], [SPOT_T4, OD_T4])
    assert (got.launches[tight.id][0], got.launches[lost.id][0]) == (OD_T4.id, SPOT_T4.id)


def test_without_spot_room_a_job_behind_pace_takes_on_demand_and_one_ahead_waits() -> None:
    """The spot pool is full; 4 on-demand GPUs are free. Behind its pace (0.5 h done of 2 h at
    1 h of a 3 h deadline) a job takes on-demand; ahead of its pace (10 h deadline) one waits
    for spot and holds no GPUs: its share goes to a job without a deadline, which takes the
    other 3 on-demand GPUs as before."""
    behind, ahead = paced("behind", 3.0), paced("ahead", 10.0)
    wide = record("wide", spec("wide", gpus=(1, 4)))
    jobs = [fill(SPOT_T4), behind, ahead, wide]
    got = planned(jobs, [SPOT_T4, OD_T4])
    assert got.launches == {behind.id: (OD_T4.id, 1), wide.id: (OD_T4.id, 3)}
    assert set(got.intents) == {behind.id, wide.id}  # no launch for "ahead"
    assert ahead.id not in got.states and got.reasons[ahead.id] == WAIT_FOR_SPOT
    again = planned(list(got.jobs.values()), [SPOT_T4, OD_T4])
    assert ahead.id not in again.reasons  # said once


def fill(pool: Pool, gpus: int | None = None, running: bool = False) -> JobRecord:
    """A job holding ``gpus`` of ``pool``'s GPUs, all by default: launching there, or running
    there since ``NOW`` (so the allocator keeps its size: ``min_rescale_interval_s``)."""
    gpus = pool.capacity if gpus is None else gpus
    name = f"fill-{pool.region}"
    return record(name, spec(name, gpus=(1, gpus), batch_mode="fixed"),
                  state=JobState.RUNNING if running else JobState.LAUNCHING, attempt=1,
                  gpus=gpus, batch_size=32, pool=pool.id, launched_at=NOW if running else None)


def test_without_on_demand_room_a_deadline_job_takes_spot_and_a_spot_never_one_says_it_waits(
        ) -> None:
    """The on-demand pool is full, spot has room. A job the deadline rule sends to on-demand
    (3 min of slack) runs on spot rather than not at all; one running on spot past the safety
    net keeps its spot pool instead of being suspended; a spot: never job waits and says why,
    once."""
    tight = paced("tight", 2.55)
    running = paced("running", 2.54, running_in=SPOT_T4)
    never = paced("never", 10.0, spot="never")
    got = planned([fill(OD_T4), tight, running, never], [SPOT_T4, OD_T4])
    assert (got.states[tight.id], got.launches[tight.id][0]) == (JobState.LAUNCHING, SPOT_T4.id)
    assert running.id not in got.states and got.jobs[running.id].pool == SPOT_T4.id
    assert running.id not in got.intents and never.id not in got.intents
    assert never.id not in got.states and got.reasons[never.id] == WAIT_FOR_ON_DEMAND
    again = planned(list(got.jobs.values()), [SPOT_T4, OD_T4])
    assert never.id not in again.reasons  # said once


def test_the_deadline_view_is_at_the_requested_size_whatever_the_allocation() -> None:
    """A 4-GPU job (4000 samples/s measured): 2 h of work at 4 GPUs, 0.5 h done, 1 h into a
    2.75 h deadline. At 4 GPUs it has 15 min of slack (spot); counted at 1 GPU (a small
    allocation, about 3000 samples/s by the calibrated model) the deadline would look lost
    (on-demand). Its requested size is 4, bounded by the largest pool it may use: 2 when only
    a 2-GPU pool is left to it."""
    job = paced("d", deadline_h=2.75, gpus=4)
    opts = job_choices(job, Policy.ELASTIC, 8)
    assert [c.gpus for c in opts] == [1, 2, 3, 4]
    requested = requested_choice(job, opts, [SPOT_T4, OD_T4], Marks())
    assert requested is not None and requested.gpus == 4
    at = {g: deadline_job(job, next(c for c in opts if c.gpus == g), {}, SchedulerConfig(), NOW)
          for g in (1, 4)}
    assert at[4].slack_h == pytest.approx(0.25) and at[1].slack_h < 0
    assert Paced.of(requested, at[4]).market is Market.SPOT
    assert Paced.of(opts[0], at[1]).market is Market.ON_DEMAND  # what the old view did
    two = OD_T4.model_copy(update={"gpus_per_node": 2})
    refused = Marks(refused={SPOT_T4.id: "capacity"})
    assert requested_choice(job, opts, [SPOT_T4, two], refused).gpus == 2  # type: ignore[union-attr]
    never = job.model_copy(update={"spec": job.spec.model_copy(update={"spot": SpotPolicy.NEVER})})
    assert requested_choice(never, opts, [SPOT_T4, two], Marks()).gpus == 2  # type: ignore[union-attr]


def test_on_demand_after_a_spot_miss_runs_at_the_requested_size() -> None:
    """Spot is full; 4 on-demand GPUs, a 4-GPU deadline job behind its pace and a job without a
    deadline that would share them. The deadline job falls back to on-demand at its requested
    4 GPUs (the size its pace is judged at), not at the 2 a shared allocation leaves it."""
    behind = paced("behind", 3.0, gpus=4, batch=256)
    wide = record("wide", spec("wide", gpus=(1, 4)))
    got = planned([fill(SPOT_T4), behind, wide], [SPOT_T4, OD_T4])
    assert got.launches == {behind.id: (OD_T4.id, 4)} and wide.id not in got.states


def test_on_demand_for_pace_takes_the_largest_size_an_on_demand_pool_holds() -> None:
    """An 8-GPU spot pool (a job just started there holds it) and a 4-GPU on-demand pool (free);
    a job accepting 1-8 GPUs,
    behind its pace, judged at 8 (the spot pool's size). Sent to spot first (3 h deadline) or to
    on-demand first (2.55 h: at the net), it runs on on-demand at 4, the most an on-demand pool
    holds, instead of idling at 8."""
    spot8 = SPOT_T4.model_copy(update={"gpus_per_node": 8})
    filler = fill(spot8, running=True)
    for deadline_h, first in ((3.0, Market.SPOT), (2.55, Market.ON_DEMAND)):
        job = paced(f"behind-{first.value}", deadline_h, gpus=8, batch=256)
        requested = requested_choice(job, job_choices(job, Policy.ELASTIC, 12), [spot8, OD_T4],
                                     Marks())
        assert requested is not None and requested.gpus == 8
        view = deadline_job(job, requested, {}, SchedulerConfig(), NOW)
        assert view.behind_pace and Paced.of(requested, view).market is first
        got = planned([filler, job], [spot8, OD_T4])
        assert (got.states[job.id], got.launches[job.id]) == (
            JobState.LAUNCHING, (OD_T4.id, 4)), first
        assert filler.id not in got.states and filler.id not in got.intents


def test_a_spot_never_job_no_on_demand_pool_can_launch_says_so() -> None:
    """On-demand T4 comes only as 8-GPU instances; a spot: never job accepting 1-4 GPUs (which
    the spot pool could launch) would wait forever: it says why, once, or is dropped."""
    od8 = OD_T4.model_copy(update={"gpus_per_node": 8, "gpu_prices": {8: 0.9}})
    job = record("never", spec("never", gpus=(1, 4), spot="never"))
    got = planned([job], [SPOT_T4, od8])
    assert job.id not in got.states and got.reasons[job.id] == (
        "spot: never runs on on-demand only, and no on-demand T4 pool in its regions launches "
        "1-4 GPUs; allow spot, or widen gpus or regions")
    dropped = planned([job], [SPOT_T4, od8], SchedulerConfig(admission=Admission.DROP))
    assert dropped.states[job.id] is JobState.DROPPED


def test_two_jobs_behind_pace_share_the_on_demand_room() -> None:
    """Spot (4 GPUs) is full; 6 of 8 on-demand GPUs are free; two 4-GPU jobs behind their pace.
    Both cannot run at their pace size: one runs at 4, the other at 2 below its pace, rather
    than idling beside free GPUs."""
    od8 = OD_T4.model_copy(update={"gpus_per_node": 8})
    jobs = [paced(f"behind-{i}", 3.0, gpus=4, batch=256) for i in range(2)]
    got = planned([fill(SPOT_T4, running=True), fill(od8, gpus=2), *jobs], [SPOT_T4, od8])
    assert sorted(got.launches.get(j.id, ("", 0)) for j in jobs) == [(od8.id, 2), (od8.id, 4)]


def test_a_spot_never_deadline_job_takes_the_on_demand_room_there_is() -> None:
    """A 4-GPU spot: never job with a deadline; another job holds 2 of the 4 on-demand GPUs. It
    runs on the 2 free ones now instead of waiting for all 4."""
    never = paced("never", 10.0, spot="never", gpus=4, batch=256)
    got = planned([fill(OD_T4, gpus=2), never], [SPOT_T4, OD_T4])
    assert (got.states[never.id], got.launches[never.id]) == (JobState.LAUNCHING, (OD_T4.id, 2))


def test_a_deadline_job_with_no_on_demand_room_gives_its_share_back() -> None:
    """On-demand is full, 4 spot GPUs are free. A spot: never deadline job finds no on-demand
    room and waits (and says so); the GPUs the allocator had counted for it go to a job without
    a deadline this round, which takes all 4."""
    never = paced("never", 10.0, spot="never", gpus=4, batch=256)
    wide = record("wide", spec("wide", gpus=(1, 4)))
    got = planned([fill(OD_T4), never, wide], [SPOT_T4, OD_T4])
    assert got.launches == {wide.id: (SPOT_T4.id, 4)}
    assert never.id not in got.states and got.reasons[never.id] == WAIT_FOR_ON_DEMAND


def test_a_running_job_s_requested_size_counts_its_own_refused_pool() -> None:
    """The cloud refused a launch in an 8-GPU spot pool where an 8-GPU deadline job runs: the
    job may stay there (a refusal mark keeps only new launches out), so its requested size is
    still 8; a job not running there is judged at the 4 the on-demand pool holds."""
    spot8 = SPOT_T4.model_copy(update={"gpus_per_node": 8})
    refused = Marks(refused={spot8.id: "capacity"})
    got = {job.spec.name: requested_choice(job, job_choices(job, Policy.ELASTIC, 12),
                                           [spot8, OD_T4], refused)
           for job in (paced("running", 3.0, gpus=8, running_in=spot8),
                       paced("queued", 3.0, gpus=8))}
    assert {k: c.gpus for k, c in got.items() if c is not None} == {"running": 8, "queued": 4}


def test_a_spot_job_that_holds_its_pace_is_not_shrunk_for_a_newcomer() -> None:
    """A 2-GPU deadline job runs on spot with 5 min of slack: above the safety net (166 s),
    under the return margin (392 s), so it holds its pace (``policies.spot.holds_pace``): a
    high-priority newcomer does not shrink it, as it shrinks the same job with ample slack."""
    newcomer = record("newcomer", spec("newcomer", gpus=(1, 4), priority=100))
    for deadline_h, kept in ((2.5 + 300 / HOUR, True), (10.0, False)):
        job = paced(f"d-{int(kept)}", deadline_h, running_in=SPOT_T4, gpus=2)
        view = deadline_job(job, Choice(2, 32, 1.0), {SPOT_T4.id: SPOT_T4}, SchedulerConfig(),
                            NOW)
        assert holds_pace(view) is kept and choose_market(view, True) is Market.SPOT
        got = planned([job, newcomer], [SPOT_T4], SchedulerConfig(min_rescale_interval_s=0))
        # shrunk by a restart (an intent) or in place on its node (its size)
        shrunk = job.id in got.intents or got.jobs[job.id].gpus < 2
        assert (not shrunk) is kept


def test_a_spot_never_job_is_not_shrunk_or_suspended_to_make_room() -> None:
    """Two GPUs, a running 2-GPU job and a high-priority newcomer: an ordinary job is resized
    or suspended for it; one that must not be preempted (spot: never) keeps both GPUs and the
    newcomer waits."""
    config = SchedulerConfig(min_rescale_interval_s=0)
    for policy, kept in (("allowed", False), ("never", True)):
        a = record(f"a-{policy}", spec(f"a-{policy}", gpus=(1, 2), spot=policy))
        launched = planned([a], [POOLS[1]], config).jobs[a.id]
        running = launched.model_copy(update={"state": JobState.RUNNING, "launched_at": NOW})
        assert running.gpus == 2
        b = record(f"b-{policy}", spec(f"b-{policy}", gpus=(1, 2), priority=50))
        got = planned([running, b], [POOLS[1]], config)
        kinds = [i.kind for i in got.intents.get(a.id, [])]
        assert (kinds == []) is kept, (policy, kinds)
        if kept:
            assert got.jobs[a.id].gpus == 2 and b.id not in got.states
        else:
            assert kinds in ([IntentKind.RESIZE], [IntentKind.SUSPEND])


def test_a_running_job_moves_when_its_pool_became_much_dearer() -> None:
    """A 1-GPU job with 10 h of work left runs in west. At $0.21 against $0.20 in east it stays
    (a $0.10 saving is under the $1 margin); when west goes to $0.90 it migrates to east ($7
    saved, restart counted)."""
    east = SPOT_T4
    west = SPOT_T4.model_copy(update={"region": "west", "price_per_gpu_hour": 0.21})
    mover = paced("mover", None, done_h=0.0, total_h=10.0, running_in=west)
    config = SchedulerConfig(min_rescale_interval_s=0)
    stays = planned([mover], [east, west], config)
    assert stays.jobs[mover.id] is mover and not stays.intents  # a small saving: it stays
    got = planned([mover], [east, west.model_copy(update={"price_per_gpu_hour": 0.9})], config)
    (intent,) = got.intents[mover.id]
    assert got.states[mover.id] is JobState.SUSPENDING
    assert (intent.kind, intent.pool) == (IntentKind.MIGRATE, east.id)


# ---- refusal marks (the actuator's, on CapacityError/QuotaError) in every placement path -----

V100_OD = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100,
               market=Market.ON_DEMAND, nodes=1, gpus_per_node=8, price_per_gpu_hour=3.0)


def refused(pool: Pool, why: str, at: float = NOW) -> Blocklist:
    """A blocklist in which the cloud refused a launch in ``pool`` at ``at`` for want of
    ``why``."""
    return mark_refused(Blocklist(), pool.id, at, why)


def test_a_refused_pool_takes_no_launch_at_any_size_and_the_job_says_until_when() -> None:
    """A 4-GPU V100 job (1-4 accepted): its on-demand pool refused a launch (capacity) a minute
    ago; the other pool has room for 2. It takes 2 there (a fallback size), not 4 in the refused
    pool; once the other pool is full it is not launched at all and says which pool refused and
    when it retries (the mark's expiry, 10 minutes after the refusal)."""
    west = V100_OD.model_copy(update={"region": "us-west-2", "nodes": 1, "gpus_per_node": 2})
    pools, marks = [V100_OD, west], refused(V100_OD, "capacity", NOW - 60)
    v100 = {"accelerators": [Accelerator.V100]}
    first = record("first", spec("first").model_copy(update=v100))
    got = planned([first], pools, blocklist=marks)
    assert got.launches == {first.id: (west.id, 2)}
    second = record("second", spec("second").model_copy(update=v100))
    got = planned([got.jobs[first.id], second], pools, blocklist=marks)
    assert second.id not in got.states and not got.intents
    until = time.strftime("%H:%M:%S", time.gmtime(NOW - 60 + 600))
    assert got.reasons[second.id] == (f"pool aws:us-east-1:on-demand:V100 refused the launch "
                                      f"(capacity); retrying after {until} UTC")
    again = planned(list(got.jobs.values()), pools, blocklist=marks)
    assert not again.reasons and not again.intents  # said once


def test_a_deadline_job_behind_pace_does_not_retry_on_demand_in_a_refused_pool() -> None:
    """Spot is full, so a job behind its pace falls back to on-demand; the only on-demand pool
    refused a launch (quota): it is not launched there, and says so."""
    behind = paced("behind", 3.0)
    got = planned([fill(SPOT_T4), behind], [SPOT_T4, OD_T4], blocklist=refused(OD_T4, "quota"))
    assert behind.id not in got.states and not got.intents
    assert got.reasons[behind.id].startswith(  # type: ignore[union-attr]
        f"pool {OD_T4.id} refused the launch (quota); retrying after ")


def test_under_admission_drop_a_job_held_back_by_a_refusal_is_dropped_without_a_note() -> None:
    """Admission drop; the only V100 pool refused a launch: the new job is dropped, in one
    change, with no 'waiting' note (a stale reason) recorded before the drop."""
    job = record("late", spec("late").model_copy(update={"accelerators": [Accelerator.V100]}))
    got = planned([job], [V100_OD], SchedulerConfig(admission=Admission.DROP),
                  blocklist=refused(V100_OD, "capacity"))
    assert got.states == {job.id: JobState.DROPPED}
    assert got.reasons == {job.id: "admission control: no room when it arrived"}
    assert got.events == {job.id: ["dropped"]}


def test_refusal_marks_cover_both_markets_and_lapse() -> None:
    pools = [SPOT_T4, OD_T4]
    marked = Blocklist(refused={OD_T4.id: 100.0, SPOT_T4.id: 100.0},
                       refusal_why={OD_T4.id: "quota"})
    got = refused_pools(pools, marked, now=200.0)
    assert set(got) == {OD_T4.id, SPOT_T4.id}
    assert "(quota)" in got[OD_T4.id] and "refused the launch; retrying after 00:11:40 UTC" in \
        got[SPOT_T4.id]  # no kind recorded (a mark written before kinds were): no brackets
    assert refused_pools(pools, marked, now=100.0 + marked.refusal_decay_s) == {}


# ---- region filters that leave a job no pool --------------------------------------------------


def test_regions_that_exclude_every_pool_are_named_on_the_job_once() -> None:
    """T4 is offered in aws:east and aws:west; a job allowed only gcp:* says so (its lists and
    where T4 is), once, and holds no GPUs; under admission drop it is dropped with that reason.
    A job that accepts V100 or T4 and denies the only V100 region runs on T4."""
    pools = [SPOT_T4, OD_T4, V100_OD.model_copy(update={"region": "east"})]
    lost = record("lost", spec("lost", regions={"allow": ["gcp:*"], "deny": ["aws:west"]}))
    either = record("either", spec("either", accelerators=[Accelerator.V100, Accelerator.T4],
                                   regions={"deny": ["aws:east"]}))
    got = planned([lost, either], pools)
    assert lost.id not in got.states
    assert got.reasons[lost.id] == ("regions allow ['gcp:*'] deny ['aws:west'] leave no T4 "
                                    "pool; T4 is offered in aws:east, aws:west: widen "
                                    "regions.allow or narrow regions.deny")
    assert got.events[lost.id] == ["no-region"]
    assert got.launches[either.id][0] == OD_T4.id  # T4 in aws:west, not V100 in aws:east
    assert lost.id not in planned(list(got.jobs.values()), pools).reasons  # said once
    again = record("again", spec("again", regions={"allow": ["gcp:*"]}))
    dropped = planned([again], pools, SchedulerConfig(admission=Admission.DROP))
    assert dropped.states[again.id] is JobState.DROPPED
    assert dropped.reasons[again.id].startswith("regions allow ['gcp:*']")  # type: ignore[union-attr]


# ---- a measured model's work epoch by epoch, and the on-demand room held for a recovery -----

SPOT_V100 = Pool(cloud="aws", region="east", accelerator=Accelerator.V100, market=Market.SPOT,
                 nodes=2, gpus_per_node=8, price_per_gpu_hour=0.5)
OD_V100 = Pool(cloud="aws", region="west", accelerator=Accelerator.V100,
               market=Market.ON_DEMAND, nodes=1, gpus_per_node=8, price_per_gpu_hour=3.0)


def cifar10(name: str, gpus: int, deadline_s: float | None = None) -> JobSpec:
    """cifar10 as a user names it (``model``: the measured tables are its prior), its whole
    training as work, asking for ``gpus`` V100s of up to 16."""
    app = load_application("cifar10")
    m0 = app.init_batch_size
    return JobSpec(name=name, run="true", accelerators=[Accelerator.V100], model="cifar10",
                   gpus=GpuRange(min=1, max=16, default=gpus),
                   batch_size=BatchRange(min=m0, max=app.spec.max_batch_size),
                   work_samples=math.ceil(app.efficiency.target * m0), deadline_s=deadline_s)


def epoch_seconds(gpus: int, upto: float) -> float:
    """Seconds cifar10 takes on ``gpus`` V100s up to ``upto`` M0-iterations of progress, each
    epoch at its best batch, straight from the tables."""
    app = load_application("cifar10")
    bounds, m0 = app.efficiency.boundaries, app.init_batch_size
    seconds = 0.0
    for e in range(len(bounds) - 1):
        work = min(upto, bounds[e + 1]) - bounds[e]
        if work <= 0:
            break
        best = max(g for b in batch_candidates(m0, app.spec.max_batch_size, gpus)
                   if (g := app.rate(Accelerator.V100, packed_placement(gpus, 8), b, e)[0]) > 0)
        seconds += work / best
    return seconds


def test_work_hours_add_up_a_measured_models_epochs() -> None:
    """A cifar10 job's hours at 4 GPUs are its epochs' hours at their own best batches, a
    fraction of what the first epoch's rate alone would make them; half-way, the hours done
    are those of the epochs behind it. A job without a model counts every sample alike."""
    app, config = load_application("cifar10"), SchedulerConfig()
    job = JobRecord(id="c", spec=cifar10("c", 4), team="t", submitted_at=0.0, updated_at=0.0)
    choice = next(c for c in job_choices(job, Policy.ELASTIC, 16) if c.gpus == 4)
    total, done = work_hours(job, choice, config)
    target = app.efficiency.target
    assert total == pytest.approx(epoch_seconds(4, target) / HOUR, rel=1e-6) and done == 0
    first_rate = samples_per_sec(job, 4, choice.batch_size)
    assert total < 0.5 * job.spec.work_samples / first_rate / HOUR
    half = job.model_copy(update={"samples_done": int(target / 2 * app.init_batch_size)})
    now = next(c for c in job_choices(half, Policy.ELASTIC, 16) if c.gpus == 4)
    total_h, done_h = work_hours(half, now, config)
    assert done_h == pytest.approx(epoch_seconds(4, target / 2) / HOUR, rel=1e-3)
    assert total_h == pytest.approx(total, rel=1e-3)
    plain = job.model_copy(update={"spec": job.spec.model_copy(update={"model": None})})
    rate = samples_per_sec(plain, 4, choice.batch_size)
    assert work_hours(plain, choice, config) == pytest.approx(
        (plain.spec.work_samples / rate / HOUR, 0.0))


def test_a_young_job_whose_epochs_meet_its_deadline_runs_on_spot() -> None:
    """cifar10 at 4 GPUs with a deadline twice its hours epoch by epoch: it runs on spot.
    Counted at its first epoch's rate, its work would overrun the deadline (and did send it
    to on-demand)."""
    config = SchedulerConfig()
    probe = JobRecord(id="p", spec=cifar10("p", 4), team="t", submitted_at=0.0, updated_at=0.0)
    choice = next(c for c in job_choices(probe, Policy.ELASTIC, 16) if c.gpus == 4)
    total, _ = work_hours(probe, choice, config)
    first_rate = samples_per_sec(probe, 4, choice.batch_size)
    assert probe.spec.work_samples / first_rate / HOUR > 2 * total  # the old view: past due
    job = record("young", cifar10("young", 4, deadline_s=2 * total * HOUR))
    got = planned([job], [SPOT_V100, OD_V100], config)
    assert (got.states[job.id], got.launches[job.id][0]) == (JobState.LAUNCHING, SPOT_V100.id)


def test_on_demand_room_is_held_for_one_recovery_at_a_time() -> None:
    """Two cifar10 jobs at 1 GPU, whose slack no longer covers a preemption at that size and
    whose recovery needs 5 GPUs or more: 8 spare on-demand GPUs hold the first's (its view then
    sends it to spot, and the GPUs held leave the spare), not the second's, which stays on the
    plain net (on-demand). A job the plain net covers holds nothing."""
    config = SchedulerConfig()
    spec1 = cifar10("a", 1)
    rec = JobRecord(id="a", spec=spec1, team="t", submitted_at=0.0, updated_at=0.0)
    opts = job_choices(rec, Policy.ELASTIC, 8)
    one = next(c for c in opts if c.gpus == 1)
    alone_h = work_hours(rec, one, config)[0]
    eight_h = work_hours(rec, next(c for c in opts if c.gpus == 8), config)[0]
    assert eight_h < 0.5 * alone_h
    # the deadline: a preemption's net short of what 5 GPUs need, so a recovery takes 5 or more
    five_h = work_hours(rec, next(c for c in opts if c.gpus == 5), config)[0]
    net_h = deadline_job(rec, one, {}, config, now=0.0).net_h
    deadline = (five_h + net_h - 1e-4) * HOUR
    jobs = [JobRecord(id=k, spec=spec1.model_copy(update={"name": k, "deadline_s": deadline}),
                      team="t", submitted_at=0.0, updated_at=0.0) for k in ("a", "b")]
    spare = spare_on_demand(jobs, [SPOT_V100, OD_V100], {})
    assert spare == {OD_V100.id: 8}
    views = []
    for job in jobs:
        plain = deadline_job(job, one, {}, config, now=0.0)
        assert plain.slack_h < 0 and choose_market(plain, True) is Market.ON_DEMAND
        views.append(with_recovery(job, plain, opts, [SPOT_V100, OD_V100], spare, Marks(),
                                   config))
    assert views[0].recover_h is not None and views[0].recover_h < plain.deadline_h
    assert choose_market(views[0], True) is Market.SPOT
    assert views[1].recover_h is None and choose_market(views[1], True) is Market.ON_DEMAND
    assert spare[OD_V100.id] <= 3
    loose = jobs[0].model_copy(update={"spec": jobs[0].spec.model_copy(
        update={"deadline_s": 10 * alone_h * HOUR})})
    left = dict(spare)
    view = deadline_job(loose, one, {}, config, now=0.0)
    assert with_recovery(loose, view, opts, [OD_V100], left, Marks(), config) == view
    assert left == spare


def test_a_job_running_the_runtime_is_resized_in_place_on_its_node(store: Store) -> None:
    """The shrink of the first test, for a job that reported progress (it runs the runtime) in
    a pool that sells any count on one node, at a fixed batch: its node keeps running, the
    attempt stays, and the agent is owed the new size until rank 0 reports it."""
    sched = Scheduler(store, SchedulerConfig(min_rescale_interval_s=0))
    fence, a = _runtime_job_and_three_more(store, sched)
    res = sched.run_round(fence)
    job = store.get_job(a.id)
    assert job is not None and job.state is JobState.RUNNING and job.attempt == 1, job.reason
    assert job.gpus < 4 and job.resized_to == job.gpus and job.rescales == 1
    # its one intent tells the backend the node's new size; no stop, no relaunch
    assert res.resizes == 1 and [(i.kind, i.gpus) for i in store.intents()
                                 if i.job_id == a.id] == [(IntentKind.RESIZE_IN_PLACE, job.gpus)]
    assert "resize-in-place" in [e.type for e in store.events(job_id=a.id)]
    assert resize_owed(job, job.attempt, world_size=4) == job.gpus
    assert resize_owed(job, job.attempt, world_size=job.gpus) is None  # done: nothing owed
    assert resize_owed(job, job.attempt + 1, world_size=4) is None  # another attempt's node



def test_an_in_place_resize_starts_the_config_at_the_rounds_clock(store: Store) -> None:
    """A round on another clock than the wall's (a simulation's) records the resized config's
    start at its own ``now``, so the rescale interval counts from there (a wall-clock start
    kept a simulated job pinned for ever)."""
    config = SchedulerConfig(min_rescale_interval_s=60)
    fence, a = _runtime_job_and_three_more(store, Scheduler(store, config))
    later = time.time() + 86_400.0
    res = plan_round(store.snapshot(), fence, config, now=later)
    assert res.resizes == 1
    store.apply(res.plan, fence=fence)
    job = store.get_job(a.id)
    assert job is not None and job.resized_to == job.gpus < 4 and job.launched_at == later


def _runtime_job_and_three_more(store: Store, sched: Scheduler) -> tuple[int, JobRecord]:
    """A fixed-batch job running the runtime on 4 GPUs of a local pool (it reported progress),
    and three jobs queued beside it: the next round shrinks it in place."""
    store.set_pools(POOLS)
    fence = store.acquire_lease("t", ttl_s=30)
    a = store.submit(spec("a", batch=128), team="t")  # a fixed batch: only the size changes
    sched.run_round(fence)
    run_all(store, fence)
    job = store.get_job(a.id)
    assert job is not None and job.gpus == 4
    store.record_heartbeat(a.id, job.attempt, launch_key=job.launch_key, samples_done=640,
                           world_size=4, global_batch_size=128)
    for n in ("b", "c", "d"):
        store.submit(spec(n), team="t")
    return fence, a
