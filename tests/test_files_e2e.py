"""End to end: a SkyPilot task's ``workdir`` and ``file_mounts`` reach every node through the
real CLI, API, broker and agent on local nodes: the workdir packed at launch (.gitignore
honoured), kept by the broker, unpacked on each node before setup (setup and run start in it);
a local file and S3 objects (a moto server on loopback) copied; a MOUNT the node cannot honour
fails the job with the missing tool named (redis, uvicorn, moto)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from moto.server import ThreadedMotoServer

from broker.files import MAX_BLOB_BYTES, PackError, pack
from broker.models import JobRecord, JobState
from broker.runtime.agent import free_port
from broker.runtime.files import unpack
from broker.server import Broker
from broker.store import Store
from tests.builders import fleet
from tests.live_broker import TEAM_TOKEN, live_broker
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 5
regions:
  - {region: home, price_per_gpu_hour: 0.5, gpus: 2, nodes: 2}
"""
TASK = """
name: files-demo
resources:
  accelerators: T4:1
num_nodes: 2
workdir: {workdir}
file_mounts:
  ~/cfg/config.yaml: {config}
  ~/data: s3://bucket/data
  ~/one.txt: s3://bucket/single.txt
envs:
  OUT: {out}
  AWS_ENDPOINT_URL: {endpoint}
  AWS_DEFAULT_REGION: us-east-1
  AWS_ACCESS_KEY_ID: test
secrets:
  AWS_SECRET_ACCESS_KEY: null
setup: |
  cat train.sh > "$OUT/setup-$SKYPILOT_SETUP_NODE_RANK"
run: |
  r=$SKYPILOT_NODE_RANK
  ls -a | sort > "$OUT/ls-$r"
  cat "$FLEET_FILES_ROOT/cfg/config.yaml" "$FLEET_FILES_ROOT/data/a.txt" \\
      "$FLEET_FILES_ROOT/data/sub/b.txt" "$FLEET_FILES_ROOT/one.txt" > "$OUT/files-$r"
"""
MOUNTED = """
name: mount-demo
resources:
  accelerators: T4:1
file_mounts:
  /mnt/never-made:
    source: s3://bucket/data
    mode: MOUNT
run: echo ran
"""


@pytest.fixture
def s3() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket="bucket")
    for key, body in (("data/a.txt", "A\n"), ("data/sub/b.txt", "B\n"),
                      ("single.txt", "ONE\n"), ("data-other/c.txt", "not under data/\n")):
        client.put_object(Bucket="bucket", Key=key, Body=body.encode())
    yield url
    server.stop()


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch) as running:
        yield running


def finished(store: Store, job_id: str, timeout: float = 90) -> JobRecord:
    deadline = time.monotonic() + timeout
    while (job := store.get_job(job_id)) is None or not job.state.terminal:
        assert time.monotonic() < deadline, f"not finished: {job}"
        time.sleep(0.3)
    return job


def project(root: Path) -> Path:
    """A git work tree whose .gitignore leaves out the logs."""
    root.mkdir()
    (root / "train.sh").write_text("echo training\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "model.py").write_text("W = 1\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / "run.log").write_text("local noise\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_pack_honours_gitignore_and_round_trips(tmp_path: Path) -> None:
    src = project(tmp_path / "proj")
    out = tmp_path / "out"
    unpack(pack(src), out)
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert got == [".gitignore", "pkg/model.py", "train.sh"]
    one = tmp_path / "cfg.yaml"
    one.write_text("lr: 1\n")
    unpack(pack(one), tmp_path / "placed" / "c.yaml")
    assert (tmp_path / "placed" / "c.yaml").read_text() == "lr: 1\n"
    with pytest.raises(PackError, match="does not exist"):
        pack(tmp_path / "missing")
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:  # random bytes do not compress
        f.write(os.urandom(MAX_BLOB_BYTES + 1))
    with pytest.raises(PackError, match="over the"):
        pack(big)


@pytest.mark.slow
def test_workdir_and_file_mounts_reach_every_node(
        broker: Broker, store: Store, tmp_path: Path, s3: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text("CONFIG\n")
    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(workdir=project(tmp_path / "proj"), config=config, out=out,
                                endpoint=s3))
    env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
           "FLEET_CONFIG": str(tmp_path / "c.yaml"), "AWS_SECRET_ACCESS_KEY": "test"}
    code, stdout, stderr = fleet(env, "launch", str(task), "--secret", "AWS_SECRET_ACCESS_KEY",
                                 "--json")
    assert code == 0, stderr
    spec = json.loads(stdout)["spec"]
    assert spec["workdir"].startswith("blob:sha256:")
    assert [m["source"][:12] for m in spec["file_mounts"]] == ["blob:sha256:", "s3://bucket/",
                                                              "s3://bucket/"]
    job = finished(store, json.loads(stdout)["id"])
    logs = "\n".join(store.read_logs(job.id, limit=100_000)[0])
    assert job.state is JobState.COMPLETED, logs[-3000:]
    for rank in (0, 1):  # every node: its own copy, setup and run in the workdir
        assert (out / f"setup-{rank}").read_text() == "echo training\n"
        assert (out / f"ls-{rank}").read_text().split() == [
            ".", "..", ".gitignore", "pkg", "train.sh"]
        assert (out / f"files-{rank}").read_text() == "CONFIG\nA\nB\nONE\n"
    # the broker's pack of the workdir is served to the job's own agent only
    digest = spec["workdir"].removeprefix("blob:sha256:")
    with httpx.Client(base_url=broker.config.broker_url or "") as c:
        r = c.get(f"/v1/agent/blobs/{digest}", params={"job_id": job.id, "attempt": 1},
                  headers={"Authorization": f"Bearer {TEAM_TOKEN}"})
        assert r.status_code == 403


