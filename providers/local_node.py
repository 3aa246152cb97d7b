"""Supervisor of one local "node": runs the job's command in the node's process group and
records its exit status in the node directory, so a restarted broker still learns how it ended.

Usage: ``python -m providers.local_node NODE_DIR [--user NAME] -- CMD ARGS...`` (started by
``LocalProvider``). With ``--user`` the command runs as that user, with its own group and no
other; the supervisor keeps the broker's user, to write the node's log and exit record where the
job cannot. The agent's token file (``FLEET_AGENT_TOKEN_FILE``, 0600 in the node directory) is
read and deleted here and handed to the command on an inherited pipe, ``FLEET_AGENT_TOKEN_FD``:
a job of another user could not open the file, and a pipe leaves nothing to read back.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _noop(signum: int, frame: object) -> None:
    """SIGTERM reaches the whole group; the supervisor outlives it to record the exit code.
    A handler (not SIG_IGN) so the child does not inherit an ignored SIGTERM."""


def _token_pipe(env: dict[str, str]) -> int | None:
    """Move the token from its file into a pipe; the read end's number, or None."""
    path = env.pop("FLEET_AGENT_TOKEN_FILE", None)
    if not path:
        return None
    try:
        token = Path(path).read_bytes()
    except OSError:
        return None  # the agent says reports will be refused
    Path(path).unlink(missing_ok=True)
    read, write = os.pipe()
    os.write(write, token)  # 64 bytes: far below a pipe's buffer
    os.close(write)
    env["FLEET_AGENT_TOKEN_FD"] = str(read)
    return read


def main(argv: list[str]) -> int:
    node_dir = Path(argv[0])
    cmd = argv[argv.index("--") + 1:]
    user = argv[argv.index("--user") + 1] if "--user" in argv[:argv.index("--")] else None
    os.umask(0o077)  # the node's log, and the job's files (checkpoints): owner only
    signal.signal(signal.SIGTERM, _noop)
    signal.signal(signal.SIGINT, _noop)
    env = dict(os.environ)
    token_fd = _token_pipe(env)
    as_user: dict[str, Any] = {}
    if user is not None:
        pw = pwd.getpwnam(user)
        as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    with open(node_dir / "output.log", "ab", buffering=0) as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, cwd=env.get("FLEET_WORKDIR"),
                                pass_fds=() if token_fd is None else (token_fd,), **as_user)
        if token_fd is not None:
            os.close(token_fd)
        code = proc.wait()
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    tmp = node_dir / "exit.tmp"
    tmp.write_text(json.dumps({"code": code, "ended_at": time.time()}))
    tmp.replace(node_dir / "exit.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
