"""Broker ``kill -9`` at points Redis itself announces: keyspace notifications tell the test the
moment a submission lands, the scheduler writes a launch or a resize intent to the outbox, or the
broker records a job's preemption after a spot reclaim (its migration), and the broker dies
right then, before or while it acts on it. A fresh broker takes
over each time; every job completes, none runs twice at once, and no node is spawned twice for
one attempt."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import Store
from policies.models import BatchRange, GpuRange, JobSpec, SpotPolicy
from tests.chaos.conftest import Tally, duplicate_launches
from tests.redis_server import RedisServer
from tests.test_crash_safety import (
    FLEET,
    JOB,
    BrokerProc,
    all_terminal,
    check_invariants,
    stop_nodes,
    wait_for,
)

KILLS = 4
POINTS = {"submit": (), "launch": ("launch",), "rescale": ("resize", "resize-in-place"),
          "reclaim": ()}


class KillAt:
    """Kills and restarts ``broker`` on the first ``KILLS`` keyspace events that match
    ``point``: ``submit`` (a job record created), ``reclaim`` (a job record written while
    ``armed``, once each), else an intent of one of its ``POINTS`` kinds in the outbox (each
    intent once)."""

    def __init__(self, store: Store, broker: BrokerProc, point: str) -> None:
        self.store, self.broker, self.point = store, broker, point
        self.kills = 0
        self.armed = 0
        self.seen: set[str] = set()
        self.done = threading.Event()
        self.pubsub = store.r.pubsub(ignore_subscribe_messages=True)
        if point == "submit":
            self.pubsub.psubscribe(f"__keyspace@0__:{store.p}job:*")
        else:
            self.pubsub.subscribe(f"__keyspace@0__:{store.p}outbox")
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _matches(self, message: dict) -> bool:
        if message["data"] != "hset":
            return False
        if self.point == "reclaim":
            fresh = self.armed > 0
            self.armed -= fresh
            return fresh
        if self.point == "submit":
            key = message["channel"].split(":", 1)[1]
            fresh = key not in self.seen
            self.seen.add(key)
            return fresh
        fresh = False
        for intent_id, raw in self.store.r.hgetall(f"{self.store.p}outbox").items():
            if intent_id not in self.seen and json.loads(raw).get("kind") in POINTS[self.point]:
                self.seen.add(intent_id)
                fresh = True
        return fresh

    def _watch(self) -> None:
        while not self.done.is_set() and self.kills < KILLS:
            message = self.pubsub.get_message(timeout=0.2)
            if message is not None and self._matches(message):
                self.broker.kill9()
                self.kills += 1
                self.broker.start()  # must wait for the dead one's lease to lapse
        self.done.set()

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.pubsub.close()


def on_spot(store: Store, marks: Path) -> list[str]:
    """The spot pools of running jobs that have set their stop trap."""
    started = (marks / "keys").read_text().split() if (marks / "keys").exists() else []
    return [j.pool for j in store.list_jobs(states=["running"])
            if j.pool and ":spot:" in j.pool and any(k.startswith(f"{j.id}:") for k in started)]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that publishes keyspace events of hash commands."""
    server = RedisServer(tmp_path / "redis", config=["notify-keyspace-events Kh"]).start()
    yield server
    server.stop()


@pytest.mark.parametrize("point", list(POINTS))
def test_kill9_at_the_moment_redis_announces(point: str, redis_server: RedisServer,
                                            tmp_path: Path, chaos: Tally,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``rescale`` the jobs take 1-2 GPUs, run 3 s, and a running job may be resized at
    once (no minimum interval): a lone job takes two GPUs and gives one back to the next
    wave. Under ``reclaim`` three jobs run 3 s on spot where they can, one's region is reclaimed
    under them, and the broker dies at the next two job records it writes."""
    fleet, marks, state = tmp_path / "fleet.yaml", tmp_path / "marks", tmp_path / "state"
    fleet.write_text(FLEET)
    marks.mkdir()
    gpus, run, waves, spot = GpuRange(min=1, max=1), JOB, (3, 3, 3, 3), SpotPolicy.ALLOWED
    if point == "rescale":
        monkeypatch.setenv("FLEET_SCHEDULER__MIN_RESCALE_INTERVAL_S", "0")
        gpus, run, waves = GpuRange(min=1, max=2), JOB.replace("-lt 8", "-lt 30"), (1, 5) * 3
    if point == "reclaim":
        run, waves, spot = JOB.replace("-lt 8", "-lt 30"), (3,), SpotPolicy.PREFERRED
    store = Store.from_url(redis_server.url)
    broker = BrokerProc(redis_server.url, state, fleet, "a").start()
    wait_for(lambda: store.leader() is not None, timeout=20)
    killer = KillAt(store, broker, point)
    try:
        ids: list[str] = []
        for wave, n in enumerate(waves):  # so submissions and launches meet a live broker
            ids += [store.submit(JobSpec(name=f"w{wave}-{i}", run=run, gpus=gpus, spot=spot,
                                         envs={"MARKS": str(marks)}, work_samples=10,
                                         batch_size=BatchRange(min=512, max=512)),
                                 team="t").id for i in range(n)]
            if point == "reclaim":
                # a job on spot whose stop trap is set (its launch key is logged)
                wait_for(lambda: bool(on_spot(store, marks)), timeout=30)
                region = on_spot(store, marks)[0].split(":")[1]
                killer.armed = 2  # at the preemption's record, then amid the move
                store.request_preempt(region, duration_s=5)
                wait_for(lambda: all_terminal(store), timeout=60)
            elif point != "rescale":
                wait_for(lambda: killer.kills >= 1 or all_terminal(store), timeout=30)
            elif n == 1:  # the lone job runs on two GPUs before the next wave arrives
                wait_for(lambda: any(j.gpus == 2 for j in store.list_jobs(states=["running"])),
                         timeout=30)
            else:  # and the next lone job finds every GPU free
                wait_for(lambda: all_terminal(store), timeout=60)
        wait_for(lambda: all_terminal(store), timeout=120)
    finally:
        killer.close()
        broker.kill9()
        stop_nodes(state)
    chaos.record(faults=killer.kills,
                 jobs_lost=sum(j.state.value != "completed" for j in store.list_jobs())
                 + len(set(ids) - {j.id for j in store.list_jobs()}),
                 duplicate_launches=duplicate_launches(state))
    # a reclaim's move may be done by the broker the first kill started: one kill is its due
    wanted = 1 if point == "reclaim" else 2
    assert killer.kills >= wanted, f"only {killer.kills} kills at {point}"
    check_invariants(store, ids, marks, state)
    if point == "reclaim":  # the kills met a preemption and its move
        assert any(j.preemptions for j in store.list_jobs())
