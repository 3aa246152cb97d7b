"""Helpers that run the example jobs as real processes (agent, torchrun) with gloo on CPU."""

from __future__ import annotations

import importlib.util
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
from types import ModuleType

import torch

from tests.http_stub import serve

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "train_digits.py"
SYNTHETIC = ROOT / "examples" / "train_synthetic.py"
DCP_SCRIPT = ROOT / "examples" / "train_dcp.py"  # plain FSDP with its own DCP checkpoints


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
    stop_when: Callable[[], bool] | None = None, trigger: Callable[[], None] | None = None,
    timeout: float = 120,
) -> Run:
    """Run ``command``; once rank 0 reports ``stop_at_step`` (or ``stop_when()`` holds, for a
    script that reports no progress), SIGTERM it (or call ``trigger``)."""
    (tmp / "progress.json").unlink(missing_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    stopped_at = None
    try:
        if stop_at_step is not None or stop_when is not None:
            ready = stop_when or (lambda: progress(tmp).get("step", 0) >= stop_at_step)
            while proc.poll() is None and not ready():
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


def agent_command(*args: str, script: Path = DIGITS) -> list[str]:
    return [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, str(script), *args]


def load_module(script: Path) -> ModuleType:
    """An example script imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def max_abs_diff(a: Path, b: Path) -> float:
    """The largest difference between two saved state dicts with the same names."""
    sa, sb = torch.load(a), torch.load(b)
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def framework_job(script: Path, flags: list[str], batch: int) -> Callable[..., Run]:
    """``agent(tmp, nproc, *args, stop_at_step=None)``: ``script`` with ``flags`` and ``args``
    under the agent on ``nproc`` ranks at global batch ``batch``, checkpointing to ``tmp/ckpt``
    every 2 steps (stopped by SIGTERM once past ``stop_at_step``)."""

    def agent(tmp: Path, nproc: int, *extra: str, stop_at_step: int | None = None) -> Run:
        env = job_env(tmp, nproc=nproc, checkpoint_uri=tmp / "ckpt", global_batch_size=batch,
                      checkpoint_every_steps=2)
        return run_job(agent_command(*flags, *extra, script=script), env, tmp,
                       stop_at_step=stop_at_step, timeout=180)

    return agent


def final_state(agent: Callable[..., Run], tmp: Path) -> Path:
    """The state dict an uninterrupted run on 2 ranks ends with."""
    run = agent(tmp, 2, "--save-final", str(tmp / "final.pt"))
    assert run.code == 0, run.output
    return tmp / "final.pt"


def check_resumed_at_another_size(agent: Callable[..., Run], reference: Path, tmp_path: Path,
                                  before: int, after: int, steps: int, batch: int) -> None:
    """A framework's job under ``agent(tmp, nproc, *args, stop_at_step=)`` stopped at step 3
    on ``before`` ranks resumes on ``after`` from its latest checkpoint (periodic ones written
    on the way), ends where the uninterrupted run's ``reference`` state ends, and its last
    progress report says so."""
    first = agent(tmp_path, before, stop_at_step=3)
    assert first.code == 75, first.output
    manifests = [
        json.loads(p.read_text()) for p in (tmp_path / "ckpt").glob("step-*/MANIFEST.json")
    ]
    saved = max(manifests, key=lambda m: m["step"])
    assert 3 <= saved["step"] < steps and saved["world_size"] == before, saved
    assert any(m["step"] % 2 == 0 and m["step"] < saved["step"] for m in manifests)  # periodic
    assert saved["global_batch_size"] == batch, saved

    second = agent(tmp_path, after, "--save-final", str(tmp_path / "final.pt"))
    assert second.code == 0, second.output
    assert f"resumed from step {saved['step']} (written by {before} ranks)" in second.output
    diff = max_abs_diff(reference, tmp_path / "final.pt")
    assert diff <= 1e-5, diff
    report = progress(tmp_path)
    assert report["finished"] and report["step"] == steps and report["world_size"] == after
    assert report["samples_done"] == steps * batch and report["samples_per_sec"] > 0
    assert report["checkpoint_step"] == steps
    # what the agent reports from it: a resize restarts the workers, the batch splits evenly
    assert report["resize_generation"] is None and report["even_batch"] is True


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
