"""Checkpoint stores (local, S3 on a moto server, fsspec) and atomic commits with DCP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from broker.runtime.checkpoint import Checkpointer
from broker.runtime.checkpoint_stores import (
    FsspecStore,
    LocalStore,
    S3Store,
    open_store,
    step_dir_name,
)
from tests.runtime.jobs import ROOT


def state(value: float, n: int = 16) -> dict:
    return {"model": {"w": torch.full((n,), value)}, "optim": {"m": torch.arange(n) * value}}


def save(ck: Checkpointer, step: int, value: float, asynchronous: bool = True) -> None:
    ck.save(step, state(value), {"step": step}, {"world_size": 1}, asynchronous=asynchronous)


def roundtrip(ck: Checkpointer) -> None:
    save(ck, 1, 1.0)
    save(ck, 2, 2.0)  # waits for step 1, then writes step 2 in the background
    ck.wait()
    assert ck.store.steps() == ([1, 2], [])
    target = state(0.0)
    manifest, shared = ck.load(ck.latest(), target)  # type: ignore[arg-type]
    assert manifest["step"] == 2 and shared == {"step": 2}
    assert torch.equal(target["model"]["w"], torch.full((16,), 2.0))
    assert torch.equal(target["optim"]["m"], torch.arange(16) * 2.0)
    for step in (3, 4):
        save(ck, step, float(step), asynchronous=False)
    assert ck.store.steps() == ([2, 3, 4], [])  # keep=3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket="ckpt")
    yield client
    server.stop()


def test_local_store_roundtrip(tmp_path: Path) -> None:
    roundtrip(Checkpointer(open_store(f"file://{tmp_path}"), keep=3))


def test_s3_store_roundtrip_and_dead_writes_are_ignored(s3: object, tmp_path: Path) -> None:
    store = S3Store("s3://ckpt/jobs/a", cache_dir=tmp_path, client=s3)
    roundtrip(Checkpointer(store, keep=3))
    store.publish(9, [Path(__file__)])  # files of a write that never committed
    assert store.steps() == ([2, 3, 4], [9]) and store.latest() == 4
    save(Checkpointer(store, keep=3), 10, 10.0, asynchronous=False)
    assert store.steps() == ([3, 4, 10], [])


def test_open_store_picks_s3_and_honours_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = open_store("s3://bucket/prefix/")
    assert isinstance(store, S3Store) and (store.bucket, store.prefix) == ("bucket", "prefix")
    assert store.client.meta.endpoint_url == "http://127.0.0.1:9"


def test_fsspec_store_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CHECKPOINT_CACHE", str(tmp_path))
    store = open_store("memory://fleet-test/job")
    assert isinstance(store, FsspecStore)
    roundtrip(Checkpointer(store, keep=3))
    with pytest.raises(ValueError, match="install its package"):
        open_store("nosuchproto://x/y")


WRITER = """
import sys, torch
from broker.runtime.checkpoint import Checkpointer
from broker.runtime.checkpoint_stores import LocalStore
ck = Checkpointer(LocalStore(sys.argv[1]))
ck.save(1, {"w": torch.full((4,), 1.0)}, {"step": 1}, {"world_size": 1}, asynchronous=False)
print("committed", flush=True)
big = {"w": torch.full((64_000_000,), 2.0)}
ck.save(2, big, {"step": 2}, {"world_size": 1}, asynchronous=False)
"""


def test_a_checkpoint_killed_half_way_is_ignored(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "committed"
    dead = tmp_path / step_dir_name(2)
    deadline = time.monotonic() + 60
    while not any(f.stat().st_size > 0 for f in dead.glob("*.distcp")):
        assert proc.poll() is None and time.monotonic() < deadline, "the write never started"
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    assert not (dead / "MANIFEST.json").exists()
    store = LocalStore(tmp_path)
    assert store.steps() == ([1], [2])
    ck = Checkpointer(store)
    target = {"w": torch.zeros(4)}
    assert ck.latest() == 1
    ck.load(1, target)
    assert torch.equal(target["w"], torch.ones(4))
    ck.save(3, {"w": torch.full((4,), 3.0)}, {"step": 3}, {"world_size": 1}, asynchronous=False)
    assert store.steps() == ([1, 3], [])  # the dead write is cleaned up after the next commit
