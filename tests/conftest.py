"""Shared fixtures: a real redis-server per test (AOF everysec) and a ``Store`` over it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import Store
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
