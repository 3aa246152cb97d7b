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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.models import JobRecord, JobState
from broker.protocol import Env
from broker.server import Broker
from broker.store import Store
from tests.builders import fleet
from tests.live_broker import cli_env, launch, live_broker
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


def wait_until(store: Store, job_id: str, ready: Callable[[JobRecord], bool],
               timeout: float) -> JobRecord:
    """The job once ``ready`` holds, while it has not ended."""
    deadline = time.monotonic() + timeout
    while (job := store.get_job(job_id)) is None or not ready(job):
        assert time.monotonic() < deadline, f"not reached: {job}"
        assert not job or not job.state.terminal, job
        time.sleep(0.3)
    return job


def cancel(env: dict[str, str], store: Store, job_id: str) -> None:
    assert fleet(env, "cancel", job_id)[0] == 0
    deadline = time.monotonic() + 60
    while not (job := store.get_job(job_id)) or not job.state.terminal:
        assert time.monotonic() < deadline, job
        time.sleep(0.3)


@pytest.mark.slow
def test_a_plain_script_is_recorded_and_shown_as_restarting_from_the_beginning(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    spec = tmp_path / "plain.yaml"
    spec.write_text(JOB)
    env = cli_env(broker, tmp_path)
    code, out, err = fleet(env, "launch", "--dryrun", str(spec))
    assert code == 0, err
    assert "restarts the job from the beginning unless it reports progress through the " \
           "runtime" in " ".join(out.split())
    job_id, said = launch(env, spec)
    assert "submitted" in said and "restarts the job from the beginning unless" in said
    job = wait_until(store, job_id, lambda j: j.resumable is not None, timeout=90)
    assert job.resumable is False and job.state is JobState.RUNNING
    code, out, _ = fleet(env, "job", job_id)
    assert code == 0
    assert "restarts from the beginning: a move, resize or preemption restarts this " \
           "plain script from step 0" in " ".join(out.split())
    code, out, _ = fleet(env, "job", job_id, "--json")
    assert json.loads(out)["job"]["resumable"] is False
    cancel(env, store, job_id)


@pytest.mark.slow
def test_a_plain_dcp_script_is_recorded_and_shown_as_losing_the_work_since_its_checkpoint(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    spec = tmp_path / "dcp.yaml"
    spec.write_text(DCP_JOB)
    env = cli_env(broker, tmp_path)
    job_id, said = launch(env, spec)
    assert "or commits its own torch.distributed.checkpoint checkpoints under " \
           f"{Env.CHECKPOINT_URI}" in said
    job = wait_until(store, job_id, lambda j: j.checkpoint_at is not None, timeout=120)
    assert job.resumable is True and job.state is JobState.RUNNING
    assert job.checkpoint_step is not None and job.checkpoint_step % 50 == 0
    assert job.checkpoint_bytes and job.checkpoint_at <= time.time()
    code, out, _ = fleet(env, "job", job_id)
    assert code == 0
    said = " ".join(out.split())
    assert "resumable from its own checkpoints" in said and \
           "the work since that checkpoint is lost" in said, said
    cancel(env, store, job_id)
