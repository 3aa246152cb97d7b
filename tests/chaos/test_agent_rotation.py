"""An agent given every broker replica's URL reports to one that answers while another is dead,
and tries its final report, with backoff, for as long as no broker takes it (not five times):
a real agent process against a closed port and a stub broker that answers 503 for a while."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import pytest

from tests.http_stub import serve
from tests.redis_server import free_port
from tests.runtime.jobs import ROOT, job_env

REFUSALS = 8  # final reports answered 503 before one is taken: more than the old five tries


class Broker(BaseHTTPRequestHandler):
    """Takes heartbeats; answers the first REFUSALS final reports 503 (its Redis away)."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        finals = sum("exit_code" in b for b in type(self).bodies)
        if "exit_code" in body and finals <= REFUSALS:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        reply = json.dumps({"action": None, "round": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def broker() -> Iterator[tuple[str, type[Broker]]]:
    handler = type("StubBroker", (Broker,), {"bodies": []})
    with serve(handler) as url:
        yield url, handler


def test_reports_rotate_past_a_dead_replica_and_the_final_one_is_tried_until_taken(
        tmp_path: Path, broker: tuple[str, type[Broker]]) -> None:
    url, stub = broker
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    env = job_env(tmp_path, broker_url=f"{dead},{url}", heartbeat_interval=0.1,
                  report_max_wait=0.05, job_id="job-7", attempt=1)
    worker = "import time; time.sleep(0.6)"
    done = subprocess.run([sys.executable, "-m", "broker.runtime.agent", "--", sys.executable,
                           "-c", worker], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    beats = [b for b in stub.bodies if "exit_code" not in b]
    finals = [b for b in stub.bodies if "exit_code" in b]
    assert beats, "no heartbeat reached the live replica"
    assert len(finals) == REFUSALS + 1 and {b["exit_code"] for b in finals} == {0}
    assert "giving up" not in done.stderr
    # the dead replica was tried first, then the one that answered kept the heartbeats; each
    # try of the final report that the live one refused went on to the dead one
    assert done.stderr.count("Connection refused") == 1 + REFUSALS, done.stderr
