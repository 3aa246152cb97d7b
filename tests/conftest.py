"""Shared fixtures: a real redis-server per test (AOF everysec) and a ``Store`` over it; the
session's fault-and-attack summary, gathered from pytest-xdist's workers when it runs them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import Store
from tests.chaos.conftest import COUNTS, TALLY, Tally
from tests.redis_server import RedisServer

# The suite runs as root, and its jobs read and write pytest's temp folders, which are 0700:
# their jobs run as the broker's user. tests/chaos/test_job_user.py runs jobs as the default
# unprivileged user and checks what they cannot read.
os.environ.setdefault("FLEET_JOB_USER", "root")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started redis-server; ``.url``, ``.restart(kill=True)``, ``.stop()``."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def store(redis_server: RedisServer) -> Store:
    return Store.from_url(redis_server.url)


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # a pytest-xdist worker: its tally goes to the controller
        output["chaos_tally"] = dataclasses.asdict(TALLY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    got = getattr(node, "workeroutput", {}).get("chaos_tally")
    if got:
        TALLY.merge(Tally(**got))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    t = TALLY
    if not t.faults and not any(t.checked.values()):
        return
    tr = terminalreporter
    tr.section("fault and attack summary")
    tr.write_line(f"faults injected: {t.faults}")
    for name in COUNTS:
        label = name.replace("_", " ")
        if t.checked[name]:
            tr.write_line(f"{label}: {t.found[name]} (checked by {t.checked[name]} cases)")
        else:
            tr.write_line(f"{label}: not checked in this run")
    worst = "not measured" if t.worst_latency_s is None else f"{t.worst_latency_s * 1000:.0f} ms"
    tr.write_line(f"worst API latency under attack: {worst}")
