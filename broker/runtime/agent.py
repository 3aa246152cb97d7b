"""The node agent: runs a job's workers, streams their logs, sends heartbeats, stops them cleanly.

``python -m broker.runtime.agent [options] -- CMD ARGS...``; the contract (environment, heartbeat,
exit codes) is in :mod:`broker.runtime`. Standard library only: it starts fast and needs no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from broker.runtime.assignment import (
    EXIT_FINISHED,
    EXIT_STOPPED,
    AssignmentError,
    env_float,
    env_int,
)
from broker.runtime.notices import pollers

EXIT_USAGE = 2
EXIT_FAILED = 1


def log(message: str) -> None:
    sys.stderr.write(f"[agent] {message}\n")
    sys.stderr.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class AgentConfig:
    job_id: str
    attempt: int
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    grace_period: float
    heartbeat_interval: float
    notice_interval: float
    broker_url: str | None
    token: str | None
    notice_urls: tuple[str | None, str | None, str | None]


def parse(argv: Sequence[str], env: dict[str, str]) -> tuple[AgentConfig, list[str]]:
    """Options (which win) and FLEET_* variables -> config; the words after ``--``: the command."""
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise AssignmentError(
            "no command: use python -m broker.runtime.agent [options] -- CMD ARGS..."
        )
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m broker.runtime.agent", description=__doc__)
    p.add_argument("--job-id", default=env.get("FLEET_JOB_ID") or "local")
    p.add_argument("--attempt", type=int, default=env_int(env, "FLEET_ATTEMPT", 0))
    p.add_argument("--nproc", type=int, default=env_int(env, "FLEET_NPROC", 1, minimum=1))
    p.add_argument("--nnodes", type=int, default=env_int(env, "FLEET_NNODES", 1, minimum=1))
    p.add_argument("--node-rank", type=int, default=env_int(env, "FLEET_NODE_RANK", 0))
    p.add_argument("--master-addr", default=env.get("FLEET_MASTER_ADDR") or "127.0.0.1")
    p.add_argument(
        "--master-port", type=int, default=env_int(env, "FLEET_MASTER_PORT", None, minimum=1)
    )
    p.add_argument("--grace-period", type=float, default=env_float(env, "FLEET_GRACE_PERIOD", 25.0))
    p.add_argument(
        "--heartbeat-interval", type=float, default=env_float(env, "FLEET_HEARTBEAT_INTERVAL", 5.0)
    )
    p.add_argument(
        "--notice-interval", type=float, default=env_float(env, "FLEET_NOTICE_INTERVAL", 5.0)
    )
    p.add_argument("--broker-url", default=env.get("FLEET_BROKER_URL") or None)
    opts = p.parse_args(argv[:split])
    if opts.nproc < 1 or opts.nnodes < 1:
        raise AssignmentError("--nproc and --nnodes (FLEET_NPROC, FLEET_NNODES) must be at least 1")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise AssignmentError(
            f"FLEET_NODE_RANK={opts.node_rank} must be below FLEET_NNODES={opts.nnodes}"
        )
    if opts.master_port is None:
        if opts.nnodes > 1:
            raise AssignmentError("FLEET_MASTER_PORT is required when FLEET_NNODES > 1")
        opts.master_port = free_port()
    config = AgentConfig(
        job_id=opts.job_id,
        attempt=opts.attempt,
        nproc=opts.nproc,
        nnodes=opts.nnodes,
        node_rank=opts.node_rank,
        master_addr=opts.master_addr,
        master_port=opts.master_port,
        grace_period=opts.grace_period,
        heartbeat_interval=max(opts.heartbeat_interval, 0.05),
        notice_interval=max(opts.notice_interval, 0.05),
        broker_url=opts.broker_url.rstrip("/") if opts.broker_url else None,
        token=env.get("FLEET_AGENT_TOKEN") or None,
        notice_urls=(
            env.get("FLEET_NOTICE_AWS_URL") or None,
            env.get("FLEET_NOTICE_GCP_URL") or None,
            env.get("FLEET_NOTICE_AZURE_URL") or None,
        ),
    )
    return config, argv[split + 1 :]


class Agent:
    """One node's share of a job: FLEET_NPROC workers and the watchers around them."""

    def __init__(self, config: AgentConfig, command: list[str], env: dict[str, str]) -> None:
        self.config = config
        self.command = command
        self.env = env
        self.workdir = Path(tempfile.mkdtemp(prefix="fleet-agent-"))
        # The broker may choose where progress goes; by default it stays in the agent's folder.
        self.progress_file = Path(env.get("FLEET_PROGRESS_FILE") or self.workdir / "progress.json")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stop_reason: str | None = None
        self.notice: str | None = None  # the node's preemption notice, once it came
        self._stop = threading.Event()
        self._done = threading.Event()
        self._out_lock = threading.Lock()
        self.state = "running"

    # ---- workers ----------------------------------------------------------------------------
    def worker_env(self, local_rank: int) -> dict[str, str]:
        c = self.config
        # The job's code needs no token: heartbeats are the agent's alone.
        env = {k: v for k, v in self.env.items() if k != "FLEET_AGENT_TOKEN"}
        env.update(
            {
                "RANK": str(c.node_rank * c.nproc + local_rank),
                "WORLD_SIZE": str(c.nnodes * c.nproc),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(c.nproc),
                "GROUP_RANK": str(c.node_rank),
                "MASTER_ADDR": c.master_addr,
                "MASTER_PORT": str(c.master_port),
                "FLEET_JOB_ID": c.job_id,
                "FLEET_ATTEMPT": str(c.attempt),
                "FLEET_NPROC": str(c.nproc),
                "FLEET_NNODES": str(c.nnodes),
                "FLEET_NODE_RANK": str(c.node_rank),
                "FLEET_PROGRESS_FILE": str(self.progress_file),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if c.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: no oversubscribed cores
        return env

    def _pump(self, rank: int, stream: IO[bytes], sink: IO[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        for line in iter(stream.readline, b""):
            with self._out_lock:
                sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                sink.flush()
        stream.close()

    def start_workers(self) -> list[threading.Thread]:
        pumps = []
        for local_rank in range(self.config.nproc):
            rank = self.config.node_rank * self.config.nproc + local_rank
            proc = subprocess.Popen(
                self.command,
                env=self.worker_env(local_rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self.procs.append(proc)
            for stream, sink in (
                (proc.stdout, sys.stdout.buffer),
                (proc.stderr, sys.stderr.buffer),
            ):
                t = threading.Thread(target=self._pump, args=(rank, stream, sink), daemon=True)
                t.start()
                pumps.append(t)
        return pumps

    def signal_workers(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    # ---- watchers ---------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def progress(self) -> dict[str, Any]:
        try:
            return json.loads(self.progress_file.read_text())
        except (OSError, ValueError):
            return {}

    def heartbeat(self, state: str, exit_code: int | None = None) -> dict[str, Any]:
        c = self.config
        p = self.progress()
        body = {
            "job_id": c.job_id,
            "attempt": c.attempt,
            "node_rank": c.node_rank,
            "state": state,
            "step": p.get("step", 0),
            "samples_done": p.get("samples_done", 0),
            "samples_per_sec": p.get("samples_per_sec", 0.0),
            "world_size": p.get("world_size", c.nnodes * c.nproc),
            "global_batch_size": p.get("global_batch_size"),
            "checkpoint_step": p.get("checkpoint_step"),
            "checkpoint_bytes": p.get("checkpoint_bytes"),
        }
        if self.notice:
            body["notice"] = self.notice
        if exit_code is not None:
            body["exit_code"] = exit_code
        headers = {"Content-Type": "application/json"}
        if c.token:
            headers["Authorization"] = f"Bearer {c.token}"
        request = urllib.request.Request(
            f"{c.broker_url}/v1/agent/heartbeat",
            data=json.dumps(body).encode(),
            headers=headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                reply = json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            log(f"heartbeat failed: {exc}")
            return {}
        return reply if isinstance(reply, dict) else {}

    def _every(self, interval: float, action: Callable[[], None]) -> None:
        while not self._done.wait(interval):
            action()

    def _beat(self) -> None:
        reply = self.heartbeat("stopping" if self._stop.is_set() else "running")
        if reply.get("action") == "checkpoint-exit":
            self.request_stop("broker asked for checkpoint-exit")

    def _poll_notices(self, checks: list[Callable[[], str | None]]) -> None:
        for check in checks:
            reason = check()
            if reason and self.notice is None:
                self.notice = reason
                self.request_stop(f"preemption notice: {reason}")
                if self.config.broker_url:  # tell the broker now: it blocks the location
                    self._beat()

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> int:
        c = self.config
        signal.signal(signal.SIGTERM, lambda s, _: self.request_stop(signal.Signals(s).name))
        signal.signal(signal.SIGINT, lambda s, _: self.request_stop(signal.Signals(s).name))
        signal.signal(signal.SIGUSR1, lambda *_: self.signal_workers(signal.SIGUSR1))
        log(
            f"job {c.job_id} attempt {c.attempt}: node {c.node_rank}/{c.nnodes}, "
            f"{c.nproc} workers, "
            f"master {c.master_addr}:{c.master_port}: {' '.join(self.command)}"
        )
        try:
            pumps = self.start_workers()
        except OSError as exc:
            log(f"cannot start {self.command[0]!r}: {exc}")
            return EXIT_USAGE
        watchers = []
        checks = pollers(*c.notice_urls)
        if checks:
            watchers.append(
                threading.Thread(
                    target=self._every,
                    args=(c.notice_interval, lambda: self._poll_notices(checks)),
                    daemon=True,
                )
            )
        if c.broker_url:
            watchers.append(
                threading.Thread(
                    target=self._every, args=(c.heartbeat_interval, self._beat), daemon=True
                )
            )
        for w in watchers:
            w.start()
        code = self._supervise()
        self._done.set()
        for t in pumps:
            t.join(timeout=5)
        self.state = {EXIT_FINISHED: "finished", EXIT_STOPPED: "stopped"}.get(code, "failed")
        if c.broker_url:
            self.heartbeat(self.state, exit_code=code)
        log(f"{self.state} (exit {code})" + (f": {self.stop_reason}" if self.stop_reason else ""))
        shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def _supervise(self) -> int:
        deadline: float | None = None
        failed: int | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if self._stop.is_set() and deadline is None:
                log(f"stopping: {self.stop_reason}; workers have {self.config.grace_period:g} s")
                deadline = time.monotonic() + self.config.grace_period
                self.signal_workers(signal.SIGTERM)
            bad = [x for x in codes if x is not None and not self._clean(x)]
            if bad and failed is None:
                failed = bad[0]
                log(f"a worker failed with exit code {failed}; stopping the others")
                self.request_stop(f"worker exit code {failed}")
                continue
            if all(x is not None for x in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                log("workers did not stop within the grace period; killing them")
                self.signal_workers(signal.SIGKILL)
                for p in self.procs:
                    p.wait()
                return EXIT_FAILED
            time.sleep(0.05)
        if failed is not None:
            return failed if failed > 0 else 128 - failed
        codes = [p.returncode for p in self.procs]
        return EXIT_FINISHED if all(x == EXIT_FINISHED for x in codes) else EXIT_STOPPED

    def _clean(self, code: int) -> bool:
        # A worker the stop's SIGTERM reached before the library installed its handler had not
        # trained past the checkpoint it restored from, so it stopped cleanly too.
        return code in (EXIT_FINISHED, EXIT_STOPPED) or (
            self._stop.is_set() and code == -signal.SIGTERM
        )


def main(argv: Sequence[str] | None = None) -> int:
    env = dict(os.environ)
    try:
        config, command = parse(sys.argv[1:] if argv is None else argv, env)
    except AssignmentError as exc:
        log(f"error: {exc}")
        return EXIT_USAGE
    return Agent(config, command, env).run()


if __name__ == "__main__":
    sys.exit(main())
