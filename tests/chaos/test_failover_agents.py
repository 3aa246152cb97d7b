"""Failover with agents running: two real broker replicas (API and leader loop each, ``kill -9``
able) on one real redis-server, a running job launched by the leader; the leader dies. The
job's agent reports to the other replica within the lease timeout plus one heartbeat, and the
job is recorded completed with the progress and checkpoint step it really reached."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.models import JobState
from broker.store import Store
from policies.models import BatchRange, JobSpec
from tests.chaos.conftest import Tally, duplicate_launches
from tests.chaos.replica import HEARTBEAT_S, LEASE_TTL_S, Replica
from tests.redis_server import RedisServer, free_port

FLEET = """
grace_period_s: 3
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}
"""
STEPS, BATCH, CHECKPOINT_EVERY = 2000, 128, 500
# A training loop without torch: 2,000 steps of 128 samples in about 16 s, progress written as
# the runtime's trainer writes it (atomically), a checkpoint every 500 steps and at the end.
WORKER = f"""
import json, os, time
path = os.environ["FLEET_PROGRESS_FILE"]
for step in range(1, {STEPS} + 1):
    time.sleep(0.008)
    ckpt = step if step == {STEPS} else step // {CHECKPOINT_EVERY} * {CHECKPOINT_EVERY}
    with open(path + ".tmp", "w") as f:
        json.dump({{"step": step, "samples_done": step * {BATCH}, "samples_per_sec": 16000.0,
                   "world_size": 1, "global_batch_size": {BATCH},
                   "checkpoint_step": ckpt or None}}, f)
    os.replace(path + ".tmp", path)
"""
TOKENS = {"admin": "failover-admin-token-0123456789", "agent": "failover-agent-token-0123456789"}


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


@pytest.fixture
def replicas(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    state = tmp_path / "state"
    a, b = (Replica(redis_server.url, state, fleet, free_port(), owner, TOKENS)
            for owner in ("a", "b"))
    try:
        yield a, b
    finally:
        a.kill9()
        b.kill9()
        for pid_file in (state / "provider" / "nodes").glob("*/pid.json"):
            pid = json.loads(pid_file.read_text())["pid"]
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.chaos
def test_agents_report_to_the_other_replica_after_the_leader_dies(
        redis_server: RedisServer, replicas: tuple[Replica, Replica], chaos: Tally,
        tmp_path: Path) -> None:
    a, b = replicas
    store = Store.from_url(redis_server.url)
    a.start()
    wait_for(lambda: (store.leader() or (0, ""))[1] == "a", 20, "replica a leads")
    b.start()
    wait_for(lambda: len(store.r.hgetall("fb:brokers")) == 2, 10, "both replicas announced")
    job_id = store.submit(JobSpec(name="train", run=f"{sys.executable} -c '{WORKER}'",
                                  batch_size=BatchRange(min=BATCH, max=BATCH),
                                  work_samples=STEPS * BATCH), team="ml").id
    progress = f"fb:progress:{job_id}"
    wait_for(lambda: int(store.r.hget(progress, "samples_done") or 0) >= 200 * BATCH, 40,
             "the job runs and reports")
    job = store.get_job(job_id)
    assert job is not None and job.state is JobState.RUNNING and job.fence == store.leader()[0]
    a.kill9()  # the leader that launched the job, and the API its agent reported to
    chaos.record(faults=1)
    killed = time.time()
    wait_for(lambda: float(store.r.hget(progress, "heartbeat_at") or 0) > killed, 10,
             "a heartbeat after the kill")
    resumed = float(store.r.hget(progress, "heartbeat_at")) - killed
    assert resumed <= LEASE_TTL_S + HEARTBEAT_S, resumed
    wait_for(lambda: (store.leader() or (0, ""))[1] == "b", 10, "replica b takes over")
    done = wait_for(lambda: (j := store.get_job(job_id)) is not None and j.state.terminal and j,
                    60, "the job settles")
    chaos.record(jobs_lost=int(done.state is not JobState.COMPLETED),
                 duplicate_launches=duplicate_launches(tmp_path / "state"))
    assert done.state is JobState.COMPLETED, (done.state, done.reason)
    assert (done.samples_done, done.checkpoint_step) == (STEPS * BATCH, STEPS), done
    assert done.reason == "finished"
    print(f"\nheartbeats resumed {resumed:.2f} s after the leader's kill -9 (bound: lease "
          f"{LEASE_TTL_S:g} s + heartbeat {HEARTBEAT_S:g} s)")


@pytest.mark.chaos
def test_an_agent_learns_a_replica_started_after_its_launch(
        redis_server: RedisServer, replicas: tuple[Replica, Replica], chaos: Tally,
        tmp_path: Path) -> None:
    """The job is launched while only replica a runs, so its FLEET_BROKER_URL names a alone;
    b starts later. The heartbeat replies carry every live replica's URL, so when a dies the
    agent reports to b."""
    a, b = replicas
    store = Store.from_url(redis_server.url)
    a.start()
    wait_for(lambda: (store.leader() or (0, ""))[1] == "a", 20, "replica a leads")
    job_id = store.submit(JobSpec(name="train", run=f"{sys.executable} -c '{WORKER}'",
                                  batch_size=BatchRange(min=BATCH, max=BATCH),
                                  work_samples=STEPS * BATCH), team="ml").id
    progress = f"fb:progress:{job_id}"
    wait_for(lambda: int(store.r.hget(progress, "samples_done") or 0) >= 100 * BATCH, 40,
             "the job runs and reports")
    b.start()
    announced = wait_for(lambda: len(store.r.hgetall("fb:brokers")) == 2 and time.time(), 10,
                         "both replicas announced")
    wait_for(lambda: float(store.r.hget(progress, "heartbeat_at") or 0) > announced, 10,
             "a heartbeat answered after b's announcement")
    a.kill9()
    chaos.record(faults=1)
    killed = time.time()
    wait_for(lambda: float(store.r.hget(progress, "heartbeat_at") or 0) > killed, 10,
             "a heartbeat after the kill")
    resumed = float(store.r.hget(progress, "heartbeat_at")) - killed
    assert resumed <= LEASE_TTL_S + HEARTBEAT_S, resumed
    done = wait_for(lambda: (j := store.get_job(job_id)) is not None and j.state.terminal and j,
                    60, "the job settles")
    chaos.record(jobs_lost=int(done.state is not JobState.COMPLETED),
                 duplicate_launches=duplicate_launches(tmp_path / "state"))
    assert done.state is JobState.COMPLETED, (done.state, done.reason)
    assert (done.samples_done, done.checkpoint_step) == (STEPS * BATCH, STEPS), done
    print(f"\nheartbeats resumed at the replica started after the launch {resumed:.2f} s after "
          "the leader's kill -9")
