"""Supervisor of one local "node": runs the job's command in the node's process group and
records its exit status in the node directory, so a restarted broker still learns how it ended.

Usage: ``python -m providers.local.node NODE_DIR -- CMD ARGS...`` (started by ``LocalProvider``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _noop(signum: int, frame: object) -> None:
    """SIGTERM reaches the whole group; the supervisor outlives it to record the exit code.
    A handler (not SIG_IGN) so the child does not inherit an ignored SIGTERM."""


def main(argv: list[str]) -> int:
    node_dir = Path(argv[0])
    cmd = argv[argv.index("--") + 1:]
    os.umask(0o077)  # the node's log, and the job's files (checkpoints): owner only
    signal.signal(signal.SIGTERM, _noop)
    signal.signal(signal.SIGINT, _noop)
    with open(node_dir / "output.log", "ab", buffering=0) as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=os.environ.get("FLEET_WORKDIR"))
        code = proc.wait()
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    tmp = node_dir / "exit.tmp"
    tmp.write_text(json.dumps({"code": code, "ended_at": time.time()}))
    tmp.replace(node_dir / "exit.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
