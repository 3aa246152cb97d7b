"""End to end through the API: ``fleet launch`` -> broker -> local provider -> agent heartbeats
over HTTP -> completion, and ``fleet cancel`` of a running job (real PyTorch, redis, uvicorn)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.api import build_app
from broker.auth import ApiConfig, Role
from broker.cli import app
from broker.models import JobRecord, JobState
from broker.server import BrokerConfig, build_broker
from broker.store import Store
from tests.api_server import ApiServer
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
TEAM_TOKEN = "e2e-team-token-0123456789"
AGENT_TOKEN = "e2e-agent-token-0123456789"
SPEC = """
name: {name}
run: python examples/train_digits.py --steps {steps} --batch-size 32 --batch-mode elastic
gpus: 1
batch_size: {{min: 32, max: 32}}
work: {{steps: {steps}}}
checkpoint: {{interval: 5steps}}
"""


@pytest.fixture
def env(redis_server: RedisServer, store: Store, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    # Jobs run `python ...`: the interpreter running the tests (with torch), importing this
    # checkout's packages (the examples use broker.runtime).
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = (ApiConfig().with_token(TEAM_TOKEN, Role.TEAM, "ml")
              .with_token(AGENT_TOKEN, Role.AGENT).with_attempt_key(AGENT_TOKEN))
    server = ApiServer(build_app(store, config)).start()
    broker = build_broker(BrokerConfig(
        state_dir=tmp_path / "state", redis_url=redis_server.url, broker_url=server.url,
        agent_token=AGENT_TOKEN, tick_s=0.5)).start()
    try:
        yield {"FLEET_URL": server.url, "FLEET_TOKEN": TEAM_TOKEN,
               "FLEET_CONFIG": str(tmp_path / "client.yaml")}
    finally:
        broker.stop()
        for node in broker.provider.nodes():  # leave no job process behind
            broker.provider.terminate(node.node_id)
        server.stop()


def fleet(env: dict[str, str], *args: str) -> str:
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.stdout


def wait_for(store: Store, job_id: str, done: Callable[[JobRecord], bool],
             timeout: float = 150) -> JobRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get_job(job_id)
        assert job is not None
        if done(job):
            return job
        time.sleep(0.5)
    raise AssertionError(f"{job_id} stuck in {store.get_job(job_id)}")


@pytest.mark.slow
def test_launch_runs_to_completion_and_cancel_stops_a_running_job(
        env: dict[str, str], store: Store, tmp_path: Path) -> None:
    short, long = tmp_path / "short.yaml", tmp_path / "long.yaml"
    short.write_text(SPEC.format(name="short", steps=12))
    long.write_text(SPEC.format(name="long", steps=100_000))
    short_id = json.loads(fleet(env, "launch", str(short), "--json"))["id"]
    long_id = json.loads(fleet(env, "launch", str(long), "--json"))["id"]

    running = wait_for(store, long_id, lambda j: j.samples_done > 0 or j.state.terminal)
    assert running.state is JobState.RUNNING, running
    assert "cancel requested" in fleet(env, "cancel", long_id)

    done = wait_for(store, short_id, lambda j: j.state.terminal)
    assert done.state is JobState.COMPLETED, done
    assert done.samples_done == done.spec.work_samples == 12 * 32
    shown = json.loads(fleet(env, "job", short_id, "--json"))
    assert shown["placements"] and shown["cost"] > 0
    assert "finished" in fleet(env, "logs", short_id)

    stopped = wait_for(store, long_id, lambda j: j.state.terminal)
    assert stopped.state is JobState.CANCELLED, stopped
    assert stopped.samples_done < stopped.spec.work_samples
