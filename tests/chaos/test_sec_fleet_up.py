"""Issue 13, items 2, 7 and 10a, as a user runs it: a real ``fleet up`` whose own environment holds
tokens and a cloud secret runs a job that looks for them (its environment, its agent's
``/proc/PID/environ`` and command line, the supervisor's, any token file in the state dir) and
finds none, while its agent's reports are accepted; ``kill -9`` of ``fleet up`` leaves no
redis-server behind and a second ``fleet up`` on the same state dir runs exactly one, with the
running job intact; after the run every file in the state dir (Redis AOF, tokens, logs,
checkpoints) is 0600 in 0700."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from broker.auth import attempt_token
from broker.server import _redis_servers_in
from tests.chaos.conftest import Tally, duplicate_launches
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
ADMIN = "admin-token-in-brokers-env-0123456789"
TEAM = "team-token-in-brokers-env-0123456789"
CLOUD = "cloud-secret-in-brokers-env-0123456789"
FLEET = """
grace_period_s: 2
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 3}
"""
# The job: what it can see. Its ancestors up to (not including) the broker: the agent, the
# node's supervisor.
SPY = r"""
import json, os, sys
def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"<{exc.strerror}>"
chain, pid = [], os.getppid()
while pid > 1 and len(chain) < 10:
    chain.append({"pid": pid, "environ": read(f"/proc/{pid}/environ"),
                  "cmdline": read(f"/proc/{pid}/cmdline")})
    pid = int(read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()[1])
files = {}
for root, _, names in os.walk(sys.argv[1]):
    for n in names:
        if "token" in n and n != "tokens.json":  # the broker's own file: see docs/security.md
            files[os.path.join(root, n)] = read(os.path.join(root, n))
named = os.environ.get("FLEET_AGENT_TOKEN_FILE")
if named:
    files[named] = read(named)
with open(sys.argv[2], "w") as f:
    json.dump({"env": dict(os.environ), "chain": chain, "files": files}, f)
with open(os.environ["FLEET_PROGRESS_FILE"], "w") as f:  # the agent reports it
    json.dump({"step": 1, "samples_done": 8}, f)
print("spy done")
"""


def spec(name: str, run: str, steps: int | None = None) -> str:
    work = f"work: {{steps: {steps}}}" if steps else "work_samples: 8"
    return yaml.safe_dump({"name": name, "run": run, "batch_size": {"min": 8, "max": 8}}) + \
        work + "\n"


def fleet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def up(tmp: Path, env: dict[str, str], port: int,
       prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """``fleet up`` with its state in ``tmp``, under the command ``prefix`` (if any)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "broker", "up", "--state-dir", str(tmp / "state"),
         "--fleet", str(tmp / "fleet.yaml"), "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200 \
                    and (tmp / "client.yaml").exists():
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and \
            proc.stdout.read()
        time.sleep(0.2)


def job(env: dict[str, str], job_id: str) -> dict:
    return yaml.safe_load(fleet(env, "job", job_id, "--json").stdout)["job"]


