"""The VM start script, run for real by bash: on an image without fleetbroker it pip-installs the
agent (with the image's environment, not the job's) before it runs it, once, and without printing a
URL's credentials; when the agent ends, the exit trap reports a failure and powers the VM off.

``python3`` is a shim on PATH that plays a stock image: ``import broker.runtime.agent`` fails until
``pip install`` ran, and every call is recorded with the environment pip saw. ``apt-get``,
``curl`` and ``shutdown`` are stubs that record their calls in the same list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import broker
from broker.api import Heartbeat
from policies.models import Accelerator, Market
from providers import bootstrap
from providers.base import LaunchRequest

SHIM = """#!/bin/bash
echo "$*|PIP_BREAK_SYSTEM_PACKAGES=${PIP_BREAK_SYSTEM_PACKAGES:-}|PYTHONPATH=${PYTHONPATH:-}\
|PIP_INDEX_URL=${PIP_INDEX_URL:-}" >> "$STATE/calls"
case "$1 $2 $3" in
  "-c import broker.runtime.agent "*) [ -e "$STATE/installed" ] ;;
  "-m pip --version") [ ! -e "$STATE/no-pip" ] ;;
  "-m pip install") [ ! -e "$STATE/pip-fails" ] && touch "$STATE/installed" ;;
  "-m broker.runtime.agent "*)
    echo "agent ran: $*"
    if [ -e "$STATE/agent-runs" ]; then  # until TERM, then exit as the real agent does
      trap 'echo "agent got TERM" >> "$STATE/calls"; exit "$(cat "$STATE/agent-exit")"' TERM
      touch "$STATE/agent-started"
      for _ in $(seq 400); do sleep 0.05; done  # 20 s at most: never left behind
    fi
    exit "$(cat "$STATE/agent-exit" || echo 0)" ;;
  *) exit 3 ;;
esac
"""
# Each stub records its name and arguments; curl also what it read on stdin (the header).
STUBS = {
    "apt-get": 'echo "apt-get $*" >> "$STATE/calls"\n',
    "curl": 'echo "curl $*" >> "$STATE/calls"; cat > "$STATE/curl-stdin"\n'
            '[ -e "$STATE/curl-slow" ] && { touch "$STATE/curl-started"; sleep 1; }; true\n',
    "shutdown": 'echo "shutdown $*" >> "$STATE/calls"\n',
}
TOKEN = "attempt-token-s3cret"
SECRET_WHEEL = "https://deploy:s3cret@pkgs.example.com/fleetbroker-0.1.0-py3-none-any.whl?sig=tok"


def request() -> LaunchRequest:
    return LaunchRequest(
        idempotency_key="job-9:1:0", job_id="job-9", region="us-east-1",
        accelerator=Accelerator.T4, gpus_per_node=1, market=Market.SPOT,
        command=["python", "train.py", "--name", "it's"],
    )  # fmt: skip


def start_script(script: str, tmp_path: Path, **machine_env: str) -> subprocess.Popen:
    """Start ``script`` with bash as user data runs, the shim and stubs first on PATH, plus
    ``machine_env``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"python3": SHIM, **{k: f"#!/bin/bash\n{v}" for k, v in STUBS.items()}
                       }.items():
        stub = bin_dir / name
        stub.write_text(body)
        stub.chmod(0o755)
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "STATE": str(tmp_path), **machine_env}
    return subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, tmp_path: Path,
           ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Wait for a started script; how it ended and the calls the shim and stubs saw."""
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()  # our own child, if the wait timed out
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), calls


def run_script(script: str, tmp_path: Path, **machine_env: str,
               ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``script`` to its end (``start_script``); how it ended and the calls they saw."""
    return finish(start_script(script, tmp_path, **machine_env), tmp_path)


def test_stock_image_installs_the_agent_once_then_runs_it(tmp_path: Path) -> None:
    spec = "fleetbroker==0.1.0"
    script = bootstrap.agent_script(request(), "aws", spec)
    done, calls = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert [c.split("|")[0] for c in calls] == [
        "-c import broker.runtime.agent",
        "-m pip --version",
        f"-m pip install --quiet --disable-pip-version-check {spec}",
        "-m broker.runtime.agent -- python train.py --name it's",
        "shutdown -h now",  # the job ended: the VM must not bill on
    ]
    assert "PIP_BREAK_SYSTEM_PACKAGES=1" in calls[2]  # the image's python, on purpose
    assert "agent ran" in done.stdout and f"installing the agent: {spec}" in done.stderr
    (tmp_path / "calls").unlink()
    again, calls = run_script(script, tmp_path)  # a rerun (or a prepared image) skips pip
    assert again.returncode == 0 and not [c for c in calls if "pip" in c]
    assert calls[-2].startswith("-m broker.runtime.agent --")


