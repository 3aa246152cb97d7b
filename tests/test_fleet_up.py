"""``fleet up`` as a user runs it: embedded redis-server with AOF under the state dir, the API,
a job launched with the client CLI runs to completion, Ctrl-C stops everything; without
redis-server on PATH it prints the install hint and exits 2."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from broker.server import BrokerConfig, Stack
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parent.parent
FLEET = """
grace_period_s: 2
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}
"""
SPEC = """
name: hello
run: echo hello from $FLEET_JOB_ID
batch_size: {min: 8, max: 8}
work_samples: 8
"""


def fleet(*args: str, env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]


def test_fleet_up_serves_runs_and_stops(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "hello.yaml").write_text(SPEC)
    env = {**os.environ, "FLEET_CONFIG": str(tmp_path / "client.yaml")}
    env.pop("FLEET_URL", None)
    env.pop("FLEET_TOKEN", None)
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "broker", "up", "--state-dir", str(tmp_path / "state"),
         "--fleet", str(tmp_path / "fleet.yaml"), "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:  # up once the API answers and the client config is written
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200 \
                        and (tmp_path / "client.yaml").exists() \
                        and yaml.safe_load((tmp_path / "client.yaml").read_text()):
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None and time.monotonic() < deadline, up.stdout and up.stdout.read()
            time.sleep(0.2)
        # `fleet up` saved the URL and admin token for the client commands.
        saved = yaml.safe_load((tmp_path / "client.yaml").read_text())
        assert saved["url"] == f"http://127.0.0.1:{port}"
        launched = fleet("launch", str(tmp_path / "hello.yaml"), "--json", env=env)
        assert launched.returncode == 0, launched.stderr
        job_id = yaml.safe_load(launched.stdout)["id"]
        deadline = time.monotonic() + 30
        while True:
            shown = fleet("job", job_id, "--json", env=env)
            if yaml.safe_load(shown.stdout)["job"]["state"] == "completed":
                break
            assert time.monotonic() < deadline, shown.stdout
            time.sleep(0.5)
        logs = fleet("logs", job_id, env=env)
        assert f"hello from {job_id}" in logs.stdout
        assert (tmp_path / "state" / "redis" / "appendonlydir").is_dir()  # AOF on, in state dir
        ui = httpx.get(f"http://127.0.0.1:{port}/", follow_redirects=True, timeout=10)
        assert ui.status_code == 200 and "dash.js" in ui.text  # the dashboard's sign-in way
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "stopping" in out and f"dashboard at http://127.0.0.1:{port}/ui/" in " ".join(
        out.split())  # the console wraps long lines
    # The embedded redis-server is gone with it.
    redis_pids = subprocess.run(["pgrep", "-f", str(tmp_path / "state" / "redis")],
                                capture_output=True, text=True).stdout.split()
    assert redis_pids == []


def test_fleet_up_without_redis_server_gives_the_install_hint(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent),
           "FLEET_CONFIG": str(tmp_path / "client.yaml")}
    got = fleet("up", "--state-dir", str(tmp_path / "state"), "--port", str(free_port()),
                env=env)
    assert got.returncode == 2
    err = " ".join(got.stderr.split())  # the console wraps long lines
    assert "redis-server not found" in err and "apt-get install redis-server" in err
    assert "Traceback" not in got.stderr


def test_fleet_up_warns_once_when_local_jobs_run_as_its_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """FLEET_JOB_USER=root (as a broker that is not root): its jobs can read its state."""
    monkeypatch.setenv("FLEET_JOB_USER", "root")
    stack = Stack(BrokerConfig(state_dir=tmp_path / "state"), port=0)
    with caplog.at_level(logging.WARNING, logger="broker.server"):
        stack.start()
        stack.stop()
    said = [r.getMessage() for r in caplog.records if "broker's own user" in r.getMessage()]
    assert len(said) == 1, said
    assert str(tmp_path / "state") in said[0] and "tokens.json" in said[0]
    assert "run `fleet up` as root" in said[0] and "cloud nodes" in said[0]
