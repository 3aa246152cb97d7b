"""Launching as a user does it (issue 15, item 6), through ``python -m broker`` against a real
``fleet up`` on loopback (embedded redis-server, the API, the local provider's agents):
``--version``, ``launch --dryrun`` with and without a broker, ``launch --follow``, cancelling
several jobs, ``--all`` and a finished one, and ``events --limit``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.redis_server import free_port

REPO = Path(__file__).resolve().parent.parent
FLEET = """
grace_period_s: 2
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 2}
  - {cloud: local, region: cheap, market: spot, price_per_gpu_hour: 0.4, gpus: 2}
"""
HELLO = """
name: hello
run: echo hello from $FLEET_JOB_ID
batch_size: {min: 8, max: 8}
work_samples: 8
"""
SLEEPY = """
name: sleepy
run: sleep 60
batch_size: {min: 8, max: 8}
work_samples: 8
"""
SKY = """
name: sky-hello
resources: {accelerators: T4:1, autostop: 10m, disk_tier: high}
envs: {MODEL: gpt2, STEPS: "10"}
run: echo hi
"""


def fleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=90)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for name, text in (("fleet.yaml", FLEET), ("hello.yaml", HELLO), ("sleepy.yaml", SLEEPY),
                       ("sky.yaml", SKY)):
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture
def env(files: Path) -> dict[str, str]:
    env = {**os.environ, "FLEET_CONFIG": str(files / "client.yaml"), "COLUMNS": "200"}
    env.pop("FLEET_TOKEN", None)
    env["FLEET_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return env


@pytest.fixture
def broker(files: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``fleet up`` on a free port; the client env that reaches it (its saved config)."""
    port = free_port()
    env = {k: v for k, v in env.items() if k != "FLEET_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "broker", "up", "--state-dir", str(files / "state"),
         "--fleet", str(files / "fleet.yaml"), "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200 \
                        and (files / "client.yaml").exists() \
                        and yaml.safe_load((files / "client.yaml").read_text()):
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        yield env
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=60)
    assert up.returncode == 0


def test_version(env: dict[str, str]) -> None:
    from broker import __version__

    got = fleet("--version", env=env)
    assert got.returncode == 0 and got.stdout.strip() == f"fleet {__version__}"


def test_dryrun_works_without_a_broker(files: Path, env: dict[str, str]) -> None:
    got = fleet("launch", "--dryrun", str(files / "sky.yaml"), env=env)
    assert got.returncode == 0, got.stderr
    out = " ".join(got.stdout.split())
    assert "sky-hello (skypilot format): dry run, nothing submitted" in out
    assert "accelerators T4 gpus 1-1 batch 1-1 (fixed)" in out
    assert "env MODEL, STEPS" in out and "gpt2" not in out  # names, never values
    assert "resources.autostop: ignored" in out and "resources.disk_tier: ignored" in out
    assert "placement preview skipped: cannot reach the broker" in out
    got = fleet("launch", "--dryrun", str(files / "sky.yaml"), "--json", env=env)
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["job"]["env_names"] == ["MODEL", "STEPS"] and doc["preview"] is None
    assert doc["job"]["gpus"]["min"] == 1 and doc["job"]["accelerators"] == ["T4"]
    assert any(n.startswith("resources.autostop") for n in doc["job"]["notes"])
    assert "cannot reach the broker" in doc["preview_skipped"]
    # user text is printed as it is, never read as markup
    (files / "brackets.yaml").write_text(HELLO + 'regions: ["aws:us-[ew]*"]\n')
    got = fleet("launch", "--dryrun", str(files / "brackets.yaml"), env=env)
    assert got.returncode == 0 and "regions allow aws:us-[ew]*" in got.stdout


def test_launch_cancel_and_events_against_fleet_up(files: Path, broker: dict[str, str]) -> None:
    env = broker
    # a dry run with a broker: the pools the job may use, cheapest first, with its cost
    got = fleet("launch", "--dryrun", str(files / "sky.yaml"), "--json", env=env)
    assert got.returncode == 0, got.stderr
    pools = json.loads(got.stdout)["preview"]["pools"]
    # no use_spot: SkyPilot's on-demand, so the spot pool is not offered
    assert [(p["pool"], p["cost_per_hour"], p["nodes"], p["fits_now"]) for p in pools] == [
        ("local:here:on-demand:T4", 1.0, 1, True)]
    got = fleet("launch", "--dryrun", str(files / "hello.yaml"), "--json", env=env)
    pools = json.loads(got.stdout)["preview"]["pools"]
    assert [(p["pool"], p["price_per_gpu_hour"], p["cost_per_hour"]) for p in pools] == [
        ("local:cheap:spot:T4", 0.4, 0.4), ("local:here:on-demand:T4", 1.0, 1.0)]
    got = fleet("launch", "--dryrun", str(files / "sky.yaml"), env=env)
    assert "placement preview from http://127.0.0.1" in got.stdout
    assert "local:here:on-demand:T4" in got.stdout
    assert json.loads(fleet("jobs", "--json", env=env).stdout) == []  # nothing submitted

    # the fleet file has no A100: refused at submission, and the dry run says so
    (files / "a100.yaml").write_text(SKY.replace("T4:1", "A100:1"))
    got = fleet("launch", str(files / "a100.yaml"), env=env)
    assert got.returncode == 2, got.stderr
    assert "no pool of this fleet offers A100; it has T4" in " ".join(got.stderr.split())
    got = fleet("launch", "--dryrun", str(files / "a100.yaml"), env=env)
    assert got.returncode == 0 and "never runs: accelerators" in got.stdout
    assert json.loads(fleet("jobs", "--json", env=env).stdout) == []

    # --follow: the log streams until the job ends
    got = fleet("launch", "--follow", str(files / "hello.yaml"), env=env)
    assert got.returncode == 0, got.stderr
    job_id = got.stdout.split()[1]
    assert f"hello from {job_id}" in got.stdout

    # cancelling a finished job says so and exits 1
    got = fleet("cancel", job_id, env=env)
    assert got.returncode == 1 and f"{job_id}: already completed; nothing to cancel" in \
        " ".join(got.stderr.split())

    # several ids at once, then --all
    ids = [json.loads(fleet("launch", str(files / "sleepy.yaml"), "--json", env=env).stdout)["id"]
           for _ in range(3)]
    got = fleet("cancel", ids[0], ids[1], env=env)
    assert got.returncode == 0, got.stderr
    assert {line.split(":")[0] for line in got.stdout.splitlines()} == {ids[0], ids[1]}
    got = fleet("cancel", "--all", env=env)
    assert got.returncode == 0 and ids[2] in got.stdout and ids[0] not in got.stdout
    deadline = time.monotonic() + 30
    while True:
        states = {j["id"]: j["state"] for j in json.loads(fleet("jobs", "--json",
                                                               env=env).stdout)}
        if all(states[i] == "cancelled" for i in ids):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    assert fleet("cancel", env=env).returncode == 2  # neither ids nor --all

    # --limit N: the last N events
    every = fleet("events", env=env).stdout.splitlines()
    last = fleet("events", "--limit", "2", env=env).stdout.splitlines()
    assert len(every) > 2 and last == every[-2:]
