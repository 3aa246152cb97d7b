"""The container images (infra/docker/), checked without a registry to pull base images from:
each instruction is well formed, everything copied exists, no secret is built in, the broker
runs as a user, and its configuration contract holds: every ``FLEET_*`` variable the image sets
is one ``fleet up`` reads, and ``fleet up`` with exactly that environment (no options) serves and
becomes ready."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "infra" / "docker"
INSTRUCTIONS = {"FROM", "RUN", "COPY", "ENV", "ARG", "USER", "WORKDIR", "VOLUME", "EXPOSE",
                "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL"}
SECRET = re.compile(r"TOKEN|PASSWORD|SECRET|REDIS_URL", re.I)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path.name}: a continued line never ends"
    return out


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in steps:
        if word == "ENV":
            env |= dict(re.findall(r"(\w+)=(\S+)", rest))
    return env


@pytest.mark.parametrize("name", ["broker.Dockerfile", "agent.Dockerfile"])
def test_dockerfile_is_well_formed(name: str) -> None:
    steps = instructions(DOCKER / name)
    assert {w for w, _ in steps} <= INSTRUCTIONS
    assert steps[0][0] in ("FROM", "ARG")
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from="):
            *sources, _ = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: not in the repository"
    assert not [k for k in env_of(steps) if SECRET.search(k)], "a secret built into the image"
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    (entry,) = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    want = ["fleet", "up"] if name.startswith("broker") else \
        ["python", "-m", "broker.runtime.agent"]
    assert entry == want


def test_broker_image_environment_is_what_fleet_up_reads(tmp_path: Path) -> None:
    env = env_of(instructions(DOCKER / "broker.Dockerfile"))
    fleet = {k: v for k, v in env.items() if k.startswith("FLEET_")}
    usage = subprocess.run([sys.executable, "-m", "broker", "up", "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"}).stdout
    read = set(re.findall(r"env var: (FLEET_\w+)", usage))
    assert set(fleet) <= read, f"the image sets variables fleet up ignores: {set(fleet) - read}"
    # fleet up from that environment alone (paths and port moved into the test's folder)
    port = free_port()
    run_env = {**os.environ, **fleet, "FLEET_HOST": "127.0.0.1", "FLEET_PORT": str(port),
               "FLEET_STATE_DIR": str(tmp_path / "state"),
               "FLEET_FILE": str(ROOT / "examples" / "fleets" / "local.yaml"),
               "FLEET_CONFIG": str(tmp_path / "client.yaml")}
    up = subprocess.Popen([sys.executable, "-m", "broker", "up"], cwd=ROOT, env=run_env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None and time.monotonic() < deadline, up.stderr
            time.sleep(0.2)
        assert (tmp_path / "state" / "redis").is_dir()
    finally:
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    for line in filter(None, err.splitlines()):  # FLEET_LOG_FORMAT=json: JSON lines only
        assert json.loads(line)["level"]
