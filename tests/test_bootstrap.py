"""The VM start script, run for real by bash: on an image without fleetbroker it pip-installs the
agent before it execs it, once, and without printing a URL's credentials.

``python3`` is a shim on PATH that plays a stock image: ``import broker.runtime.agent`` fails until
``pip install`` ran, and every call is recorded with the environment pip saw.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import broker
from policies.models import Accelerator, Market
from providers import bootstrap
from providers.base import LaunchRequest

SHIM = """#!/bin/bash
echo "$*|PIP_BREAK_SYSTEM_PACKAGES=${PIP_BREAK_SYSTEM_PACKAGES:-}" >> "$STATE/calls"
case "$1 $2" in
  "-c import broker.runtime.agent") [ -e "$STATE/installed" ] ;;
  "-m pip") [ "$3" != install ] || touch "$STATE/installed" ;;
  "-m broker.runtime.agent") echo "agent ran: $*" ;;
  *) exit 3 ;;
esac
"""
SECRET_WHEEL = "https://deploy:s3cret@pkgs.example.com/fleetbroker-0.1.0-py3-none-any.whl?sig=tok"


def request() -> LaunchRequest:
    return LaunchRequest(
        idempotency_key="job-9:1:0", job_id="job-9", region="us-east-1",
        accelerator=Accelerator.T4, gpus_per_node=1, market=Market.SPOT,
        command=["python", "train.py", "--name", "it's"],
    )  # fmt: skip


def run_script(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``script`` with bash as user data runs, the shim first on PATH; the calls it saw."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python3"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "STATE": str(tmp_path)}
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return done, calls


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
    ]
    assert calls[2].endswith("PIP_BREAK_SYSTEM_PACKAGES=1")  # the image's python, on purpose
    assert "agent ran" in done.stdout and f"installing the agent: {spec}" in done.stderr
    (tmp_path / "calls").unlink()
    again, calls = run_script(script, tmp_path)  # a rerun (or a prepared image) skips pip
    assert again.returncode == 0 and not [c for c in calls if "pip" in c]
    assert calls[-1].startswith("-m broker.runtime.agent --")


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
