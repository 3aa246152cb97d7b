"""The Redis store against a real redis-server: atomic submit, transitions with expected-state
checks, the fenced leader lease, the intents outbox, events, logs and heartbeats."""

from __future__ import annotations

import json
import logging
import math
import threading
import time

import pytest
import redis

from broker.models import Intent, IntentKind, JobRecord, JobState, Placement, check_transition
from broker.protocol import CHECKPOINT_EXIT, CONTINUE
from broker.store import Conflict, Plan, StaleFence, Store, _decode_job, _doc
from policies.models import Accelerator, Market, Pool
from tests.builders import spec
from tests.redis_server import RedisServer


def test_submit_is_readable_and_listed(store: Store) -> None:
    a = store.submit(spec("a"), team="vision")
    b = store.submit(spec("b"), team="nlp")
    assert a.id != b.id and a.state is JobState.QUEUED and a.version == 1
    assert store.get_job(a.id) == a
    assert [j.id for j in store.list_jobs()] == [a.id, b.id]
    assert [j.id for j in store.list_jobs(team="nlp")] == [b.id]
    assert [j.id for j in store.list_jobs(states=["queued"])] == [a.id, b.id]
    assert store.list_jobs(states=[JobState.RUNNING]) == []
    assert store.get_job("nope-1") is None
    assert [e.type for e in store.events(job_id=a.id)] == ["submitted"]


def test_submit_with_request_key_is_idempotent(store: Store) -> None:
    first = store.submit(spec(), team="t", request_key="abc")
    again = store.submit(spec(), team="t", request_key="abc")
    assert first.id == again.id and len(store.list_jobs()) == 1


def test_concurrent_submissions_get_unique_ids(redis_server: RedisServer) -> None:
    store = Store.from_url(redis_server.url)
    ids: list[str] = []

    def worker() -> None:
        own = Store.from_url(redis_server.url)
        ids.extend(own.submit(spec(), team="t").id for _ in range(25))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 100 and len(store.list_jobs()) == 100


def test_transition_checks_expected_version_and_legality(store: Store) -> None:
    job = store.submit(spec(), team="t")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, gpus=2, attempt=1)
    store.apply(plan)
    moved = store.get_job(job.id)
    assert moved is not None and moved.state is JobState.LAUNCHING and moved.gpus == 2
    assert moved.version == job.version + 1
    stale = Plan()
    stale.change(job, JobState.CANCELLED)  # written against the old version
    with pytest.raises(Conflict):
        store.apply(stale)
    assert store.get_job(job.id).state is JobState.LAUNCHING  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="illegal job transition queued -> running"):
        check_transition(JobState.QUEUED, JobState.RUNNING)
    assert [j.id for j in store.list_jobs(states=["launching"])] == [job.id]
    assert store.list_jobs(states=["queued"]) == []


def test_plan_is_all_or_nothing(store: Store) -> None:
    a = store.submit(spec("a"), team="t")
    b = store.submit(spec("b"), team="t")
    store.request_cancel(b.id)
    plan = Plan()
    plan.change(a, JobState.LAUNCHING)
    plan.change(b, JobState.LAUNCHING)  # b moved on: the whole plan must be refused
    with pytest.raises(Conflict):
        store.apply(plan)
    assert store.get_job(a.id).state is JobState.QUEUED  # type: ignore[union-attr]


def test_non_finite_node_hours_are_skipped_and_the_rest_applies(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    a = store.submit(spec("a"), team="t")
    plan = Plan()
    plan.change(a, JobState.LAUNCHING)
    plan.count_preemption("p1")
    with caplog.at_level(logging.WARNING, logger="broker.store"):
        for hours in (math.inf, math.nan, 2.0):
            plan.add_node_hours("p1", hours)
    assert "non-finite node-hours" in caplog.text
    store.apply(plan)
    assert store.get_job(a.id).state is JobState.LAUNCHING  # type: ignore[union-attr]
    stats = store.pool_stats()
    assert stats.node_hours == {"p1": 2.0} and stats.preemptions == {"p1": 1}


@pytest.mark.parametrize("by", ["inf", "-inf", "nan", "lots"])
def test_a_non_finite_increment_refuses_the_whole_plan(store: Store, by: str) -> None:
    """Redis refuses such an increment only when it runs, after the plan's other writes: the
    script checks it first, so nothing is half-applied."""
    a = store.submit(spec("a"), team="t")
    plan = Plan()
    plan.change(a, JobState.LAUNCHING)
    plan.count_preemption("p1")
    plan.incr.append({"key": "pool:node_hours", "field": "p1", "by": by})
    with pytest.raises(redis.ResponseError, match=f"BADPLAN pool:node_hours p1: increment {by} "):
        store.apply(plan)
    assert store.get_job(a.id).state is JobState.QUEUED  # type: ignore[union-attr]
    assert store.pool_stats().preemptions == {}


def test_lease_fencing_refuses_a_stale_leader(store: Store) -> None:
    f1 = store.acquire_lease("one", ttl_s=0.2)
    assert f1 > 0
    assert store.acquire_lease("two", ttl_s=5) == 0
    assert store.acquire_lease("one", ttl_s=0.2) == f1  # renewal keeps the fence
    job = store.submit(spec(), team="t")
    store.r.delete(store.p + "leader")  # lease lapses
    f2 = store.acquire_lease("two", ttl_s=5)
    assert f2 > f1 and store.leader() == (f2, "two")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING)
    with pytest.raises(StaleFence):
        store.apply(plan, fence=f1)
    store.apply(plan, fence=f2)
    store.release_lease(f1)  # not the holder: no effect
    assert store.leader() == (f2, "two")
    store.release_lease(f2)
    assert store.leader() is None


