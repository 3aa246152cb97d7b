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
from collections.abc import Collection, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

import broker
from broker.protocol import Heartbeat
from policies.models import Accelerator, Market
from providers import bootstrap
from providers.base import LaunchRequest, replacement_key
from tests.http_stub import serve

SHIM = """#!/bin/bash
echo "$*|PIP_BREAK_SYSTEM_PACKAGES=${PIP_BREAK_SYSTEM_PACKAGES:-}\
|FLEET_NODE_RANK=${FLEET_NODE_RANK:-}|PYTHONPATH=${PYTHONPATH:-}\
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


def start_script(script: str, tmp_path: Path, real: Collection[str] = (),
                 **machine_env: str) -> subprocess.Popen:
    """Start ``script`` with bash as user data runs, the shim and stubs first on PATH (but
    those named in ``real``: the machine's own), plus ``machine_env``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {k: f"#!/bin/bash\n{v}" for k, v in STUBS.items() if k not in real}
    for name, body in {"python3": SHIM, **stubs}.items():
        stub = bin_dir / name
        stub.write_text(body)
        stub.chmod(0o755)
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    (tmp := tmp_path / "tmp").mkdir(exist_ok=True)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "STATE": str(tmp_path),
           "TMPDIR": str(tmp), **machine_env}
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
    # the token file: the agent deletes it, else the exit trap (the shim agent deletes nothing)
    assert not list((tmp_path / "tmp").glob("fleet-agent-token.*"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), calls


def run_script(script: str, tmp_path: Path, real: Collection[str] = (), **machine_env: str,
               ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``script`` to its end (``start_script``); how it ended and the calls they saw."""
    return finish(start_script(script, tmp_path, real, **machine_env), tmp_path)


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
    assert (beat.job_id, beat.attempt, beat.round, beat.node_rank, beat.state, beat.exit_code
            ) == ("job-9", 3, 0, 0, "failed", 3)
    assert TOKEN not in done.stdout + done.stderr


def test_a_stand_ins_failure_is_reported_in_the_round_it_was_launched_for(
        tmp_path: Path) -> None:
    """A lost node's stand-in starts in the round the broker bumped to: its start failure
    belongs there (the broker reads a node's exit code in the job's current round)."""
    (tmp_path / "agent-exit").write_text("4")
    key = replacement_key("job-9:2:3", 1, 2)
    stand_in = reporting(FLEET_ROUND="2", FLEET_LAUNCH_KEY=key).model_copy(
        update={"first_rank": 1})
    done, calls = run_script(bootstrap.agent_script(stand_in, "gcp", "fb"), tmp_path)
    assert done.returncode == 4
    beat = reported(tmp_path, calls)
    assert (beat.attempt, beat.round, beat.node_rank, beat.exit_code) == (3, 2, 1, 4)
    assert beat.launch_key == key  # the broker takes it from the node that holds rank 1 now


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


def gang(**kw) -> LaunchRequest:
    """Ranks 0 and 1 of a job, in one launch whose broker env still carries a rank of its own."""
    return request().model_copy(update={"nodes": 2, "env": {"FLEET_NODE_RANK": "0"}, **kw})


def test_the_provider_gives_each_node_its_rank() -> None:
    """A one-node launch (a lost node's replacement) is its first rank; a gang's node gets its
    own from the provider (one VM per node) or works it out (no FLEET_NODE_RANK: never the same
    one, from the request's env, on every node); the tags tell the inventory the ranks."""
    stand_in = request().model_copy(update={
        "idempotency_key": replacement_key("job-9:1:0", 1, 2), "first_rank": 1})
    env = bootstrap.agent_env(stand_in, "aws")
    assert (env["FLEET_NODES"], env["FLEET_FIRST_RANK"], env["FLEET_NODE_RANK"]) == ("1", "1", "1")
    env = bootstrap.agent_env(gang(first_rank=2), "aws")
    assert env["FLEET_FIRST_RANK"] == "2" and "FLEET_NODE_RANK" not in env
    assert bootstrap.agent_env(gang(), "gcp", rank=1)["FLEET_NODE_RANK"] == "1"
    assert [bootstrap.node_rank(gang(first_rank=2), i) for i in (0, 1)] == [2, 3]
    with pytest.raises(ValueError, match=r"node index 2: a launch of 2 nodes has 0\.\.1"):
        bootstrap.node_rank(gang(), 2)
    tags = bootstrap.tags(gang(first_rank=2), "b1")
    assert tags[bootstrap.FIRST_RANK_TAG] == "2" and bootstrap.RANK_TAG not in tags
    assert bootstrap.tagged_rank(tags, 1) == 3 and bootstrap.tagged_rank(tags) is None
    assert bootstrap.tagged_rank(bootstrap.tags(gang(first_rank=2), "b1", rank=3)) == 3
    with pytest.raises(ValueError, match="gcp: a start script for a 2-node launch needs each"):
        bootstrap.agent_script(gang(), "gcp", "fb")


class Imds(BaseHTTPRequestHandler):
    """EC2's instance metadata service (IMDSv2) as far as the start script reads it: a token
    from ``PUT /latest/api/token``, then ``ami-launch-index`` with that token."""

    index = "1"
    seen: list[str]

    def do_PUT(self) -> None:
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self.seen.append(f"PUT {self.path} ttl={ttl}")
        self.answer(200 if self.path == "/latest/api/token" and ttl else 400, "imds-token")

    def do_GET(self) -> None:
        token = self.headers.get("X-aws-ec2-metadata-token")
        self.seen.append(f"GET {self.path} token={token}")
        if token != "imds-token":
            self.answer(401, "")
        elif self.path == "/latest/meta-data/ami-launch-index" and self.index:
            self.answer(200, self.index)
        else:
            self.answer(404, "not found")

    def answer(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def imds() -> Iterator[tuple[str, type[Imds]]]:
    """A local metadata service on a free loopback port: (its base URL, its handler class)."""
    handler = type("ImdsOnce", (Imds,), {"seen": []})
    with serve(handler) as url:
        yield url, handler


def agent_rank(calls: list[str]) -> str:
    (agent,) = [c for c in calls if c.startswith("-m broker.runtime.agent")]
    return next(f for f in agent.split("|") if f.startswith("FLEET_NODE_RANK="))


def test_a_gang_node_on_aws_adds_its_launch_index_from_imds_to_the_first_rank(
        tmp_path: Path, imds: tuple[str, type[Imds]]) -> None:
    """One RunInstances, one user data for both nodes: the second instance (launch index 1)
    reads its index from IMDSv2 (the machine's real curl) and runs its agent as rank 1."""
    url, handler = imds
    script = bootstrap.agent_script(gang(), "aws", "fb")
    done, calls = run_script(script, tmp_path, real={"curl"}, FLEET_METADATA_AWS_URL=url)
    assert done.returncode == 0, done.stderr
    assert agent_rank(calls) == "FLEET_NODE_RANK=1"
    assert handler.seen == ["PUT /latest/api/token ttl=300",
                            "GET /latest/meta-data/ami-launch-index token=imds-token"]
    # Ranks 4 and 5 of a job (a launch's first rank is not always 0): index 1 is rank 5.
    (tmp_path / "calls").unlink()
    done, calls = run_script(bootstrap.agent_script(gang(first_rank=4), "aws", "fb"), tmp_path,
                             real={"curl"}, FLEET_METADATA_AWS_URL=url)
    assert done.returncode == 0 and agent_rank(calls) == "FLEET_NODE_RANK=5"


def test_a_one_node_launch_carries_its_rank_and_asks_no_metadata(
        tmp_path: Path, imds: tuple[str, type[Imds]]) -> None:
    url, handler = imds
    stand_in = request().model_copy(update={"first_rank": 3})
    done, calls = run_script(bootstrap.agent_script(stand_in, "aws", "fb"), tmp_path,
                             real={"curl"}, FLEET_METADATA_AWS_URL=url)
    assert done.returncode == 0, done.stderr
    assert agent_rank(calls) == "FLEET_NODE_RANK=3" and handler.seen == []


def test_an_unreadable_launch_index_fails_the_script_before_the_agent(
        tmp_path: Path, imds: tuple[str, type[Imds]]) -> None:
    """No index (IMDS answers 404): the node cannot know its rank, so it must not join the job
    as some other node's rank; the script fails, names why, and powers the VM off."""
    url, handler = imds
    handler.index = ""
    done, calls = run_script(bootstrap.agent_script(gang(), "aws", "fb"), tmp_path,
                             real={"curl"}, FLEET_METADATA_AWS_URL=url)
    assert done.returncode == 1
    assert "cannot read this instance's ami-launch-index from " + url in done.stderr
    assert not [c for c in calls if c.startswith("-m broker.runtime.agent")]
    assert calls[-1] == "shutdown -h now"


def test_a_container_job_needs_a_working_docker_on_the_node(tmp_path: Path) -> None:
    """The start script of a job with a container image fails the attempt, naming the cause,
    where the node's ``docker info`` fails (a stand-in docker that always fails, and no
    systemctl); other jobs' scripts have no such step."""
    from broker.protocol import Env

    plain = request()
    boxed = plain.model_copy(update={"env": {**plain.env, Env.CONTAINER_IMAGE: "repo/img:1"}})
    assert bootstrap.container_step(plain) == "" and "docker info" not in \
        bootstrap.agent_script(plain, "aws", "fleetbroker")
    step = bootstrap.container_step(boxed)
    assert step in bootstrap.agent_script(boxed, "aws", "fleetbroker")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    for tool in ("seq", "sleep"):
        (bin_dir / tool).symlink_to(subprocess.run(["sh", "-c", f"command -v {tool}"],
                                                   capture_output=True, text=True,
                                                   check=True).stdout.strip())
    fast = step.replace("sleep 2", "sleep 0")
    done = subprocess.run(["/bin/bash", "-c", fast], env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no usable Docker" in done.stderr
