"""Issue 13, item 8 (and the cloud half of item 2): a failure reason is short, names its cause
and carries no secret and no environment; a cloud start script hands the attempt token to the
agent in a 0600 file, not in its environment."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker import secrets
from broker.auth import attempt_token
from broker.models import JobState
from broker.runtime import failure
from broker.server import Broker, BrokerConfig, build_broker
from policies.models import Accelerator, BatchRange, GpuRange, JobSpec, Market
from providers import bootstrap
from providers.base import LaunchRequest
from tests.redis_server import RedisServer

KEY = "broker-agent-key-0123456789abcdef"
ADMIN = "admin-token-s3cret-0123456789"


def test_a_reason_is_bounded_scrubbed_and_holds_no_environment() -> None:
    secrets.register(ADMIN)
    token = attempt_token(KEY, "job-1", 3)
    env = {f"VAR_{i}": "x" * 50 for i in range(4000)} | {"FLEET_AGENT_TOKEN": token,
                                                          "FLEET_ADMIN_TOKEN": ADMIN}
    huge = f"launch failed: backend said no; request env={env}"
    assert len(huge) > 200_000
    got = secrets.reason(huge)
    assert len(got) <= secrets.MAX_REASON_CHARS
    assert got.startswith("launch failed: backend said no")
    assert token not in got and ADMIN not in got and "VAR_1" not in got
    for leak in (f"Authorization: Bearer {token}", f"token={ADMIN}", f"see {token} here",
                 "redis://u:pw-s3cret@h:6379/0", "AWS_SECRET_ACCESS_KEY=abcd1234"):
        assert "s3cret" not in secrets.reason(leak) and token not in secrets.reason(leak)
        assert "abcd1234" not in secrets.reason(leak)
    assert secrets.reason("checkpoint write failed: no space left on device (ENOSPC)") == \
        "checkpoint write failed: no space left on device (ENOSPC)"


def test_redact_url() -> None:
    assert secrets.redact_url("rediss://fleet:pw@10.0.0.1:6380/0") == \
        "rediss://fleet:****@10.0.0.1:6380/0"
    assert secrets.redact_url("redis://:pw@[::1]:6379") == "redis://:****@[::1]:6379"
    assert secrets.redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_the_runtime_names_an_os_error_behind_a_wrapped_failure(tmp_path: Path) -> None:
    class Wrapper(BaseException):  # torch DCP's CheckpointException keeps rank -> (exc, tb)
        def __init__(self, failures: dict) -> None:
            self.failures = failures

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ck/x")
    wrapped = Wrapper({0: (full, None)})
    try:
        raise RuntimeError("save failed") from wrapped
    except RuntimeError as exc:
        got = failure.describe("checkpoint write failed", exc)
    assert got == "checkpoint write failed: no space left on device (ENOSPC)"
    path = tmp_path / "error"
    failure.report(got, {failure.ERROR_ENV: str(path)})
    failure.report("a later cause", {failure.ERROR_ENV: str(path)})  # the first one wins
    assert failure.read(path) == got and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.fixture
def broker(redis_server: RedisServer, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("regions:\n  - {region: here, price_per_gpu_hour: 1, gpus: 1}\n")
    monkeypatch.setenv("FLEET_ADMIN_TOKEN", ADMIN)
    b = build_broker(BrokerConfig(state_dir=tmp_path / "state", fleet=fleet, tick_s=0.2,
                                  lease_ttl_s=3, agent_token=KEY), redis_url=redis_server.url)
    yield b
    b.stop()


def test_a_launch_failure_is_stored_short_without_the_token_or_the_environment(
        broker: Broker) -> None:
    """The probe's 205,793-character reason: a backend's error that held the launch request
    (its env: the attempt token) and the whole environment."""
    def launch(request: LaunchRequest) -> list:
        raise RuntimeError(f"cannot launch {request!r}; environment: {dict(os.environ)}" * 50)

    broker.provider.local.launch = launch  # type: ignore[union-attr,method-assign]
    store = broker.store
    job = store.submit(JobSpec(name="j", run="true", gpus=GpuRange(min=1, max=1),
                               batch_size=BatchRange(min=8, max=8), work_samples=8), team="t")
    broker.start()
    deadline = time.monotonic() + 30
    while (got := store.get_job(job.id)) is not None and \
            not (got.reason or "").startswith("launch"):
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got is not None and got.state in (JobState.SUSPENDED, JobState.FAILED, JobState.QUEUED)
    reason = got.reason or ""
    assert len(reason) <= secrets.MAX_REASON_CHARS, reason
    assert reason.startswith("launch failed: local launch ")
    token = attempt_token(KEY, job.id, got.attempt)
    assert token not in reason and ADMIN not in reason and KEY not in reason
    assert "PATH" not in reason and "FLEET_" not in reason
    events = " ".join(e.model_dump_json() for e in store.events(job_id=job.id, limit=100))
    assert token not in events and ADMIN not in events


# ---- a cloud start script: the attempt token goes to the agent in a file -----------------------

AGENT = """#!/bin/bash
case "$1 $2" in
  "-c import") exit 0 ;;
  "-m broker.runtime.agent")
    env > "$STATE/agent-env"
    stat -c %a "$FLEET_AGENT_TOKEN_FILE" > "$STATE/token-mode"
    cat "$FLEET_AGENT_TOKEN_FILE" > "$STATE/token"
    rm -f "$FLEET_AGENT_TOKEN_FILE"
    exit 3 ;;
esac
"""


def test_a_start_script_hands_the_token_over_in_a_file(tmp_path: Path) -> None:
    token = attempt_token(KEY, "job-9", 1)
    request = LaunchRequest(
        idempotency_key="job-9:1:1", job_id="job-9", region="r", accelerator=Accelerator.T4,
        gpus_per_node=1, market=Market.ON_DEMAND, command=["sh", "-c", "true"],
        env={"FLEET_AGENT_TOKEN": token, "FLEET_BROKER_URL": "http://127.0.0.1:9/"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"python3": AGENT, "curl": 'cat > "$STATE/curl-stdin"\n',
                       "shutdown": "true\n"}.items():
        (bin_dir / name).write_text(body if body.startswith("#!") else f"#!/bin/bash\n{body}")
        (bin_dir / name).chmod(0o755)
    script = bootstrap.agent_script(request, "aws", "fleetbroker")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STATE": str(tmp_path),
                               "TMPDIR": str(tmp_path)})
    assert done.returncode == 3, done.stderr
    agent_env = (tmp_path / "agent-env").read_text()
    assert token not in agent_env and "FLEET_AGENT_TOKEN=" not in agent_env
    assert (tmp_path / "token").read_text() == token
    assert (tmp_path / "token-mode").read_text().strip() == "600"
    assert not list(tmp_path.glob("fleet-agent-token.*"))  # the agent removed it
    # the exit trap still reports the failure with the token (on curl's stdin)
    assert (tmp_path / "curl-stdin").read_text() == f"Authorization: Bearer {token}\n"
    assert token not in done.stdout + done.stderr
