"""Tests' redis-server: the broker's own embedded server (``broker.server.EmbeddedRedis``) on a
free loopback port in a temp dir, with AOF on; ``restart(kill=True)`` is a ``kill -9``."""

from __future__ import annotations

from broker.server import EmbeddedRedis, free_port

RedisServer = EmbeddedRedis

__all__ = ["RedisServer", "free_port"]