def test_intents_outbox_written_with_the_plan(store: Store) -> None:
    job = store.submit(spec(), team="t")
    fence = store.acquire_lease("me", ttl_s=5)
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=fence, attempt=1, gpus=2,
                    batch_size=64, pool="local:r1:spot:T4")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1, launch_key=intent.key)
    plan.add_intent(intent)
    store.apply(plan, fence=fence)
    snap = store.snapshot()
    assert snap.intents == [intent] and intent.key == f"{job.id}:{fence}:1"
    assert [j.id for j in snap.jobs] == [job.id]
    done = Plan(intents_del=[intent.id])
    store.apply(done, fence=fence)
    assert store.intents() == []


def test_cancel_of_queued_job_is_immediate_and_of_running_job_is_a_request(store: Store) -> None:
    a = store.submit(spec("a"), team="t")
    assert store.request_cancel(a.id).state is JobState.CANCELLED
    b = store.submit(spec("b"), team="t")
    plan = Plan()
    plan.change(b, JobState.LAUNCHING, attempt=1)
    store.apply(plan)
    got = store.request_cancel(b.id)
    assert got.state is JobState.LAUNCHING and got.cancel_requested
    assert store.request_cancel(a.id).state is JobState.CANCELLED  # repeat: no change


def test_heartbeat_progress_and_actions(store: Store) -> None:
    job = store.submit(spec(), team="t")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1)
    store.apply(plan)
    assert store.record_heartbeat(job.id, 1, samples_done=500, samples_per_sec=40.0,
                                  world_size=2, global_batch_size=64).action == CONTINUE
    got = store.get_job(job.id)
    assert got is not None and got.samples_done == 500 and got.measured_gpus == 2
    assert got.version == job.version + 1  # progress is telemetry: it does not bump the version
    assert store.record_heartbeat(job.id, 0, samples_done=1).action == CHECKPOINT_EXIT  # stale
    assert store.get_job(job.id).samples_done == 500  # type: ignore[union-attr]
    store.request_cancel(job.id)
    assert store.record_heartbeat(job.id, 1, samples_done=600).action == CHECKPOINT_EXIT


def test_a_checkpoints_commit_time_is_kept_with_its_step(store: Store) -> None:
    """A script's own checkpoint comes with its age (the agent's clock): the record keeps when
    it was committed, on the broker's clock, beside its step; a later report of a checkpoint
    without an age (the runtime's) leaves no stale commit time behind."""
    job = store.submit(spec(), team="t")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1)
    store.apply(plan)
    before = time.time()
    store.record_heartbeat(job.id, 1, checkpoint_step=5, checkpoint_bytes=900,
                           checkpoint_age_seconds=30.0, resumable=True)
    got = store.get_job(job.id)
    assert got is not None and (got.checkpoint_step, got.checkpoint_bytes) == (5, 900)
    assert got.checkpoint_at is not None and \
        before - 30.0 <= got.checkpoint_at <= time.time() - 30.0
    store.record_heartbeat(job.id, 1, samples_done=10)  # no checkpoint news: it stays
    assert store.get_job(job.id).checkpoint_at == got.checkpoint_at  # type: ignore[union-attr]
    store.record_heartbeat(job.id, 1, checkpoint_step=10, checkpoint_bytes=1000)
    assert store.get_job(job.id).checkpoint_at is None  # type: ignore[union-attr]


def test_events_since_and_limit(store: Store) -> None:
    ids = [store.submit(spec(), team="t").id for _ in range(5)]
    first = store.events(limit=2)
    assert [e.job_id for e in first] == ids[:2]
    rest = store.events(since=first[-1].id)
    assert [e.job_id for e in rest] == ids[2:]
    assert store.last_event_id() == rest[-1].id


