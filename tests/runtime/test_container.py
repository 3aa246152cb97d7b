"""A job's container image (``JobSpec.container_image``): the agent runs its per-node process in
it through the ``docker`` CLI (broker.runtime.container).

The argv builder is tested directly: argv lists (no shell), the environment by name only (a
secret's value is in no argument), the GPUs flag only on a node with GPUs. The refusal path runs
the real agent against this machine's real ``docker`` (no daemon here: ``docker info`` fails)
and against a PATH with no docker at all: the task must not run on the host.

The end-to-end tests put a small executable ``docker`` SHIM first on PATH, because no Docker
daemon is available here. The shim runs no container: it records its argv, starts the command
after the image on the host with only the variables passed by name (``-e NAME``), in a session
of its own (as ``--sig-proxy=false`` keeps a real container out of the client's signals), and
carries out ``stop``/``kill`` on it. It proves the agent's process handling (argv, env passing,
stop and kill by container name), not that an image runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.protocol import EXIT_FAILED, Env
from broker.runtime import container

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "winglian/axolotl:main-py3.10-cu118-2.0.1"
SECRET = "hf_not_a_real_token_0123456789"

SHIM = r'''#!{python}
import json, os, signal, sys, time, subprocess
from pathlib import Path
state = Path(os.environ["SHIM_STATE"])
args = sys.argv[1:]
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\n")
if args[0] == "info":
    sys.exit(0)
if args[0] == "run":
    takes = {{"--name", "--network", "--ipc", "-e", "-v", "-w", "--gpus"}}
    i, opts, names = 1, {{}}, []
    while args[i].startswith("-"):
        if args[i] in takes:
            if args[i] == "-e" and "=" not in args[i + 1]:
                names.append(args[i + 1])
            opts.setdefault(args[i], args[i + 1])
            i += 2
        else:
            i += 1
    passed = {{n: os.environ[n] for n in names if n in os.environ}}
    (state / "env.json").write_text(json.dumps(passed))
    child = subprocess.Popen(args[i + 1:], env={{"PATH": os.environ["PATH"], **passed}},
                             cwd=opts.get("-w"), start_new_session=True)
    (state / (opts["--name"] + ".pid")).write_text(str(child.pid))
    sys.exit(child.wait())
name = args[-1]
pid = int((state / (name + ".pid")).read_text())
if args[0] == "stop" and not os.environ.get("SHIM_STOP_DOES_NOTHING"):
    os.killpg(pid, signal.SIGTERM)
    end = time.monotonic() + int(args[2])
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
elif args[0] == "kill":
    os.killpg(pid, getattr(signal, "SIG" + args[2]))
'''


# ---- the argv builder ---------------------------------------------------------------------------

def test_run_argv_passes_env_by_name_and_keeps_user_text_one_argument(tmp_path: Path) -> None:
    script = "echo $(id); rm -rf / 'x' \"y\""
    env = {"HF_TOKEN": SECRET, "MY_VAR": "1", Env.CONTAINER_ENV: "HF_TOKEN,MY_VAR",
           Env.RUN: script, "SKYPILOT_NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1",
           "PATH": "/host/bin", "HOME": "/root", "PYTHONPATH": "/host/py", "OTHER": "x"}
    argv = container.run_argv(IMAGE, "fleet-j-a0-n0-ab", ["sh", "-c", script], env,
                              volumes=[tmp_path, tmp_path], cwd=tmp_path, gpus=False)
    assert argv[:2] == ["docker", "run"] and argv[-4:] == [IMAGE, "sh", "-c", script]
    assert all(SECRET not in a for a in argv) and "/host/bin" not in " ".join(argv)
    named = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert named == ["TINI_KILL_PROCESS_GROUP=1", Env.CONTAINER_ENV, Env.RUN, "HF_TOKEN",
                     "MASTER_ADDR", "MY_VAR", "SKYPILOT_NODE_RANK"]
    assert argv.count("-v") == 1 and f"{tmp_path.resolve()}:{tmp_path.resolve()}" in argv
    assert argv[argv.index("-w") + 1] == str(tmp_path.resolve())
    for flag in (["--rm"], ["--network", "host"], ["--ipc", "host"], ["--init"],
                 ["--name", "fleet-j-a0-n0-ab"]):
        i = argv.index(flag[0])
        assert argv[i:i + len(flag)] == flag
    assert "--gpus" not in argv


def test_run_argv_passes_the_gpus_only_on_a_node_with_gpus() -> None:
    argv = container.run_argv(IMAGE, "n", ["true"], {}, volumes=[], cwd=None, gpus=True)
    assert argv[argv.index("--gpus") + 1] == "all" and "-w" not in argv


def test_stop_and_kill_target_the_container_by_name() -> None:
    assert container.stop_argv("fleet-x", 25.0) == ["docker", "stop", "-t", "25", "fleet-x"]
    assert container.signal_argv("fleet-x", "KILL") == ["docker", "kill", "--signal", "KILL",
                                                       "fleet-x"]
    assert container.container_name("a/b c", 3, 1, "ff") == "fleet-a-b-c-a3-n1-ff"


# ---- the real agent -----------------------------------------------------------------------------

def _env(tmp_path: Path, path: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "SKYPILOT_"))}
    env.update({"PYTHONPATH": str(ROOT), "PATH": path, Env.CONTAINER_IMAGE: IMAGE,
                Env.PER_NODE: "1", Env.PROGRESS_FILE: str(tmp_path / "progress.json"),
                Env.FILES_ROOT: str(tmp_path), "HF_TOKEN": SECRET, "MY_VAR": "one",
                Env.CONTAINER_ENV: "HF_TOKEN,MY_VAR", **extra})
    return env


def _agent(script: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "broker.runtime.agent", "--", "sh", "-c",
                             script], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _no_docker_path(tmp_path: Path) -> str:
    """A PATH with sh and python but no docker."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "bash", "touch"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                               text=True, check=True).stdout.strip()
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.parametrize("where", ["no docker on PATH", "this machine's docker"])
def test_a_node_that_cannot_run_containers_fails_the_launch_and_runs_nothing_on_the_host(
        where: str, tmp_path: Path) -> None:
    if where == "no docker on PATH":
        path = _no_docker_path(tmp_path)
    else:
        if container.unusable() is None:
            pytest.skip("this machine's docker has a daemon: the refusal path is not reached")
        if container.unusable().startswith("no "):  # type: ignore[union-attr]
            pytest.skip("no docker CLI on this machine")
        path = os.environ["PATH"]
    marker = tmp_path / "ran-on-the-host"
    agent = _agent(f"touch {marker}", _env(tmp_path, path))
    out, _ = agent.communicate(timeout=60)
    assert agent.returncode == EXIT_FAILED, out
    assert not marker.exists(), out
    assert f"container image {IMAGE!r}, and this node cannot run it" in out, out
    assert ("no 'docker' on PATH" if where == "no docker on PATH" else "docker info") in out


