"""``python -m tests.chaos.stack_main REDIS_URL STATE_DIR PORT OWNER LEASE_TTL_S``: the API and
the leader loop in one process, as ``fleet up`` runs them (``broker.server.Stack``), over a
given Redis, until SIGTERM. Team tokens come from ``FLEET_TEAM_TOKENS``."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from broker.server import BrokerConfig, Stack


def main(argv: list[str]) -> None:
    redis_url, state_dir, port, owner, ttl = argv
    stack = Stack(BrokerConfig(state_dir=Path(state_dir), redis_url=redis_url, owner=owner,
                               lease_ttl_s=float(ttl), tick_s=0.2, use_agent=False),
                  port=int(port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stack.start()
    stop.wait()
    stack.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