def test_logs_append_read_and_trim(store: Store) -> None:
    store.append_log("j-1", [f"line {i}" for i in range(5)])
    lines, nxt = store.read_logs("j-1", 0, limit=3)
    assert lines == ["line 0", "line 1", "line 2"] and nxt == 3
    lines, nxt = store.read_logs("j-1", nxt)
    assert lines == ["line 3", "line 4"] and nxt == 5
    store.LOG_CAP = 4
    store.append_log("j-1", ["line 5", "line 6"])
    lines, nxt = store.read_logs("j-1", 0)
    assert lines == ["line 3", "line 4", "line 5", "line 6"] and nxt == 7


def test_pools_and_placements(store: Store) -> None:
    pool = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.T4,
                market=Market.SPOT, nodes=1, gpus_per_node=4, price_per_gpu_hour=0.2)
    store.set_pools([pool])
    assert store.pools() == [pool]
    job = store.submit(spec(), team="t")
    pl = Placement(job_id=job.id, attempt=1, start=100.0, pool=pool.id, cloud="aws",
                   region="us-east-1", market=Market.SPOT, gpus=2, price_per_gpu_hour=0.2)
    plan = Plan()
    plan.open_placement(pl)
    store.apply(plan)
    closed = pl.model_copy(update={"end": 100.0 + 3600})
    plan = Plan()
    plan.close_placement(closed)
    store.apply(plan)
    (got,) = store.placements(job.id)
    assert got.gpu_hours == pytest.approx(2.0) and got.cost == pytest.approx(0.4)


def test_acknowledged_submissions_survive_redis_kill(redis_server: RedisServer) -> None:
    store = Store.from_url(redis_server.url)
    acked = [store.submit(spec(), team="t").id for _ in range(200)]
    redis_server.restart(kill=True)  # kill -9, then reload the AOF
    store = Store.from_url(redis_server.url)
    assert {j.id for j in store.list_jobs()} == set(acked)


def test_a_record_reads_back_with_its_progress_over_its_doc() -> None:
    rec = JobRecord(id="a-1", spec=spec("a"), team="t", submitted_at=1.0, updated_at=1.0,
                    samples_done=5, reason="placed")
    got = _decode_job(_doc(rec), "running", "7", '"placed"', [
        "samples_done", "42", "m:T4/2/64", "12.5", "grad_noise_scale", "2.5", "resumable", "true",
        "resize_in_place", "false", "even_batch", "true", "exit:1:0:0", "0"])
    assert got == rec.model_copy(update={
        "state": JobState.RUNNING, "version": 7, "samples_done": 42,
        "measured": {"T4/2/64": 12.5}, "grad_noise_scale": 2.5, "resumable": True,
        "resize_in_place": False, "even_batch": True})
    nan = _decode_job(_doc(rec), "running", "7", None, ["samples_per_sec", "NaN"])
    assert nan.reason is None  # a record without the field: no reason
    # A record written when its reason was part of its doc reads back with it; one whose
    # reason field was written since reads the field's.
    old_doc = rec.model_dump_json(exclude={"state", "version", "measured"})
    assert _decode_job(old_doc, "running", "7", None).reason == "placed"
    assert _decode_job(old_doc, "running", "7", '"waiting"').reason == "waiting"
    assert nan.samples_per_sec is not None and math.isnan(nan.samples_per_sec)


def test_records_of_the_previous_release_and_for_it_read_whole(store: Store) -> None:
    """The upgrade path of a job's reason, which the previous release kept in the doc: a
    record it wrote reads with that reason and is scheduled, and the doc this release writes
    still parses alone (what the previous release reads: the reason left at its default)."""
    from broker.scheduler import Scheduler, SchedulerConfig

    pool = Pool(cloud="aws", region="east", accelerator=Accelerator.T4, market=Market.SPOT,
                nodes=1, gpus_per_node=4, price_per_gpu_hour=0.2)
    job = store.submit(spec("old", gpus=(1, 4), batch=(32, 512), samples=1000), team="t")
    key = f"{store.p}job:{job.id}"
    doc = json.loads(store.r.hget(key, "doc"))
    store.r.hset(key, "doc", json.dumps({**doc, "reason": "waiting for capacity"}))
    assert not store.r.hexists(key, "reason")
    old = store.get_job(job.id)
    assert old is not None and old.reason == "waiting for capacity" and old.spec == job.spec
    store.set_pools([pool])
    fence = store.acquire_lease("t", ttl_s=30)
    assert Scheduler(store, SchedulerConfig()).run_round(fence).launches == 1
    now = store.get_job(job.id)
    assert now is not None and now.state is JobState.LAUNCHING and now.reason == "placed"
    assert now.spec == job.spec and now.pool == pool.id
    alone = JobRecord.model_validate_json(store.r.hget(key, "doc"))
    assert alone.reason is None and alone.model_copy(update={
        "reason": now.reason, "state": now.state, "version": now.version}) == now
