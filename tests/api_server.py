"""A real uvicorn server on a free loopback port, run in a thread for API and CLI tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from broker.api import build_app
from broker.auth import ApiConfig, hash_token
from broker.files import BlobStore
from broker.sealed import Sealer
from broker.store import Store
from tests.redis_server import RedisServer, free_port

# Test tokens: an admin, two teams (one configured by hash), the agents' and a scraper's.
TOKENS = {"admin": "admin-token-0123456789", "ml": "ml-team-token-0123456789",
          "vision": "vision-token-0123456789", "agent": "agent-token-0123456789",
          "metrics": "metrics-token-0123456789"}


def api_config() -> ApiConfig:
    return ApiConfig.from_mapping({"tokens": [
        {"admin": True, "token": TOKENS["admin"]},
        {"team": "ml", "token": TOKENS["ml"]},
        {"team": "vision", "token_sha256": hash_token(TOKENS["vision"])},
        {"agent": True, "token": TOKENS["agent"]},
        {"metrics": True, "token": TOKENS["metrics"]},
    ], "max_body_bytes": 64 * 1024}).with_attempt_key(TOKENS["agent"])


@contextmanager
def api_stack(tmp: Path, sealer: Sealer | None = None) -> Iterator[tuple[ApiServer, Store]]:
    """A redis-server and the API over it on loopback (keeping packs under ``tmp/blobs``;
    ``sealer``: the jobs' secrets key, none by default), both stopped on exit."""
    redis = RedisServer(tmp / "redis")
    redis.start()
    srv = None
    try:
        store = Store.from_url(redis.url)
        srv = ApiServer(build_app(store, api_config(), blobs=BlobStore(tmp / "blobs"),
                                  sealer=sealer)).start()
        yield srv, store
    finally:
        if srv is not None:
            srv.stop()
        redis.stop()


class ApiServer:
    """Serve ``app`` on 127.0.0.1 until ``stop()``; ``.url`` is its base URL."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
            lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
