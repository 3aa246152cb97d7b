"""A broker replica for the fault tests: ``broker.server.Stack`` (API and leader loop) over a
given Redis, with short lease and heartbeat times, as a process a test can ``kill -9``.

``python -m tests.chaos.replica REDIS_URL STATE_DIR FLEET PORT OWNER``; the tokens come from
FLEET_ADMIN_TOKEN and FLEET_AGENT_TOKEN, so every replica of a test shares them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from broker.server import BrokerConfig, Stack

LEASE_TTL_S = 2.0
HEARTBEAT_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


class Replica:
    """One replica process; ``url`` is its API."""

    def __init__(self, redis_url: str, state: Path, fleet: Path, port: int, owner: str,
                 tokens: dict[str, str]) -> None:
        self.args = [sys.executable, "-m", "tests.chaos.replica", redis_url, str(state),
                     str(fleet), str(port), owner]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT),
                    "FLEET_ADMIN_TOKEN": tokens["admin"], "FLEET_AGENT_TOKEN": tokens["agent"]}
        self.url = f"http://127.0.0.1:{port}"
        self.log = state.parent / f"{owner}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> Replica:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=log,
                                         stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


def main(argv: list[str]) -> None:
    redis_url, state, fleet, port, owner = argv
    config = BrokerConfig(state_dir=Path(state), redis_url=redis_url, fleet=Path(fleet),
                          owner=owner, tick_s=0.2, lease_ttl_s=LEASE_TTL_S,
                          heartbeat_interval_s=HEARTBEAT_S)
    Stack(config, port=int(port)).start()
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
