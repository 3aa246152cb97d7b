"""Supervisor of one local "node": runs the job's command in the node's process group and
records its exit status in the node directory, so a restarted broker still learns how it ended.

Usage: ``python -m providers.local.node NODE_DIR WORKDIR [--user NAME] [--token FD_VAR] --
CMD ARGS...`` (started by ``LocalProvider``; the command runs in WORKDIR). With ``--user`` the
command runs as that user, with its own group and no other; the supervisor keeps the broker's
user, to write the node's log and exit record where the job cannot. With ``--token`` this
supervisor's stdin, a pipe the provider writes the agent's token to, is handed to the command as
an inherited descriptor whose number is in the variable FD_VAR: no job can read a pipe another
process holds, and it leaves nothing to read back. The variable's name comes as an argument
(``broker.protocol`` holds it) so that this supervisor imports the standard library only and
starts fast.
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


def _token_pipe(env: dict[str, str], fd_var: str) -> int:
    """The provider's pipe (this supervisor's stdin) handed on to the command: a copy of its read
    end, whose number goes in ``fd_var``; the command's own stdin stays empty."""
    fd = os.dup(0)
    env[fd_var] = str(fd)
    return fd


def main(argv: list[str]) -> int:
    node_dir, workdir = Path(argv[0]), argv[1]
    cmd = argv[argv.index("--") + 1:]
    opts = argv[2:argv.index("--")]
    user = opts[opts.index("--user") + 1] if "--user" in opts else None
    fd_var = opts[opts.index("--token") + 1] if "--token" in opts else None
    os.umask(0o077)  # the node's log, and the job's files (checkpoints): owner only
    signal.signal(signal.SIGTERM, _noop)
    signal.signal(signal.SIGINT, _noop)
    env = dict(os.environ)
    token_fd = _token_pipe(env, fd_var) if fd_var else None
    as_user: dict[str, Any] = {}
    if user is not None:
        pw = pwd.getpwnam(user)
        as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    with open(node_dir / "output.log", "ab", buffering=0) as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, cwd=workdir,
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