@pytest.fixture
def shim(tmp_path: Path) -> tuple[Path, str]:
    """The ``docker`` shim (see the module docstring) first on PATH, and its state folder."""
    state = tmp_path / "shim"
    bin_dir = state / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "docker"
    exe.write_text(SHIM.format(python=sys.executable))
    exe.chmod(0o755)
    return state, f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _calls(state: Path) -> list[list[str]]:
    path = state / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_agent_runs_the_task_through_docker_run_with_env_by_name(
        shim: tuple[Path, str], tmp_path: Path) -> None:
    state, path = shim
    script = 'echo "inside rank=$SKYPILOT_NODE_RANK var=$MY_VAR home=${HOME:-none}"'
    out, _ = _agent(script, _env(tmp_path, path, SHIM_STATE=str(state))).communicate(timeout=60)
    assert "inside rank=0 var=one home=none" in out, out
    calls = _calls(state)
    assert calls[0][:3] == ["info", "--format", "{{.ServerVersion}}"]
    run = next(c for c in calls if c[0] == "run")
    assert run[-4:] == [IMAGE, "sh", "-c", script]
    assert all(SECRET not in a for c in calls for a in c)  # in no argv, ever
    passed = json.loads((state / "env.json").read_text())
    assert passed["HF_TOKEN"] == SECRET and passed["SKYPILOT_NODE_RANK"] == "0"
    assert not {"HOME", "PATH", "PYTHONPATH"} & set(passed)


def test_a_stop_stops_the_container_with_the_grace_period(shim: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    state, path = shim
    ready = tmp_path / "ready"
    script = f"trap 'echo got-term; exit 0' TERM; touch {ready}; while :; do sleep 0.1; done"
    agent = _agent(script, _env(tmp_path, path, SHIM_STATE=str(state),
                                **{Env.GRACE_PERIOD: "7"}))
    _wait_for(ready, agent)
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    assert "got-term" in out, out
    name = _name(state)
    assert ["stop", "-t", "7", name] in _calls(state), _calls(state)


def test_a_container_that_ignores_the_stop_is_killed_after_the_grace_period(
        shim: tuple[Path, str], tmp_path: Path) -> None:
    state, path = shim
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; while :; do sleep 0.1; done"
    agent = _agent(script, _env(tmp_path, path, SHIM_STATE=str(state), SHIM_STOP_DOES_NOTHING="1",
                                **{Env.GRACE_PERIOD: "1"}))
    _wait_for(ready, agent)
    began = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    assert agent.returncode == EXIT_FAILED and time.monotonic() - began < 30, out
    name = _name(state)
    calls = _calls(state)
    assert ["stop", "-t", "1", name] in calls and ["kill", "--signal", "KILL", name] in calls
    pid = int((state / f"{name}.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the "container" is gone, not only its client
        os.kill(pid, 0)


def _name(state: Path) -> str:
    run = next(c for c in _calls(state) if c[0] == "run")
    return run[run.index("--name") + 1]


def _wait_for(path: Path, agent: subprocess.Popen[str]) -> None:
    end = time.monotonic() + 60
    while not path.exists():
        assert agent.poll() is None and time.monotonic() < end, agent.communicate()[0]
        time.sleep(0.05)