def test_a_wheel_url_is_installed_but_its_credentials_are_not_printed(tmp_path: Path) -> None:
    script = bootstrap.agent_script(request(), "gcp", bootstrap.agent_install_spec(SECRET_WHEEL))
    done, calls = run_script(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert any(c.startswith("-m pip install") and SECRET_WHEEL in c for c in calls)
    assert "s3cret" not in done.stdout + done.stderr and "tok" not in done.stderr
    assert "https://****@pkgs.example.com/fleetbroker-0.1.0-py3-none-any.whl?****" in done.stderr


def test_install_source_option_then_env_then_this_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bootstrap.AGENT_INSTALL_ENV, raising=False)
    assert bootstrap.agent_install_spec() == f"fleetbroker=={broker.__version__}"  # this broker
    monkeypatch.setenv(bootstrap.AGENT_INSTALL_ENV, "fleetbroker==0.0.9")
    assert bootstrap.agent_install_spec() == "fleetbroker==0.0.9"
    assert bootstrap.agent_install_spec("/opt/wheels/fb.whl") == "/opt/wheels/fb.whl"
    for bad in ("fleetbroker torch", "--index-url=https://x", " "):
        with pytest.raises(ValueError, match=r"agent_install .*one pip requirement or wheel URL"):
            bootstrap.agent_install_spec(bad)


def reporting(**env: str) -> LaunchRequest:
    """A launch whose agent reports to a broker with its attempt token, plus ``env``."""
    return request().model_copy(update={"env": {
        "FLEET_BROKER_URL": "http://broker.example:8080/", "FLEET_ATTEMPT": "3",
        "FLEET_AGENT_TOKEN": TOKEN, **env}})


def test_the_job_env_is_exported_after_the_install(tmp_path: Path) -> None:
    """A job's PYTHONPATH or PIP_INDEX_URL reaches the agent and the job, never pip."""
    job = reporting(PYTHONPATH="/job/lib", PIP_INDEX_URL="https://mirror.invalid/simple")
    done, calls = run_script(bootstrap.agent_script(job, "aws", "fleetbroker==0.1.0"), tmp_path)
    assert done.returncode == 0, done.stderr
    pip = next(c for c in calls if c.startswith("-m pip install"))
    assert pip.endswith("|PYTHONPATH=|PIP_INDEX_URL=")
    agent = next(c for c in calls if c.startswith("-m broker.runtime.agent"))
    assert agent.endswith("|PYTHONPATH=/job/lib|PIP_INDEX_URL=https://mirror.invalid/simple")


def test_apt_waits_for_the_dpkg_lock(tmp_path: Path) -> None:
    """At boot unattended-upgrades holds the dpkg lock: apt-get waits for it (up to 300 s)."""
    (tmp_path / "no-pip").touch()
    done, calls = run_script(bootstrap.agent_script(request(), "aws", "fleetbroker"), tmp_path)
    assert done.returncode == 0, done.stderr
    apt = [c for c in calls if c.startswith("apt-get")]
    assert apt == ["apt-get -o DPkg::Lock::Timeout=300 update -q",
                   "apt-get -o DPkg::Lock::Timeout=300 install -y -q python3-pip"]


def reported(tmp_path: Path, calls: list[str]) -> Heartbeat:
    """The one heartbeat the trap sent, as the broker's API parses it."""
    (curl,) = [c for c in calls if c.startswith("curl ")]
    assert curl.endswith(" http://broker.example:8080/v1/agent/heartbeat")
    assert TOKEN not in curl  # on stdin only: a command line is visible to every process
    assert (tmp_path / "curl-stdin").read_text() == f"Authorization: Bearer {TOKEN}\n"
    body = curl.split("--data-binary ", 1)[1].rsplit(" http", 1)[0]
    return Heartbeat.model_validate(json.loads(body))


def test_a_failed_agent_is_reported_to_the_broker_then_the_vm_powers_off(
        tmp_path: Path) -> None:
    (tmp_path / "agent-exit").write_text("3")
    done, calls = run_script(bootstrap.agent_script(reporting(), "aws", "fb"), tmp_path)
    assert done.returncode == 3
    names = [c.split()[0] for c in calls]
    assert names[-3:] == ["-m", "curl", "shutdown"]  # the agent, its report, the power-off
    beat = reported(tmp_path, calls)
    assert (beat.job_id, beat.attempt, beat.state, beat.exit_code) == ("job-9", 3, "failed", 3)
    assert TOKEN not in done.stdout + done.stderr


