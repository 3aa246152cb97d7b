"""Shared fixtures: a real redis-server per test (AOF everysec) and a ``Store`` over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import Store
from tests.redis_server import RedisServer


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