@pytest.mark.slow
def test_a_mount_without_its_fuse_tool_fails_with_the_tool_named(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    task = tmp_path / "mount.yaml"
    task.write_text(MOUNTED)
    env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
           "FLEET_CONFIG": str(tmp_path / "c.yaml")}
    code, stdout, stderr = fleet(env, "launch", str(task), "--json")
    assert code == 0, stderr
    job = finished(store, json.loads(stdout)["id"], timeout=120)
    assert job.state is JobState.FAILED
    assert "goofys" in (job.reason or "") and "mode: COPY" in (job.reason or ""), job.reason
    assert not Path("/mnt/never-made").exists()


def test_the_api_refuses_a_local_path_it_cannot_read(broker: Broker, tmp_path: Path) -> None:
    body = ("name: x\nrun: ls\nworkdir: /home/me/proj\nfile_mounts: {/d: ./data.csv}\n"
            "resources: {accelerators: T4:1}\n")
    with httpx.Client(base_url=broker.config.broker_url or "",
                      headers={"Authorization": f"Bearer {TEAM_TOKEN}"}) as c:
        r = c.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 422
        fields = [p["field"] for p in r.json()["error"]["problems"]]
        assert fields == ["workdir", "file_mounts./d"]
        assert "fleet launch" in r.json()["error"]["problems"][0]["message"]
        r = c.post("/v1/blobs", content=b"not gzip", headers={"Content-Type": "application/gzip"})
        assert r.status_code == 422


MOVING_FLEET = """
grace_period_s: 5
regions:
  - {cloud: aws, region: east, market: spot, price_per_gpu_hour: 0.3, gpus: 1}
  - {cloud: gcp, region: west, market: spot, price_per_gpu_hour: 0.4, gpus: 1}
"""
MOVER = """
name: mover
resources:
  accelerators: T4:1
  use_spot: true
workdir: {workdir}
envs:
  OUT: {out}
run: |
  echo "$SKYPILOT_TASK_ID $(cat train.sh)" >> "$OUT/runs"
  if [ ! -e "$OUT/moved" ]; then touch "$OUT/moved"; echo ready; sleep 120; fi
"""


@pytest.mark.slow
def test_the_workdir_is_unpacked_again_after_a_move(
        redis_server: RedisServer, store: Store, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    task = tmp_path / "mover.yaml"
    task.write_text(MOVER.format(workdir=project(tmp_path / "proj"), out=out))
    with live_broker(redis_server.url, store, tmp_path, MOVING_FLEET, monkeypatch) as broker:
        env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
               "FLEET_CONFIG": str(tmp_path / "c.yaml")}
        code, stdout, stderr = fleet(env, "launch", str(task), "--json")
        assert code == 0, stderr
        job_id = json.loads(stdout)["id"]
        deadline = time.monotonic() + 60
        while not any(line.endswith("ready") for line in store.read_logs(job_id)[0]):
            assert time.monotonic() < deadline, store.get_job(job_id)
            time.sleep(0.2)
        first = store.get_job(job_id)
        assert first is not None and first.pool is not None
        store.request_preempt(first.pool.split(":")[1], duration_s=60)
        done = finished(store, job_id)
    assert done.state is JobState.COMPLETED and done.migrations == 1, done
    assert done.pool != first.pool
    # the second node, in another region, had the workdir unpacked before run: same task id
    runs = (out / "runs").read_text().splitlines()
    assert len(runs) == 2 and len(set(runs)) == 1 and runs[0].endswith(" echo training"), runs
