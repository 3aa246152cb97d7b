"""End to end: a plain script (no runtime, no framework integration) under the agent, with a
real broker, API and CLI: ``fleet launch`` says at once that a move restarts a job from the
beginning unless it reports progress through the runtime or commits its own DCP checkpoints,
the agent finds that the script reports none, the broker records the job as restarting from the
beginning, and ``fleet job`` says so; a plain script that commits its own DCP checkpoints
(``examples/train_dcp.py``) is recorded with its newest one and shown as losing only the work
since it (redis, uvicorn)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.models import JobState
from broker.protocol import Env
from broker.server import Broker
from broker.store import Store
from tests.builders import fleet
from tests.live_broker import TEAM_TOKEN, live_broker
from tests.redis_server import RedisServer

# The agent decides after one second of the script (FLEET_PROGRESS_GRACE, from the broker's
# environment) instead of two minutes.
FLEET = f"""
grace_period_s: 5
regions:
  - {{region: home, price_per_gpu_hour: 0.5, gpus: 1}}
pass_env: [{Env.PROGRESS_GRACE}]
"""
# A training loop of its own: it never tells anyone its progress.
JOB = """
name: plain-loop
run: python -c "import time; [time.sleep(0.1) for _ in range(1200)]"
accelerators: [T4]
gpus: {min: 1, max: 1}
batch_size: {min: 32, max: 32}
work: {samples: 1000}
"""

# Plain FSDP2 on one gloo worker, saving with dcp.save under FLEET_CHECKPOINT_URI (its default
# --checkpoint-dir) every 50 steps until it is cancelled.
DCP_JOB = """
name: plain-dcp
run: python examples/train_dcp.py --steps 1000000 --checkpoint-every-steps 50
accelerators: [T4]
gpus: {min: 1, max: 1}
batch_size: {min: 12, max: 12}
work: {samples: 1000}
"""


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    monkeypatch.setenv(Env.PROGRESS_GRACE, "1")
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch) as running:
        yield running


@pytest.mark.slow
def test_a_plain_script_is_recorded_and_shown_as_restarting_from_the_beginning(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    spec = tmp_path / "plain.yaml"
    spec.write_text(JOB)
    env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
           "FLEET_CONFIG": str(tmp_path / "c.yaml")}
    code, out, err = fleet(env, "launch", "--dryrun", str(spec))
    assert code == 0, err
    assert "restarts the job from the beginning unless it reports progress through the " \
           "runtime" in " ".join(out.split())
    code, out, err = fleet(env, "launch", str(spec))
    assert code == 0, err
    said = " ".join(out.split())
    assert "submitted" in said and "restarts the job from the beginning unless" in said
    job_id = said.split("submitted ", 1)[1].split()[0]
    deadline = time.monotonic() + 90
    while (job := store.get_job(job_id)) is None or job.resumable is None:
        assert time.monotonic() < deadline, f"no verdict: {job}"
        assert not job or not job.state.terminal, job
        time.sleep(0.3)
    assert job.resumable is False and job.state is JobState.RUNNING
    code, out, _ = fleet(env, "job", job_id)
    assert code == 0
    assert "restarts from the beginning: a move, resize or preemption restarts this " \
           "plain script from step 0" in " ".join(out.split())
    code, out, _ = fleet(env, "job", job_id, "--json")
    assert json.loads(out)["job"]["resumable"] is False
    assert fleet(env, "cancel", job_id)[0] == 0
    while not (job := store.get_job(job_id)) or not job.state.terminal:  # type: ignore[union-attr]
        assert time.monotonic() < deadline + 60, job
        time.sleep(0.3)


@pytest.mark.slow
def test_a_plain_dcp_script_is_recorded_and_shown_as_losing_the_work_since_its_checkpoint(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    spec = tmp_path / "dcp.yaml"
    spec.write_text(DCP_JOB)
    env = {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
           "FLEET_CONFIG": str(tmp_path / "c.yaml")}
    code, out, err = fleet(env, "launch", str(spec))
    assert code == 0, err
    said = " ".join(out.split())
    assert "or commits its own torch.distributed.checkpoint checkpoints under " \
           f"{Env.CHECKPOINT_URI}" in said
    job_id = said.split("submitted ", 1)[1].split()[0]
    deadline = time.monotonic() + 120
    while (job := store.get_job(job_id)) is None or job.checkpoint_at is None:
        assert time.monotonic() < deadline, f"no checkpoint reported: {job}"
        assert not job or not job.state.terminal, job
        time.sleep(0.3)
    assert job.resumable is True and job.state is JobState.RUNNING
    assert job.checkpoint_step is not None and job.checkpoint_step % 50 == 0
    assert job.checkpoint_bytes and job.checkpoint_at <= time.time()
    code, out, _ = fleet(env, "job", job_id)
    assert code == 0
    said = " ".join(out.split())
    assert "resumable from its own checkpoints" in said and \
           "the work since that checkpoint is lost" in said, said
    assert fleet(env, "cancel", job_id)[0] == 0
    while not (job := store.get_job(job_id)) or not job.state.terminal:  # type: ignore[union-attr]
        assert time.monotonic() < deadline + 60, job
        time.sleep(0.3)
