"""Issue 13, local jobs under a root broker: a real ``fleet up`` running as root starts its job as
the unprivileged default user (``nobody``); from inside, the job cannot read the Redis password,
the AOF, the token file or the state dir's listing, yet writes its checkpoint directory, and its
agent (which got its token on a pipe) has its report accepted."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from providers.base import ProviderError
from providers.local.job_user import JobUser, hand_over, job_user, unreachable
from tests.chaos.conftest import Tally
from tests.chaos.test_sec_fleet_up import FLEET, fleet, spec, up, wait_state
from tests.redis_server import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")

SPY = r"""
import json, os, sys
tried = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        tried[path] = "read"
    except OSError as exc:
        tried[path] = exc.strerror
out = os.path.join(os.environ["FLEET_CHECKPOINT_URI"], "seen.json")
with open(out, "w") as f:
    json.dump({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
               "home": os.environ.get("HOME"), "tried": tried}, f)
with open(os.environ["FLEET_PROGRESS_FILE"], "w") as f:  # the agent reports it
    json.dump({"step": 1, "samples_done": 8}, f)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A temp folder the job user can pass (pytest's own are 0700, as a careful operator's
    home is: the provider refuses a state dir under one, naming it)."""
    path = Path(tempfile.mkdtemp(prefix="fleet-job-user-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def passable_python(user: JobUser, scratch: Path) -> tuple[str, ...]:
    """A command prefix under which ``user`` can run this Python. On a machine whose Python
    lives in a 0700 folder (pyenv under /root) the broker refuses to start, so the stack runs
    in a private mount namespace where that folder is a 0711 tmpfs holding only the way to
    Python; nothing changes outside the namespace."""
    python = Path(sys.executable).resolve()
    blocked = unreachable(python.parent, user)
    if blocked is None:
        return ()
    inner = python.relative_to(blocked).parts[0]
    keep = scratch / "keep"
    keep.mkdir()
    script = (f"mount --bind {shlex.quote(str(blocked / inner))} {shlex.quote(str(keep))} && "
              f"mount -t tmpfs -o mode=0711 tmpfs {shlex.quote(str(blocked))} && "
              f"mkdir {shlex.quote(str(blocked / inner))} && "
              f"mount --bind {shlex.quote(str(keep))} {shlex.quote(str(blocked / inner))} && "
              'exec "$@"')
    probe = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", "true"],
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"the job user cannot run {python} ({blocked} is closed) and no mount "
                    f"namespace is possible here: {probe.stderr.strip()}")
    return ("unshare", "-m", "sh", "-c", script, "sh")


def test_a_root_brokers_job_runs_unprivileged_and_cannot_read_its_state(
        base: Path, chaos: Tally) -> None:
    nobody = pwd.getpwnam("nobody")
    user = JobUser(name="nobody", uid=nobody.pw_uid, gid=nobody.pw_gid, home=nobody.pw_dir)
    (base / "fleet.yaml").write_text(FLEET)
    (base / "spy.py").write_text(SPY)
    os.chmod(base / "spy.py", 0o644)
    state = base / "state"
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLEET_JOB_USER", "FLEET_URL", "FLEET_TOKEN", "FLEET_REDIS_URL")}
    env["FLEET_CONFIG"] = str(base / "client.yaml")
    proc = up(base, env, free_port(), prefix=passable_python(user, base))
    try:
        aof = sorted((state / "redis").rglob("*.aof*"))
        assert aof, list((state / "redis").rglob("*"))
        targets = [state / "redis" / "password", *aof, state / "tokens.json", state,
                   state / "redis", state / "provider" / "nodes"]
        run = f"python {base / 'spy.py'} " + " ".join(str(t) for t in targets)
        (base / "spy.yaml").write_text(spec("spy", run))
        launched = fleet(env, "launch", str(base / "spy.yaml"), "--json")
        assert launched.returncode == 0, launched.stderr
        job_id = yaml.safe_load(launched.stdout)["id"]
        done = wait_state(env, job_id, "completed")
        assert done["samples_done"] == 8  # the agent had its token: its report was taken
        seen = json.loads((state / "checkpoints" / job_id / "seen.json").read_text())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert (seen["uid"], seen["gid"], seen["groups"]) == \
        (nobody.pw_uid, nobody.pw_gid, [])  # its own group, no other
    assert seen["home"] == nobody.pw_dir
    readable = [p for p, how in seen["tried"].items() if how != "Permission denied"]
    chaos.record(secrets_seen=len(readable))
    assert readable == [], seen["tried"]
    assert len(seen["tried"]) == len(targets)


def test_a_job_user_that_cannot_work_is_refused_with_the_fix(base: Path) -> None:
    with pytest.raises(ValueError, match="FLEET_JOB_USER='no-such-user-here': no such user"):
        job_user({"FLEET_JOB_USER": "no-such-user-here"})
    assert job_user({"FLEET_JOB_USER": "root"}) is None  # explicit: the broker's own user
    nobody = pwd.getpwnam("nobody")
    user = JobUser(name="nobody", uid=nobody.pw_uid, gid=nobody.pw_gid, home=nobody.pw_dir)
    closed = base / "home"  # a 0700 folder above the state dir
    closed.mkdir(mode=0o700)
    root = closed / "state" / "checkpoints"
    with pytest.raises(ProviderError, match=f"nobody cannot enter {closed} "):
        hand_over(root / "job-1", root, user)
    opened = base / "state" / "checkpoints"
    hand_over(opened / "job-1", opened, user)
    st = (opened / "job-1").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, 0o700)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (opened, opened.parent)] == [0o711, 0o711]
    hand_over(base / "elsewhere", opened, user)  # a spec's own place: left alone
    assert not (base / "elsewhere").exists()
