"""What a resize costs the demo job in training time: in place against checkpoint-and-relaunch.

The runtime's demo model (``examples/train_digits.py``, batch 24, gloo on CPU, one thread per
worker) runs under the agent, is resized at step 20 (grow 1 -> 2 workers, shrink 2 -> 1) and
trains on. Two ways, alternated within each repetition (the order flips every repetition).
A heartbeat endpoint on loopback answers the agent as the broker does:

- **in place**: the heartbeat reply says ``resize`` (``nproc``); the agent starts the new
  worker, which joins once past its imports, and the workers re-form the group at a step
  boundary (leaving workers exit);
- **checkpoint**: the reply says ``checkpoint-exit``; the workers checkpoint and exit, and a new
  agent starts the new number of workers, which resume from the checkpoint (what a resize
  costs without the in-place path, short of a node start).

Lost training: from rank 0's last step at the old size to its first step at the new size, less one
step at the new size (rank 0's progress file, written every step, polled every 2 ms). Node start,
the broker's reaction and setup are the same both ways and left out.

Knobs: FLEET_BENCH_REPEATS (3). Writes ``examples/results/resize.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.bench.results import measured, write
from tests.runtime.jobs import agent_command, broker_asking, job_env

AT_STEP = 20  # the resize is asked once rank 0 reported this step
AFTER = 20  # steps at the new size before the job is stopped
FLAGS = ["--steps", "1000000", "--batch-size", "24", "--lr", "0.05"]


class Timeline:
    """(time, step, world size) each time rank 0's progress file changes."""

    def __init__(self, path: Path) -> None:
        self.path, self.points = path, []  # type: ignore[var-annotated]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        last = None
        while not self._done.wait(0.002):
            try:
                p = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            key = (p.get("step"), p.get("world_size"))
            if key != last and None not in key:
                last = key
                self.points.append((time.monotonic(), *key))

    def steps_at(self, world: int) -> int:
        return sum(1 for _, _, w in self.points if w == world)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def lost(self, before: int, after: int) -> tuple[float, float]:
        """Seconds lost to the resize, and the median step time at the new size."""
        last_old = max(p for p in self.points if p[2] == before)
        new = [p for p in self.points if p[2] == after and p[1] > last_old[1]]
        steps = [b[0] - a[0] for a, b in itertools.pairwise(new) if b[1] == a[1] + 1]
        step = statistics.median(steps)
        return new[0][0] - last_old[0] - step, step


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(proc: subprocess.Popen[bytes], done, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the job ended or stalled (exit {proc.poll()})")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def resize(tmp: Path, before: int, after: int, in_place: bool) -> tuple[float, float]:
    """One resize of the demo job; (seconds lost, step seconds at the new size)."""
    ckpt, log = tmp / "ckpt", tmp / "job.log"
    command = agent_command(*FLAGS, "--checkpoint-dir", str(ckpt))
    timeline = Timeline(tmp / "progress.json")
    try:
        action, extra = ("resize", {"nproc": after}) if in_place else ("checkpoint-exit", {})
        with broker_asking(action, AT_STEP, **extra) as (url, _):
            env = job_env(tmp, nproc=before, heartbeat_interval=0.05, broker_url=url)
            proc = start(command, env, log)
            if in_place:
                done = f"resized in place to {after} workers"
                wait_for(
                    proc,
                    lambda: timeline.steps_at(after) > AFTER and done in log.read_text(),
                    "in place",
                )
                finish(proc)
            elif proc.wait(timeout=600) != 75:
                raise RuntimeError(f"checkpoint-exit ended with {proc.returncode}: {log}")
        if not in_place:
            proc = start(command, job_env(tmp, nproc=after), log)
            wait_for(proc, lambda: timeline.steps_at(after) > AFTER, "relaunch")
            finish(proc)
    finally:
        timeline.stop()
    return timeline.lost(before, after)


def main() -> None:
    repeats = int(os.environ.get("FLEET_BENCH_REPEATS", "3"))
    cases = {"grow": (1, 2), "shrink": (2, 1)}
    lost: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    for rep in range(repeats):
        for case, (before, after) in cases.items():
            for in_place in (True, False) if rep % 2 == 0 else (False, True):
                way = "in place" if in_place else "checkpoint"
                with tempfile.TemporaryDirectory(prefix="fleet-bench-resize-") as tmp:
                    seconds, step = resize(Path(tmp), before, after, in_place)
                lost.setdefault(f"{case} {before}->{after} {way}", []).append(seconds)
                steps.setdefault(f"{case} step", []).append(step)
                print(
                    f"{case} {before}->{after} {way}: {seconds:.2f} s lost "
                    f"(step {step * 1e3:.0f} ms)",
                    flush=True,
                )
    numbers = {f"lost training, {k}": measured(v, "s") for k, v in lost.items()}
    for case, (before, after) in cases.items():
        ratios = [
            c / max(i, 1e-3)
            for i, c in zip(
                lost[f"{case} {before}->{after} in place"],
                lost[f"{case} {before}->{after} checkpoint"],
                strict=True,
            )
        ]
        numbers[f"checkpoint / in place, {case}"] = measured(ratios, "x")
        numbers[f"step at the new size, {case}"] = measured(steps[f"{case} step"], "ms", 1e3)
    write(
        "resize",
        {
            "model": "examples/train_digits.py (digits convnet), batch 24",
            "workers": "gloo on CPU, OMP_NUM_THREADS=1",
            "python": sys.version.split()[0],
            "resize asked at step": AT_STEP,
            "repetitions": repeats,
        },
        numbers,
    )


if __name__ == "__main__":
    main()
