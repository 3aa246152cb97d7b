"""Helpers that run the digits job as real processes (agent, torchrun) with gloo on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from tests.http_stub import serve

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "train_digits.py"


def job_env(tmp: Path, **fleet: object) -> dict[str, str]:
    """The worker environment: this checkout first on the path, one thread, FLEET_* as given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env["FLEET_PROGRESS_FILE"] = str(tmp / "progress.json")
    env["FLEET_PROGRESS_INTERVAL"] = "0"
    env.update({f"FLEET_{k.upper()}": str(v) for k, v in fleet.items()})
    return env


def progress(tmp: Path) -> dict:
    try:
        return json.loads((tmp / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Run:
    code: int
    output: str
    seconds: float
    stopped_at: float | None = None  # when the stop was triggered (monotonic)
    ended_at: float = 0.0


def run_job(
    command: list[str], env: dict[str, str], tmp: Path, *, stop_at_step: int | None = None,
    trigger: Callable[[], None] | None = None, timeout: float = 120,
) -> Run:
    """Run ``command``; once rank 0 reports ``stop_at_step``, SIGTERM it (or call ``trigger``)."""
    (tmp / "progress.json").unlink(missing_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    stopped_at = None
    try:
        if stop_at_step is not None:
            while proc.poll() is None and progress(tmp).get("step", 0) < stop_at_step:
                assert time.monotonic() - start < timeout, "the job made no progress"
                time.sleep(0.005)
            stopped_at = time.monotonic()
            if trigger is not None:
                trigger()
            elif proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic()
    return Run(proc.returncode, output, end - start, stopped_at, end)


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, str(DIGITS), *args]


@contextmanager
def broker_asking(action: str, at_step: int | None,
                  **extra: object) -> Iterator[tuple[str, list[dict]]]:
    """A broker's heartbeat endpoint that answers ``{"action": action, **extra}`` to every
    heartbeat from the first one reporting ``at_step`` on (None: from the first heartbeat;
    nothing before): the agent's side of a resize (``resize``, ``nproc=N``) or of a stop
    (``checkpoint-exit``). Yields its URL and the heartbeats it took."""
    beats: list[dict] = []
    told = threading.Event()

    class Heartbeat(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            beat = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            beats.append(beat)
            if at_step is None or beat.get("step", -1) >= at_step:
                told.set()
            body = json.dumps({"action": action, **extra} if told.is_set() else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    with serve(Heartbeat) as url:
        yield url, beats
