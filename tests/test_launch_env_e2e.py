"""End to end: ``fleet launch --env K=V --secret K`` and a SkyPilot task's ``envs`` and
``secrets`` reach the job's environment on a local node through the real CLI, API, broker and
agent; a secret's value is never in Redis in clear, never in ``fleet job`` or the API, never in
the job's log; a value left null is refused at launch with the fix named (redis, uvicorn)."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.models import JobRecord
from broker.sealed import KEY_FILE
from broker.server import Broker
from broker.store import Store
from tests.builders import fleet
from tests.live_broker import TEAM_TOKEN, live_broker
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 5
regions:
  - {region: home, price_per_gpu_hour: 0.5, gpus: 1}
"""
SECRET = "hf_live-secret-value-8c1f0e2d9a"
TASK = """
name: secrets-demo
resources:
  accelerators: T4:1
envs:
  MODEL: gpt2
  HF_TOKEN:
secrets:
  WANDB_API_KEY: null
run: |
  printf '%s|%s|%s|%s' "$MODEL" "$HF_TOKEN" "$WANDB_API_KEY" "$EXTRA" > "{out}"
"""


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch) as running:
        yield running


def everything_in(store: Store) -> str:
    """Every key and value Redis holds, as text."""
    out = []
    for key in store.r.scan_iter(count=1000):
        kind = store.r.type(key)
        value: object = {"string": store.r.get, "hash": store.r.hgetall,
                         "list": lambda k: store.r.lrange(k, 0, -1),
                         "set": store.r.smembers, "zset": lambda k: store.r.zrange(k, 0, -1),
                         "stream": lambda k: store.r.xrange(k)}[kind](key)
        out.append(f"{key} {value}")
    return "\n".join(out)


def test_null_env_is_refused_at_launch_with_the_fix(tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(out=tmp_path / "out"))
    env = {"FLEET_URL": "http://127.0.0.1:9", "FLEET_CONFIG": str(tmp_path / "c.yaml")}
    code, _, err = fleet(env, "launch", str(task))
    assert code == 2
    assert "HF_TOKEN has no value: pass --env HF_TOKEN=... or --secret HF_TOKEN" in err
    assert "WANDB_API_KEY has no value: pass --secret WANDB_API_KEY" in err
    code, _, err = fleet(env, "launch", str(task), "--env", "HF_TOKEN=x", "--secret",
                         "WANDB_API_KEY")
    assert code == 2 and "WANDB_API_KEY is not set in your environment" in err
    code, _, err = fleet(env, "launch", str(task), "--env", "HF_TOKEN")
    assert code == 2 and "write NAME=VALUE" in err


@pytest.mark.slow
def test_envs_and_secrets_reach_the_job_and_nowhere_else(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    out = tmp_path / "seen"
    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(out=out))
    env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
           "FLEET_CONFIG": str(tmp_path / "c.yaml"), "HF_TOKEN": SECRET,
           "WANDB_API_KEY": SECRET[::-1]}
    code, stdout, stderr = fleet(env, "launch", str(task), "--env", "MODEL=llama",
                                 "--env", "EXTRA=1", "--secret", "HF_TOKEN",
                                 "--secret", "WANDB_API_KEY", "--json")
    assert code == 0, stderr
    job_id = json.loads(stdout)["id"]
    assert SECRET not in stdout + stderr and SECRET[::-1] not in stdout + stderr
    deadline = time.monotonic() + 60
    while (job := store.get_job(job_id)) is None or not job.state.terminal:
        assert time.monotonic() < deadline, f"not finished: {job}"
        time.sleep(0.3)
    assert isinstance(job, JobRecord) and job.state.value == "completed", job
    # the job saw every value: the launch's --env wins over the task's envs
    assert out.read_text() == f"llama|{SECRET}|{SECRET[::-1]}|1"
    # names only, everywhere a user or Redis looks
    code, shown, _ = fleet(env, "job", job_id, "--json")
    spec = json.loads(shown)["job"]["spec"]
    assert spec["secret_envs"] == ["WANDB_API_KEY", "HF_TOKEN"]
    assert spec["envs"] == {"MODEL": "llama", "EXTRA": "1"}
    assert "sealed_secrets" not in json.loads(shown)["job"]
    code, plain, _ = fleet(env, "job", job_id)
    assert code == 0 and "secrets WANDB_API_KEY, HF_TOKEN" in plain
    logs = "\n".join(store.read_logs(job_id, limit=100_000)[0])
    redis_text = everything_in(store)
    for seen in (shown, plain, logs, redis_text):
        assert SECRET not in seen and SECRET[::-1] not in seen
    assert job.sealed_secrets and job_id in redis_text  # sealed, yet there
    key = Path(broker.config.state_dir) / KEY_FILE
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