def test_a_failed_install_is_reported_and_the_agent_never_runs(tmp_path: Path) -> None:
    (tmp_path / "pip-fails").touch()
    done, calls = run_script(bootstrap.agent_script(reporting(), "gcp", "fb"), tmp_path)
    assert done.returncode == 1
    assert not [c for c in calls if c.startswith("-m broker.runtime.agent")]
    assert reported(tmp_path, calls).exit_code == 1
    assert calls[-1] == "shutdown -h now"


def test_a_clean_stop_powers_off_without_a_report(tmp_path: Path) -> None:
    """Exit 75 (checkpointed) or 0: the agent's own last heartbeat said how the job ended."""
    (tmp_path / "agent-exit").write_text("75")
    done, calls = run_script(bootstrap.agent_script(reporting(), "azure", "fb"), tmp_path)
    assert done.returncode == 75
    assert not [c for c in calls if c.startswith("curl")] and calls[-1] == "shutdown -h now"


def term_once(tmp_path: Path, when: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a reporting start script, send it TERM once the stub touched ``when``, finish."""
    proc = start_script(bootstrap.agent_script(reporting(), "aws", "fb"), tmp_path)
    started = time.monotonic()
    while not (tmp_path / when).exists():
        assert time.monotonic() - started < 20 and proc.poll() is None, f"never {when}"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    return finish(proc, tmp_path)


@pytest.mark.parametrize(("agent_exit", "report"), [(75, False), (3, True)])
def test_a_term_to_the_script_stops_the_agent_and_the_trap_sees_its_code(
        tmp_path: Path, agent_exit: int, report: bool) -> None:
    """A TERM to the start script (a service stop, a shutdown's final kill) is forwarded to the
    agent, and the script waits for it: the exit trap judges the agent's own code (75, a
    checkpoint: no report), not the status of the script's last command while the agent runs."""
    (tmp_path / "agent-runs").touch()
    (tmp_path / "agent-exit").write_text(str(agent_exit))
    done, calls = term_once(tmp_path, "agent-started")
    assert done.returncode == agent_exit
    names = [c.split()[0] for c in calls]
    expected = ["-m", "agent", *(["curl"] if report else []), "shutdown"]
    assert names[-len(expected):] == expected  # the agent stopped, then the trap ran
    assert calls[-len(expected) + 1] == "agent got TERM"
    if report:
        assert reported(tmp_path, calls).exit_code == agent_exit


def test_a_signal_during_the_exit_trap_cuts_neither_the_report_nor_the_power_off(
        tmp_path: Path) -> None:
    """curl may retry for many seconds; a TERM that lands while the trap reports a failure
    (or powers off) must not end the script before the VM is powered off."""
    (tmp_path / "agent-exit").write_text("3")
    (tmp_path / "curl-slow").touch()
    done, calls = term_once(tmp_path, "curl-started")
    assert done.returncode == 3
    assert [c.split()[0] for c in calls][-2:] == ["curl", "shutdown"]


@pytest.mark.parametrize(("machine", "job", "option", "expected"), [
    ({"FLEET_SHUTDOWN_COMMAND": "echo off-by-override >> $STATE/calls"}, {}, None,
     "off-by-override"),
    ({"FLEET_SHUTDOWN_COMMAND": ""}, {}, None, None),  # empty: the VM stays up
    # the launch request's env: only code sets it (a spec's envs may not start with FLEET_)
    ({}, {"FLEET_SHUTDOWN_COMMAND": ""}, None, None),
    # the provider's shutdown_command option (a fleet file's `options:`) beats the launch's
    ({}, {"FLEET_SHUTDOWN_COMMAND": ""}, "echo off-by-option >> $STATE/calls", "off-by-option"),
    ({}, {}, "", None),
])
def test_the_power_off_command_can_be_overridden_or_disabled(
        tmp_path: Path, machine: dict[str, str], job: dict[str, str], option: str | None,
        expected: str | None) -> None:
    script = bootstrap.agent_script(reporting(**job), "aws", "fb", option)
    done, calls = run_script(script, tmp_path, **machine)
    assert done.returncode == 0, done.stderr
    assert not [c for c in calls if c.startswith("shutdown")]
    assert calls[-1] == expected if expected else calls[-1].startswith("-m broker.runtime.agent")