def wait_state(env: dict[str, str], job_id: str, state: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while (got := job(env, job_id))["state"] != state:
        assert time.monotonic() < deadline and got["state"] not in ("failed", "cancelled"), got
        time.sleep(0.5)
    return got


def group_or_other(path: Path) -> list[str]:
    bad = []
    for p in [path, *path.rglob("*")]:
        mode = p.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            bad.append(f"{p.relative_to(path)} {stat.filemode(mode)}")
    return bad


def test_jobs_see_no_secret_and_a_killed_fleet_up_leaves_one_redis(tmp_path: Path,
                                                                   chaos: Tally) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "spy.py").write_text(SPY)
    state = tmp_path / "state"
    (tmp_path / "spy.yaml").write_text(spec(
        "spy", f"python {tmp_path / 'spy.py'} {state} {tmp_path / 'seen.json'}"))
    (tmp_path / "ckpt.yaml").write_text(spec(
        "ckpt", "python examples/train_synthetic.py --size tiny --steps 30 --batch-size 8 "
        "--checkpoint-every-steps 10", steps=30))
    (tmp_path / "long.yaml").write_text(spec("long", "sleep 12; echo long done"))
    env = {**os.environ, "FLEET_CONFIG": str(tmp_path / "client.yaml"),
           "FLEET_ADMIN_TOKEN": ADMIN, "FLEET_TEAM_TOKENS": f"ml={TEAM}",
           "AWS_SECRET_ACCESS_KEY": CLOUD}
    for k in ("FLEET_URL", "FLEET_TOKEN", "FLEET_REDIS_URL"):
        env.pop(k, None)
    client = {k: v for k, v in env.items() if k not in ("FLEET_ADMIN_TOKEN", "FLEET_TEAM_TOKENS")}
    port = free_port()
    first = up(tmp_path, env, port)
    second = None
    try:
        ids = {}
        for name in ("spy", "long", "ckpt"):
            launched = fleet(client, "launch", str(tmp_path / f"{name}.yaml"), "--json")
            assert launched.returncode == 0, launched.stderr
            ids[name] = yaml.safe_load(launched.stdout)["id"]
        spied = wait_state(client, ids["spy"], "completed")
        assert spied["samples_done"] == 8  # the agent had its token: its report was taken

        tokens = json.loads((state / "tokens.json").read_text())
        password = (state / "redis" / "password").read_text().strip()
        secrets = {"admin": ADMIN, "team": TEAM, "cloud": CLOUD, "agent key": tokens["agent"],
                   "generated admin": tokens["admin"], "redis password": password,
                   "attempt token": attempt_token(tokens["agent"], ids["spy"],
                                                  spied["attempt"])}
        seen = json.loads((tmp_path / "seen.json").read_text())
        broker_pids = {first.pid}
        chain = [c for c in seen["chain"] if c["pid"] not in broker_pids]
        chain = chain[:next((i for i, c in enumerate(seen["chain"]) if c["pid"] in broker_pids),
                            len(chain))]
        # the job's shell, its agent and the node's supervisor
        assert any("broker.runtime.agent" in c["cmdline"] for c in chain), seen["chain"]
        assert any("providers.local.node" in c["cmdline"] for c in chain), seen["chain"]
        assert "FLEET_AGENT_TOKEN_FILE" not in seen["env"]
        assert all(v.startswith("<") for v in seen["files"].values()), seen["files"]  # gone
        where = {"env": json.dumps(seen["env"]), "files": json.dumps(seen["files"]),
                 **{f"ancestor {c['pid']}": c["environ"] + c["cmdline"] for c in chain},
                 "logs": fleet(client, "logs", ids["spy"]).stdout}
        found = [(what, place) for what, value in secrets.items()
                 for place, text in where.items() if value in text]
        chaos.record(secrets_seen=len(found))
        assert found == []
        assert set(seen["env"]) & {"FLEET_ADMIN_TOKEN", "FLEET_TEAM_TOKENS",
                                   "AWS_SECRET_ACCESS_KEY", "FLEET_AGENT_TOKEN"} == set()

        # kill -9 of `fleet up` while a job runs: its Redis goes with it (parent-death signal)
        assert job(client, ids["long"])["state"] == "running"
        (redis_pid,) = _redis_servers_in(state / "redis")
        first.send_signal(signal.SIGKILL)
        chaos.record(faults=1)
        first.wait()
        deadline = time.monotonic() + 15
        while _redis_servers_in(state / "redis"):
            assert time.monotonic() < deadline, "redis-server outlived its broker"
            time.sleep(0.1)
        second = up(tmp_path, env, port)
        (now,) = _redis_servers_in(state / "redis")  # exactly one, on the same data
        assert now != redis_pid
        wait_state(client, ids["long"], "completed")
        assert "long done" in fleet(client, "logs", ids["long"]).stdout
        wait_state(client, ids["ckpt"], "completed", timeout=180)
        assert list((state / "checkpoints" / ids["ckpt"]).iterdir())
        ended = [job(client, i)["state"] for i in ids.values()]
        duplicates = duplicate_launches(state)
        chaos.record(jobs_lost=sum(s != "completed" for s in ended),
                     duplicate_launches=duplicates)
        assert duplicates == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.communicate(timeout=60)
    assert second is not None and second.returncode == 0
    assert _redis_servers_in(state / "redis") == []
    assert group_or_other(state) == []  # AOF, tokens, logs, checkpoints: owner only
