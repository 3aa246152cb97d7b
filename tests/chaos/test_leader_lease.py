"""The leader's lease is renewed on its own timer: a leader whose passes take longer than the
lease's TTL (a long scheduling round here; API requests in its process alike) keeps the lease
while a second broker waits for it, and still hands over once it stops."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from broker.server import BrokerConfig, build_broker, drain
from broker.spec import parse_spec_text
from tests.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
TTL_S = 1.0
JOBS = 2500  # a first pass over them takes seconds
WATCH_S = 1.0  # and then some passes more
FLEET = """
grace_period_s: 1
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}
"""


@pytest.mark.chaos
def test_a_leader_busy_longer_than_its_lease_keeps_it(tmp_path: Path) -> None:
    """The first pass over many queued jobs reads every record: it outlasts the lease several
    times over, and the lease neither lapses nor goes to the standby."""
    (tmp_path / "fleet.yaml").write_text(FLEET)
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    broker = standby = None
    try:
        broker = build_broker(BrokerConfig(
            state_dir=tmp_path / "busy", redis_url=redis.url, fleet=tmp_path / "fleet.yaml",
            owner="busy", lease_ttl_s=TTL_S, tick_s=0.05, use_agent=False))
        store = broker.store
        spec = parse_spec_text("name: j\nrun: sleep 30\nbatch_size: 1\nwork: {samples: 9}\n").spec
        for _ in range(JOBS):
            store.submit(spec, team="t")
        t0 = time.monotonic()
        broker.start()
        while store.leader() is None:
            time.sleep(0.005)
        fence = store.leader()[0]  # type: ignore[index]
        standby = subprocess.Popen(
            [sys.executable, "-m", "broker.server", "--redis-url", redis.url, "--state-dir",
             str(tmp_path / "standby"), "--fleet", str(tmp_path / "fleet.yaml"), "--lease-ttl",
             str(TTL_S), "--owner", "standby", "--no-agent"], cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        leaders: list[tuple[int, str] | None] = []
        first_pass_s = None
        while first_pass_s is None or time.monotonic() - t0 < first_pass_s + WATCH_S:
            leaders.append(store.leader())
            if first_pass_s is None and broker.rounds:
                first_pass_s = time.monotonic() - t0
            assert time.monotonic() - t0 < 120, "the first pass never ended"
            time.sleep(0.01)
        assert standby.poll() is None  # it was there to take over
        print(f"lease: a first pass of {first_pass_s:.1f} s (TTL {TTL_S} s); the leader held "
              f"its lease in {leaders.count((fence, 'busy'))}/{len(leaders)} samples")
        assert first_pass_s > 2 * TTL_S  # without renewal during it the lease would lapse
        assert set(leaders) == {(fence, "busy")}
        broker.stop()  # a clean stop hands over
        deadline = time.monotonic() + 20
        while (store.leader() or (0, ""))[1] != "standby":
            assert time.monotonic() < deadline, store.leader()
            time.sleep(0.05)
    finally:
        if standby is not None:
            standby.terminate()
            standby.wait(timeout=30)
        if broker is not None:
            broker.stop()
            drain(broker.provider)
        redis.stop()


def test_the_lease_keeper_thread_ends_with_the_loop(tmp_path: Path) -> None:
    """``stop()`` ends the loop and its renewals: no thread keeps the lease of a stopped
    broker."""
    (tmp_path / "fleet.yaml").write_text(FLEET)
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        broker = build_broker(BrokerConfig(
            state_dir=tmp_path, redis_url=redis.url, fleet=tmp_path / "fleet.yaml",
            owner="one", lease_ttl_s=TTL_S, tick_s=0.05, use_agent=False)).start()
        deadline = time.monotonic() + 30
        while broker.rounds < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert "broker-lease" in {t.name for t in threading.enumerate()}
        broker.stop()
        assert "broker-lease" not in {t.name for t in threading.enumerate()}
        assert broker.store.leader() is None
    finally:
        redis.stop()
