"""A real uvicorn server on a free loopback port, run in a thread for API and CLI tests."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from tests.redis_server import free_port


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
