"""Structured logs: ``fleet up --log-format json`` writes one JSON object per line to stderr
with no secret in it (a real broker over a real redis-server), and the scrub filter masks
secrets in messages, their arguments and tracebacks in both formats."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker import logs, secrets
from broker.store import Store
from tests.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parent.parent
FLEET = """
grace_period_s: 2
regions:
  - {cloud: local, region: here, market: spot, price_per_gpu_hour: 0.5, gpus: 1}
"""
ADMIN = "log-test-admin-token-0123456789"


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_fleet_up_json_logs_carry_no_secret(tmp_path: Path, redis_server: RedisServer) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    port = free_port()
    env = {**os.environ, "FLEET_CONFIG": str(tmp_path / "client.yaml"),
           "FLEET_ADMIN_TOKEN": ADMIN, "FLEET_REDIS_URL": redis_server.url,
           "FLEET_LOG_FORMAT": "json"}
    up = subprocess.Popen(
        [sys.executable, "-m", "broker", "up", "--state-dir", str(tmp_path / "state"),
         "--fleet", str(tmp_path / "fleet.yaml"), "--port", str(port), "--log-level", "info"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # ready: Redis answers and the leader lease is held
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        # an operator command the leader refuses and logs, naming a region that holds a secret
        Store.from_url(redis_server.url).request_command(
            "preempt", region=f"nowhere-{ADMIN}", duration_s=1)
        time.sleep(3)
    finally:
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    lines = [json.loads(x) for x in err.splitlines() if x.strip()]
    assert lines, "nothing was logged"
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    refused = [x for x in lines if "chaos preempt refused" in x["message"]]
    assert refused and refused[0]["level"] == "WARNING" and refused[0]["logger"] == "broker.server"
    assert secrets.MASK in refused[0]["message"]
    assert ADMIN not in err and ADMIN not in out
    password = redis_server.url.split("@")[0].rsplit(":", 1)[-1]
    assert password and password not in err


@pytest.mark.parametrize("fmt", list(logs.LogFormat))
def test_scrub_in_messages_arguments_and_tracebacks(
        fmt: logs.LogFormat, capsys: pytest.CaptureFixture[str], root_logging: None) -> None:
    secret = "registered-secret-value-0123456789"
    secrets.register(secret)
    logs.configure(fmt, "info")
    log = logging.getLogger("broker.test")
    log.info("connecting with %s", secret)
    try:
        raise RuntimeError(f"redis://user:{secret}@host:6379 refused Bearer abcdefabcdef")
    except RuntimeError:
        log.exception("a failed pass")
    err = capsys.readouterr().err
    assert secret not in err and "abcdefabcdef" not in err
    assert err.count(secrets.MASK) >= 3
    if fmt is logs.LogFormat.JSON:
        first, second = (json.loads(x) for x in err.splitlines() if x.startswith("{"))
        assert first["message"] == f"connecting with {secrets.MASK}"
        assert second["level"] == "ERROR" and "RuntimeError" in second["exc_info"]
    else:
        assert "INFO broker.test: connecting with ****" in err
        assert "Traceback" in err


def test_a_bad_log_format_names_the_choices(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "broker", "up", "--log-format", "xml",
                        "--state-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'xml' is not one of" in r.stderr and "json" in r.stderr
