"""The node agent: runs a job's workers, streams their logs, sends heartbeats, stops them cleanly.

``python -m broker.runtime.agent [options] -- CMD ARGS...``; the contract (environment, heartbeat,
exit codes) is in :mod:`broker.runtime`, its names in :mod:`broker.protocol`. Standard library,
pydantic and ``tenacity`` only: it starts fast and needs no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay
from tenacity.wait import wait_exponential, wait_random

from broker.protocol import (
    CHECKPOINT_EXIT,
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_STOPPED,
    EXIT_USAGE,
    HEARTBEAT_PATH,
    PROGRESS_FIELDS,
    RENDEZVOUS_PATH,
    RESIZE,
    SECRETS_PATH,
    Env,
)
from broker.runtime import container, failure, integrations
from broker.runtime.assignment import AssignmentError, env_float, env_int
from broker.runtime.files import FilesError, files_of, files_root, node_path, place
from broker.runtime.notices import pollers
from broker.runtime.plain_checkpoints import Committed, PlainCheckpoints
from policies.models import check_image

# How long the final report is tried (FLEET_REPORT_TIMEOUT), with exponential backoff from
# FINAL_REPORT_FIRST_WAIT_S up to FLEET_REPORT_MAX_WAIT between tries, jittered: every broker
# down at once (a failover, Redis away: 503, a rate limit: 429, a network blip) must not lose
# how the node ended and its last progress, which settle the job.
FINAL_REPORT_TIMEOUT_S = 1800.0
FINAL_REPORT_FIRST_WAIT_S = 0.5
FINAL_REPORT_MAX_WAIT_S = 15.0
# Longer than the broker's launch deadline (BrokerConfig.launch_deadline_s, 1200 s): the broker,
# not a survivor waiting for it, decides that a stand-in is not coming (and replaces it again).
RENDEZVOUS_TIMEOUT_S = 1800.0
# Workers that wrote no progress file this long after they started are a plain script's (torch's
# import and a first step fit well within it on a loaded machine).
PROGRESS_GRACE_S = 120.0
# The agent's own: never in its workers' environment.
SECRET_ENV = (Env.AGENT_TOKEN, Env.AGENT_TOKEN_FILE, Env.AGENT_TOKEN_FD)


def log(message: str) -> None:
    sys.stderr.write(f"[agent] {message}\n")
    sys.stderr.flush()


def free_port(host: str = "127.0.0.1", avoid: int = 0) -> int:
    """A port free on ``host`` ("" = all interfaces) other than ``avoid``."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


def local_ip(url: str) -> str:
    """This machine's address on the route toward ``url``'s host (a UDP connect sends nothing;
    it only picks the route and so the source address)."""
    parts = urllib.parse.urlsplit(url)
    family, _, _, _, where = socket.getaddrinfo(parts.hostname, parts.port or 80,
                                                type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(where)
        return s.getsockname()[0]


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass
class AgentConfig:
    job_id: str
    attempt: int
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str | None  # None: found each round through the broker's rendezvous
    master_port: int | None
    grace_period: float
    heartbeat_interval: float
    notice_interval: float
    broker_url: str | None  # the first of broker_urls
    token: str | None
    notice_urls: tuple[str | None, str | None, str | None]
    round: int = 0
    node_addr: str | None = None
    rendezvous_poll: float = 1.0
    rendezvous_timeout: float = RENDEZVOUS_TIMEOUT_S
    rejoin_timeout: float = 120.0
    launch_key: str | None = None  # this node's idempotency key: whose rank it holds
    accelerator: str | None = None  # the node's type: the broker keys measurements by it
    # Every broker replica's URL (FLEET_BROKER_URL, comma-separated): any of them takes reports
    broker_urls: tuple[str, ...] = ()
    report_timeout: float = FINAL_REPORT_TIMEOUT_S
    report_max_wait: float = FINAL_REPORT_MAX_WAIT_S
    # FLEET_PER_NODE=1 (a SkyPilot task): one process per node runs the command, with SkyPilot's
    # per-node variables; it starts its own per-GPU processes (torchrun) if it wants them.
    per_node: bool = False
    progress_grace: float = PROGRESS_GRACE_S

    @property
    def rendezvous(self) -> bool:
        """Does this node find its master (and re-form the group) through the broker?"""
        return self.master_addr is None


def parse(argv: Sequence[str], env: dict[str, str]) -> tuple[AgentConfig, list[str]]:
    """Options (which win) and FLEET_* variables -> config; the words after ``--``: the command."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    if split >= len(argv) - 1 and not {"-h", "--help"} & set(argv[:split]):
        raise AssignmentError(
            "no command: use python -m broker.runtime.agent [options] -- CMD ARGS..."
        )
    p = argparse.ArgumentParser(prog="python -m broker.runtime.agent", description=__doc__,
                                usage="%(prog)s [options] -- CMD ARGS...")
    p.add_argument("--job-id", default=env.get(Env.JOB_ID) or "local")
    p.add_argument("--attempt", type=int, default=env_int(env, Env.ATTEMPT, 0))
    p.add_argument("--round", type=int, default=env_int(env, Env.ROUND, 0))
    p.add_argument("--nproc", type=int, default=env_int(env, Env.NPROC, 1, minimum=1))
    p.add_argument("--nnodes", type=int, default=env_int(env, Env.NNODES, 1, minimum=1))
    p.add_argument("--node-rank", type=int, default=env_int(env, Env.NODE_RANK, 0))
    p.add_argument("--master-addr", default=env.get(Env.MASTER_ADDR) or None)
    p.add_argument(
        "--master-port", type=int, default=env_int(env, Env.MASTER_PORT, None, minimum=1)
    )
    p.add_argument("--grace-period", type=float, default=env_float(env, Env.GRACE_PERIOD, 25.0))
    p.add_argument(
        "--heartbeat-interval", type=float, default=env_float(env, Env.HEARTBEAT_INTERVAL, 5.0)
    )
    p.add_argument(
        "--notice-interval", type=float, default=env_float(env, Env.NOTICE_INTERVAL, 5.0)
    )
    p.add_argument("--broker-url", default=env.get(Env.BROKER_URL) or None,
                   help="the broker's URL, or every replica's, comma-separated")
    opts = p.parse_args(argv[:split])  # --help prints the options and exits 0
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in (opts.broker_url or "").split(",")
                               if u.strip()))
    opts.broker_url = urls[0] if urls else None
    if opts.nproc < 1 or opts.nnodes < 1:
        raise AssignmentError(
            f"--nproc and --nnodes ({Env.NPROC}, {Env.NNODES}) must be at least 1")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise AssignmentError(
            f"{Env.NODE_RANK}={opts.node_rank} must be below {Env.NNODES}={opts.nnodes}"
        )
    if opts.round < 0:
        raise AssignmentError(f"{Env.ROUND}={opts.round} is negative; set it to 0 or more")
    if opts.nnodes > 1 and opts.master_addr is None and not opts.broker_url:
        raise AssignmentError(
            f"{Env.NNODES}={opts.nnodes} needs a master: set {Env.MASTER_ADDR} and "
            f"{Env.MASTER_PORT} (--master-addr, --master-port), or {Env.BROKER_URL} "
            "(--broker-url) to meet the other nodes through the broker's rendezvous"
        )
    if opts.nnodes == 1 or opts.master_addr is not None:  # the master is known now
        opts.master_addr = opts.master_addr or "127.0.0.1"
        if opts.master_port is None:
            if opts.nnodes > 1:
                raise AssignmentError(
                    f"{Env.MASTER_PORT} is required with {Env.MASTER_ADDR} when "
                    f"{Env.NNODES} > 1"
                )
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
        broker_url=opts.broker_url,
        broker_urls=urls,
        token=env.get(Env.AGENT_TOKEN) or None,
        notice_urls=(
            env.get(Env.NOTICE_AWS_URL) or None,
            env.get(Env.NOTICE_GCP_URL) or None,
            env.get(Env.NOTICE_AZURE_URL) or None,
        ),
        round=opts.round,
        node_addr=env.get(Env.NODE_ADDR, "").strip() or None,
        rendezvous_poll=max(env_float(env, Env.RENDEZVOUS_POLL, 1.0), 0.05),  # type: ignore[type-var]
        rendezvous_timeout=env_float(env, Env.RENDEZVOUS_TIMEOUT,  # type: ignore[arg-type]
                                     RENDEZVOUS_TIMEOUT_S),
        rejoin_timeout=env_float(env, Env.REJOIN_TIMEOUT, 120.0),  # type: ignore[arg-type]
        launch_key=env.get(Env.LAUNCH_KEY, "").strip() or None,
        accelerator=env.get(Env.ACCELERATOR, "").strip() or None,
        report_timeout=env_float(env, Env.REPORT_TIMEOUT,  # type: ignore[arg-type]
                                 FINAL_REPORT_TIMEOUT_S),
        report_max_wait=max(env_float(env, Env.REPORT_MAX_WAIT,  # type: ignore[type-var]
                                      FINAL_REPORT_MAX_WAIT_S), 0.01),
        per_node=env.get(Env.PER_NODE, "").strip() == "1",
        progress_grace=max(env_float(env, Env.PROGRESS_GRACE,  # type: ignore[type-var]
                                     PROGRESS_GRACE_S), 0.0),
    )
    return config, argv[split + 1 :]


class Agent:
    """One node's share of a job: FLEET_NPROC workers and the watchers around them. In
    rendezvous mode it runs them round after round: a round's group forms at the broker, and a
    new round (a lost node replaced) starts new workers on this same node."""

    def __init__(self, config: AgentConfig, command: list[str], env: dict[str, str]) -> None:
        self.config = config
        self.command = command
        self.env = env
        self.cpu_only = env.get(Env.CPU_ONLY) == "1"  # placed on a CPU node: no GPU is shown
        self.workdir = Path(tempfile.mkdtemp(prefix="fleet-agent-"))
        # The broker may choose where progress goes; by default it stays in the agent's folder.
        self.progress_file = Path(env.get(Env.PROGRESS_FILE) or self.workdir / "progress.json")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stop_reason: str | None = None  # why the agent itself stops
        self.halt_reason: str | None = None  # why the last round's workers were stopped
        self.notice: str | None = None  # the node's preemption notice, once it came
        self._stop = threading.Event()
        self._done = threading.Event()
        self._out_lock = threading.Lock()
        self._round_lock = threading.Lock()
        self.state = "running"
        # The current round's group; the rendezvous fills it in before each round. ``round`` is
        # the round this node is in, joined or still forming (reports carry it).
        self.round = config.round
        self.nnodes = config.nnodes
        self.master = (config.master_addr or "", config.master_port or 0)
        # Every node's host by rank (SKYPILOT_NODE_IPS): this one alone until a rendezvous
        # names the group's.
        self.hosts = [config.node_addr or (config.master_addr if config.nnodes == 1 else None)
                      or "127.0.0.1"]
        self.broker_round = config.round  # the highest round the broker has named
        # The brokers reports go to, the one that last took one first
        self.brokers = list(config.broker_urls or filter(None, [config.broker_url]))
        self.cwd: Path | None = None  # where workers start: the job's workdir, if it has one
        self._brokers_lock = threading.Lock()
        self._workers_since: float | None = None  # when this agent first started workers
        self._resumable: bool | None = None  # once the progress file said so
        # A script without the runtime may commit its own DCP checkpoints under the job's URI;
        # only node rank 0 looks, as only its reports carry the job's progress.
        uri = env.get(Env.CHECKPOINT_URI, "").strip()
        self.plain = PlainCheckpoints(uri, log) if uri and config.node_rank == 0 else None
        # Resizes (the broker's ``resize`` action): the size asked for, the in-place resizes
        # done, and whether the workers are being restarted at a new size instead.
        self.resize_to: int | None = None
        self.generation = 0
        self.resize_timeout = env_float(env, Env.RESIZE_TIMEOUT, 60.0) or 60.0
        self._restart = False
        self._started_at = time.monotonic()  # when this round's workers started
        # The job's container image (FLEET_CONTAINER_IMAGE): its workers run inside it, each
        # under a container name of its own (by the docker client's pid), which a stop targets.
        self.image = env.get(Env.CONTAINER_IMAGE, "").strip() or None
        self.containers: dict[int, str] = {}
        self._helpers: list[subprocess.Popen[bytes]] = []  # docker stop / kill in flight

    # ---- workers ----------------------------------------------------------------------------
    def worker_env(self, local_rank: int) -> dict[str, str]:
        c = self.config
        # The job's code needs no token: heartbeats are the agent's alone.
        env = {k: v for k, v in self.env.items() if k not in SECRET_ENV}
        if env.get(Env.INTEGRATIONS, "on") != "off":
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(integrations.BOOT_DIR), env.get("PYTHONPATH")])
            )
        if c.per_node:
            return {**env, **self.node_env()}
        env.update(
            {
                "RANK": str(c.node_rank * c.nproc + local_rank),
                "WORLD_SIZE": str(self.nnodes * c.nproc),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(c.nproc),
                **self._node_vars(),
            }
        )
        if c.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: no oversubscribed cores
        env[Env.RESIZE_FILE] = str(self.workdir / "resize.json")
        return env

    def _node_vars(self) -> dict[str, str]:
        """What every process the agent starts sees of the node and the round."""
        c = self.config
        return {
            "GROUP_RANK": str(c.node_rank),
            "MASTER_ADDR": self.master[0],
            "MASTER_PORT": str(self.master[1]),
            Env.JOB_ID: c.job_id,
            Env.ATTEMPT: str(c.attempt),
            Env.ROUND: str(self.round),
            Env.NPROC: str(c.nproc),
            Env.NNODES: str(self.nnodes),
            Env.NODE_RANK: str(c.node_rank),
            Env.PROGRESS_FILE: str(self.progress_file),
            failure.ERROR_ENV: str(self.workdir / "error"),
            "PYTHONUNBUFFERED": "1",
            # a CPU job is never given a GPU, even on a machine that has one
            **({"CUDA_VISIBLE_DEVICES": ""} if self.cpu_only else {}),
        }

    def node_env(self) -> dict[str, str]:
        """The one per-node process's: FleetBroker's node variables and SkyPilot's (setup and run
        see the same rank and IPs: one process runs both)."""
        c = self.config
        ips = "\n".join(self.hosts)
        return {
            **self._node_vars(),
            "SKYPILOT_NODE_RANK": str(c.node_rank),
            "SKYPILOT_SETUP_NODE_RANK": str(c.node_rank),
            "SKYPILOT_NODE_IPS": ips,
            "SKYPILOT_SETUP_NODE_IPS": ips,
            "SKYPILOT_NUM_NODES": str(self.nnodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": "0" if self.cpu_only else str(c.nproc),
        }

    def _pump(self, rank: int, stream: IO[bytes], sink: IO[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        for line in iter(stream.readline, b""):
            with self._out_lock:
                sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                sink.flush()
        stream.close()

    def start_workers(self) -> list[threading.Thread]:
        self.procs = []
        pumps = []
        if self._workers_since is None:
            self._workers_since = time.monotonic()
        with contextlib.suppress(OSError):  # a cause named in an earlier round is not this one's
            (self.workdir / "error").unlink()
        with contextlib.suppress(OSError):  # nor a resize order, which new workers must not obey
            (self.workdir / "resize.json").unlink()
        self._started_at = time.monotonic()
        for local_rank in range(1 if self.config.per_node else self.config.nproc):
            self.procs.append(self._spawn(local_rank, {}, pumps))
        return pumps

    def _spawn(self, local_rank: int, extra: dict[str, str],
               pumps: list[threading.Thread]) -> subprocess.Popen[bytes]:
        """Start one worker (its environment plus ``extra``); its output pumps join ``pumps``."""
        rank = self.config.node_rank * self.config.nproc + local_rank
        env = {**self.worker_env(local_rank), **extra}
        argv, name = self.command, None
        if self.image:  # the docker client runs it in the image; env passes by name only
            name = container.container_name(self.config.job_id, self.config.attempt, rank,
                                            secrets.token_hex(4))
            argv = container.run_argv(self.image, name, self.command, env,
                                      volumes=self._volumes(), cwd=self.cwd,
                                      gpus=not self.cpu_only and container.node_has_gpus())
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd=self.cwd,
        )
        for stream, sink in (
            (proc.stdout, sys.stdout.buffer),
            (proc.stderr, sys.stderr.buffer),
        ):
            t = threading.Thread(target=self._pump, args=(rank, stream, sink), daemon=True)
            t.start()
            pumps.append(t)
        if name:
            self.containers[proc.pid] = name
        return proc

    def _volumes(self) -> list[Path]:
        """What the container sees at the host's paths: the agent's folder (progress and error
        files), the node's home for the job's files, the workdir, each file mount, and a local
        checkpoint folder."""
        root = files_root(self.env)
        out = [self.workdir, root, *([self.cwd] if self.cwd else [])]
        for mount in (files_of(self.env) or {}).get("mounts", []):
            out.append(node_path(mount["path"], root))
        checkpoint = urllib.parse.urlsplit(self.env.get(Env.CHECKPOINT_URI, ""))
        if checkpoint.scheme in ("", "file") and checkpoint.path.startswith("/"):
            Path(checkpoint.path).mkdir(parents=True, exist_ok=True)
            out.append(Path(checkpoint.path))
        return [p for p in out if p.exists()]

    def signal_workers(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                if proc.pid in self.containers:
                    self._signal_container(proc, sig)
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def _signal_container(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        """A signal to a container worker goes to the container, not to its docker client
        (which does not forward it, and whose end would leave the container running): SIGTERM
        is ``docker stop`` with the grace period (its SIGKILL follows on its own), SIGKILL is
        ``docker kill`` and then the client's end, any other signal ``docker kill --signal``."""
        name = self.containers[proc.pid]
        if sig == signal.SIGKILL:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(container.signal_argv(name, "KILL"), timeout=30,
                               stdin=subprocess.DEVNULL, capture_output=True, check=False)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        argv = container.stop_argv(name, self.config.grace_period) if sig == signal.SIGTERM \
            else container.signal_argv(name, signal.Signals(sig).name.removeprefix("SIG"))
        with contextlib.suppress(OSError):  # it blocks up to the grace period: not waited on
            self._helpers.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))

    def check_container(self) -> int | None:
        """A job with a container image never runs on the host: None when this node can run
        it, else the exit code, the cause (no Docker, or an image that is no reference) left
        for the final report."""
        if self.image is None:
            return None
        try:
            check_image(self.image)
            why = container.unusable()
        except ValueError as exc:
            why = f"{Env.CONTAINER_IMAGE}: {exc}"
        if why is None:
            return None
        text = f"the job runs in the container image {self.image[:200]!r}, and this node " \
               f"cannot run it: {why}"
        log(text)
        failure.report(text, {failure.ERROR_ENV: str(self.workdir / "error")})
        return EXIT_FAILED

    # ---- resizes ------------------------------------------------------------------------------
    def request_resize(self, nproc: int) -> None:
        """Run ``nproc`` workers from now on (the broker's ``resize``); the supervising loop
        carries it out between its checks."""
        if nproc >= 1 and nproc != self.config.nproc:
            self.resize_to = nproc

    def _resize(self) -> None:
        """Carry out the resize asked for: in place where the workers run the runtime (one node,
        one worker per GPU), else, or when that fails, by restarting them from a checkpoint."""
        c, n = self.config, self.resize_to
        if n is None or n == c.nproc:
            self.resize_to = None
            return
        # Workers run the runtime if rank 0's progress says so, or, for a grow, if the new
        # worker says it is ready (it imported the runtime) within FLEET_RESIZE_TIMEOUT.
        progress = self.progress()
        young = time.monotonic() - self._started_at < self.resize_timeout
        if not progress and n < c.nproc and young:
            return  # no progress yet: a shrink waits for it
        self.resize_to = None
        why = self.not_in_place(progress, grow=n > c.nproc)
        if why is None:
            began = time.monotonic()
            why = self._resize_in_place(n)
            if why is None:
                log(f"resized in place to {n} workers in {time.monotonic() - began:.2f} s")
                return
            if all(p.poll() == EXIT_FINISHED for p in self.procs):
                log(f"resize to {n} workers: not needed, the job finished meanwhile")
                return
        log(f"resize to {n} workers: {why}; restarting them from a checkpoint")
        c.nproc, self._restart = n, True

    def not_in_place(self, progress: dict[str, Any], grow: bool = False) -> str | None:
        """Why a resize cannot keep the workers' processes, or None where it can: one node, one
        worker per GPU, and workers that run the runtime's own loop (rank 0's ``progress``
        has ``resize_generation``; before any progress, a grow tries: the new worker says
        whether it runs the runtime by getting ready in time)."""
        if self.nnodes > 1:
            return "a multi-node job"
        if self.config.per_node:
            return "one process per node"
        if progress.get("resize_generation") is None and (progress or not grow):
            return ("the workers cannot resize in place (not the runtime's own loop, or a "
                    "sharded model)")
        return None

    def _resize_in_place(self, n: int) -> str | None:
        """Grow: start the new workers, wait until they are past their imports, then order
        everyone to re-form the group; shrink: order it, the extra workers leave. None when the
        group runs at ``n`` (rank 0 says so in its progress), else why not."""
        c, old = self.config, self.config.nproc
        generation, port = self.generation + 1, free_port(avoid=self.master[1])
        deadline = time.monotonic() + self.resize_timeout
        joiners: list[subprocess.Popen[bytes]] = []
        pumps: list[threading.Thread] = []
        ready = [self.workdir / f"ready-{generation}-{r}" for r in range(old, n)]
        for r, path in zip(range(old, n), ready, strict=True):
            joiners.append(self._spawn(r, {
                "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1"),
                Env.RESIZE_JOIN: str(generation), Env.RESIZE_READY: str(path)}, pumps))

        def failed() -> str | None:
            if self._stop.is_set():
                return "the agent is stopping"
            if any(p.poll() not in (None, EXIT_STOPPED) for p in [*self.procs, *joiners]):
                return "a worker ended during the resize"
            if time.monotonic() > deadline:
                return f"not done within {self.resize_timeout:g} s ({Env.RESIZE_TIMEOUT})"
            return None

        def undo(why: str) -> str:
            for p in joiners:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return why

        while not all(p.exists() for p in ready):
            if why := failed():
                return undo(why)
            time.sleep(0.01)
        order = {"generation": generation, "world_size": n, "master_addr": self.master[0],
                 "master_port": port}
        tmp = self.workdir / "resize.json.tmp"
        tmp.write_text(json.dumps(order))
        os.replace(tmp, self.workdir / "resize.json")  # the workers look for it every step
        while True:
            p = self.progress()
            leavers = self.procs[n:]
            if p.get("resize_generation") == generation and p.get("world_size") == n and \
                    all(x.poll() is not None for x in leavers):
                break
            if why := failed():
                if all(x.poll() == EXIT_FINISHED for x in self.procs):
                    return undo("the job finished")  # before it saw the order
                # The group may be half re-formed: the restart from a checkpoint follows.
                self.procs.extend(joiners)
                return why
            time.sleep(0.01)
        self.procs = [*self.procs[:n], *joiners]
        c.nproc, self.master, self.generation = n, (self.master[0], port), generation
        return None

    # ---- the broker ---------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def progress(self) -> dict[str, Any]:
        try:
            return json.loads(self.progress_file.read_text())
        except (OSError, ValueError):
            return {}

    def resumable(self, progress: dict[str, Any], ended: bool = False,
                  committed: Committed | None = None) -> bool | None:
        """Does a move resume this job where it stopped? True once its workers wrote the
        progress file (the runtime, or a framework integration, does) with checkpoints on, or,
        without the file, once the script ``committed`` a DCP checkpoint of its own; False
        once they ran FLEET_PROGRESS_GRACE seconds, or ``ended``, with neither (a plain
        script: a move restarts it from the beginning); None while it cannot tell.
        ``progress``: the progress file's record."""
        if progress:
            self._resumable = bool(progress.get("resumable", True))
        if self._resumable is not None:
            return self._resumable
        if committed is not None:
            return True
        since = self._workers_since
        if ended and since is not None:
            return False
        if since is not None and time.monotonic() - since >= self.config.progress_grace:
            return False
        return None

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST ``body`` to ``path`` of a broker: the one that last took a report, else the next
        replica in turn, each once. The JSON reply ({} for a reply without one; for a refusal,
        ``{"error": {"status", "message"}}`` as the broker's error body says), or
        None when no broker took it (no connection, a timeout, a connection dropped, or a 5xx or
        429 answer: worth another try)."""
        with self._brokers_lock:
            order = list(self.brokers)
        for url in order:
            reply = self._send_to(url, path, body)
            if reply is not None:
                with self._brokers_lock:
                    self.brokers = list(dict.fromkeys([url, *self.brokers]))
                return reply
        return None

    def fetch_blob(self, digest: str) -> bytes:
        """A pack of the job's files from a broker's blob store (each broker in turn, a few
        rounds); ``FilesError`` when none serves it."""
        c = self.config
        query = urllib.parse.urlencode({"job_id": c.job_id, "attempt": c.attempt})
        headers = {"Authorization": f"Bearer {c.token}"} if c.token else {}
        why = f"no broker URL ({Env.BROKER_URL})"
        for wait in (0.0, 1.0, 3.0, 9.0):
            self._stop.wait(wait)
            for url in list(self.brokers):
                request = urllib.request.Request(f"{url}/v1/agent/blobs/{digest}?{query}",
                                                 headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        return response.read()
                except urllib.error.HTTPError as exc:
                    why = f"{url} answered {exc.code}"
                    if exc.code < 500 and exc.code != 429:
                        raise FilesError(f"cannot fetch the job's files: {why}") from None
                except (OSError, http.client.HTTPException) as exc:
                    why = f"{url}: {exc}"
        raise FilesError(f"cannot fetch the job's files: {why}")

    def fetch_secrets(self) -> int | None:
        """The job's secrets that its launch names only (FLEET_SECRET_ENVS: a cloud's start
        script, which the cloud keeps in clear), fetched from a broker with the attempt token
        and tried with backoff as the final report is, into this process's memory and its
        workers' environment (never this process's own). None when done (or none named), else
        the exit code, the cause left for the final report; no value is ever printed."""
        names = [n.strip() for n in self.env.get(Env.SECRET_ENVS, "").split(",") if n.strip()]
        if not names:
            return None
        c = self.config
        why = f"no broker URL ({Env.BROKER_URL}) or attempt token to ask with"
        if self.brokers and c.token:
            reply = self._retrying("the secrets request")(
                self.send, SECRETS_PATH, {"job_id": c.job_id, "attempt": c.attempt})
            if reply is None:
                why = f"no broker answered within {c.report_timeout:g} s ({Env.REPORT_TIMEOUT})"
            elif isinstance(error := reply.get("error"), dict):
                why = f"the broker refused ({error.get('status')}): {error.get('message')}"
            else:
                got = reply.get("secrets")
                values = got if isinstance(got, dict) else {}
                missing = [n for n in names if not isinstance(values.get(n), str)]
                if not missing:
                    self.env.update({n: values[n] for n in names})
                    log(f"fetched the job's secrets from the broker: {', '.join(names)}")
                    return None
                why = f"the broker has no value for {', '.join(missing)}"
        text = f"could not fetch the job's secrets from the broker: {why}"
        log(text)
        failure.report(text, {failure.ERROR_ENV: str(self.workdir / "error")})
        return EXIT_FAILED

    def place_files(self) -> int | None:
        """The job's workdir and file mounts, before any setup (``broker.runtime.files``); None
        when placed (workers then start in the workdir), else the exit code, the cause left
        for the final report."""
        try:
            files = files_of(self.env)
            if files:
                self.cwd = place(files, files_root(self.env), self.fetch_blob)
        except Exception as exc:  # any cause (an SDK's own errors too) fails the launch, named
            text = str(exc) if isinstance(exc, FilesError) else \
                f"placing the job's files failed: {type(exc).__name__}: {exc}"
            log(text)
            failure.report(text, {failure.ERROR_ENV: str(self.workdir / "error")})
            return EXIT_FAILED
        return None

    def _send_to(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        headers = {"Content-Type": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        request = urllib.request.Request(
            f"{url}{path}",
            data=json.dumps(body).encode(),
            headers=headers,
            method="POST",
        )
        what = path.rsplit("/", 1)[-1]
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            if exc.code >= 500 or exc.code == 429:  # busy or its Redis away: try later
                log(f"{what} not taken: {exc}")
                return None
            log(f"{what} refused: {exc}")  # an answer, if not the one hoped for
            return {"error": _refusal(exc)}
        except (OSError, http.client.HTTPException) as exc:
            log(f"{what} failed: {exc}")
            return None
        try:
            reply = json.loads(raw or b"{}")
        except ValueError:
            log(f"{what}: the broker's reply is not JSON")
            return {}
        return reply if isinstance(reply, dict) else {}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``send``, with {} when the broker did not answer."""
        return self.send(path, body) or {}

    def heartbeat(self, state: str, exit_code: int | None = None) -> dict[str, Any] | None:
        """One heartbeat: the broker's reply, or None when it did not answer (``send``)."""
        c = self.config
        p = self.progress()
        body = {
            "job_id": c.job_id,
            "attempt": c.attempt,
            "node_rank": c.node_rank,
            "round": self.round,
            "state": state,
            **self._key(),
            **{k: p[k] for k in PROGRESS_FIELDS if k in p},
        }
        # Without a progress file, the script's own checkpoints are the job's position.
        committed = self.plain.newest() if self.plain is not None and not p else None
        if committed is not None:
            body.update(checkpoint_step=committed.step, checkpoint_bytes=committed.bytes,
                        checkpoint_age_seconds=round(committed.age_seconds(), 3))
        resumable = self.resumable(p, ended=exit_code is not None, committed=committed)
        if resumable is not None:
            body["resumable"] = resumable
        if p:  # the broker prices a resize of this job by it (SchedulerConfig.resize_in_place_s)
            body["resize_in_place"] = self.not_in_place(p) is None
        if c.accelerator and "samples_per_sec" in p:
            body["accelerator"] = c.accelerator
        if self.notice:
            body["notice"] = self.notice
        if exit_code is not None:
            body["exit_code"] = exit_code
            if exit_code not in (EXIT_FINISHED, EXIT_STOPPED) and \
                    (error := failure.read(self.workdir / "error")):
                body["error"] = error  # the cause a worker named (broker.runtime.failure)
        return self.send(HEARTBEAT_PATH, body)

    def final_report(self, code: int) -> None:
        """The last heartbeat, with the exit code and the last progress, tried at every broker
        with backoff until one takes it (any answer but a 5xx or 429: a 404 or 403 says the job
        or attempt is gone) or FLEET_REPORT_TIMEOUT passed: the broker settles the job, and the
        node's round, on it."""
        if self._retrying("the final report")(self.heartbeat, self.state,
                                              exit_code=code) is None:
            log(f"no broker took the final report within {self.config.report_timeout:g} s "
                f"({Env.REPORT_TIMEOUT}); giving up")

    def _retrying(self, what: str) -> Retrying:
        """Calls of ``send`` (or what wraps it) tried with jittered exponential backoff, from
        FINAL_REPORT_FIRST_WAIT_S up to FLEET_REPORT_MAX_WAIT between tries, until one gets an
        answer (any but a 5xx or 429) or FLEET_REPORT_TIMEOUT passed (then None)."""

        def waiting(state: RetryCallState) -> None:
            wait = state.next_action.sleep if state.next_action else 0.0
            log(f"the broker did not take {what}; trying again in {wait:.1f} s")

        # up to a second of jitter, within the most wait (every tenacity release has these)
        jitter = min(1.0, self.config.report_max_wait / 2)
        return Retrying(
            stop=stop_after_delay(self.config.report_timeout),
            wait=wait_exponential(multiplier=FINAL_REPORT_FIRST_WAIT_S,
                                  max=self.config.report_max_wait - jitter)
            + wait_random(0, jitter),
            retry=retry_if_result(lambda reply: reply is None),
            before_sleep=waiting,
            retry_error_callback=lambda _: None)

    def visit_rendezvous(self, round_: int, addr: str | None) -> dict[str, Any]:
        """One visit to the broker's rendezvous for ``round_``; a checkpoint-exit stops the
        agent, a higher round is noted."""
        c = self.config
        reply = self.post(RENDEZVOUS_PATH, {
            "job_id": c.job_id, "attempt": c.attempt, "round": round_,
            "node_rank": c.node_rank, "addr": addr, **self._key()})
        self._obey(reply)
        return reply

    def _key(self) -> dict[str, str]:
        """The node's FLEET_LAUNCH_KEY for a report: the broker refuses a node it replaced."""
        return {"launch_key": self.config.launch_key} if self.config.launch_key else {}

    def _obey(self, reply: dict[str, Any]) -> None:
        """Act on what the broker answered: stop the agent, note a newer round, learn the
        broker replicas (one started after the launch too; the ones known stay, in order)."""
        urls = reply.get("brokers")
        if isinstance(urls, list):
            new = [u for u in urls if isinstance(u, str) and u.startswith(("http://", "https://"))]
            with self._brokers_lock:
                self.brokers = list(dict.fromkeys([*self.brokers, *new]))
        if reply.get("action") == CHECKPOINT_EXIT:
            self.request_stop("broker asked for checkpoint-exit")
        if reply.get("action") == RESIZE and isinstance(reply.get("nproc"), int):
            self.request_resize(reply["nproc"])
        got = reply.get("round")
        if self.config.rendezvous and isinstance(got, int):
            with self._round_lock:
                self.broker_round = max(self.broker_round, got)

    def _every(self, interval: float, action: Callable[[], None]) -> None:
        while not self._done.wait(interval):
            action()

    def _beat(self) -> None:
        self._obey(self.heartbeat("stopping" if self._stop.is_set() else self.state) or {})

    def _poll_notices(self, checks: list[Callable[[], str | None]]) -> None:
        for check in checks:
            reason = check()
            if reason and self.notice is None:
                self.notice = reason
                self.request_stop(f"preemption notice: {reason}")
                if self.config.broker_url:  # tell the broker now: it blocks the location
                    self._beat()

    # ---- rendezvous -------------------------------------------------------------------------
    def _master_offer(self, avoid: int) -> str | None:
        """Rank 0's "host:port" for a round: FLEET_NODE_ADDR or the address toward the broker,
        and a port free on every interface (not the last round's: its store may linger)."""
        host = self.config.node_addr
        if host is None:
            try:
                host = local_ip(self.config.broker_url or "")
            except (OSError, UnicodeError) as exc:
                log(f"cannot tell this node's address toward the broker ({exc}); will retry; "
                    f"{Env.NODE_ADDR} sets it")
                return None
        return join_host_port(host, free_port("", avoid=avoid))

    def meet(self) -> int | None:
        """Form this round's group at the broker: every rank checks in (rank 0 with its
        address) and polls until the broker names the master, which it does once all the
        round's nodes checked in (moving up to a newer round the broker names). None once met
        (``round``, ``nnodes``, ``master`` set), else the exit code: stopped (a stop or the
        broker's checkpoint-exit) or failed (a round's group did not form in time; each round
        the node moves to gets FLEET_RENDEZVOUS_TIMEOUT anew). Meanwhile ``round`` is the round
        it waits in, which its reports carry."""
        c = self.config
        round_, offer, told, deadline = -1, None, -1, 0.0
        while not self._stop.is_set():
            if round_ != (wanted := max(self.round, self.broker_round)):  # its own deadline
                round_, deadline = wanted, time.monotonic() + c.rendezvous_timeout
                self.round = round_
            if (c.node_rank == 0 or c.per_node) and (offer is None or offer[0] != round_):
                addr = self._master_offer(avoid=self.master[1])
                offer = (round_, addr) if addr else None
            reply = self.visit_rendezvous(round_, offer[1] if offer else None)
            if self._stop.is_set():
                break
            master, nnodes = reply.get("master"), reply.get("nnodes")
            if reply.get("round") == round_ and master and isinstance(nnodes, int):
                return self._joined(round_, nnodes, master, reply.get("addrs"))
            if self.broker_round > round_:
                continue  # the broker moved on: join its round at once
            if told != round_ and isinstance(nnodes, int):
                told = round_
                log(f"round {round_}: waiting at the broker's rendezvous until all {nnodes} "
                    "nodes checked in")
            if time.monotonic() > deadline:
                log(f"the group of round {round_} did not form at the broker's rendezvous "
                    f"within {c.rendezvous_timeout:g} s ({Env.RENDEZVOUS_TIMEOUT}): not every "
                    "node of the round checked in; giving up")
                return EXIT_FAILED
            self._stop.wait(c.rendezvous_poll)
        return EXIT_STOPPED

    def _joined(self, round_: int, nnodes: int, master: str,
                addrs: list[str] | None = None) -> int | None:
        c = self.config
        if c.node_rank >= nnodes:
            log(f"the broker's rendezvous says round {round_} has {nnodes} nodes; this node "
                f"(rank {c.node_rank}) is not one of them")
            return EXIT_FAILED
        self.round, self.nnodes, self.master = round_, nnodes, split_host_port(master)
        if addrs and len(addrs) == nnodes:
            self.hosts = [split_host_port(a)[0] if a else "" for a in addrs]
        else:
            self.hosts = [self.master[0]]
        log(f"round {round_}: node {c.node_rank}/{nnodes}, master {master}")
        return None

    def await_round(self, code: int) -> bool:
        """The workers ended with ``code`` by themselves, as they do when a peer node is lost:
        wait for the broker to start a newer round (it replaces a lost node). True when it did;
        False after FLEET_REJOIN_TIMEOUT, a stop or the broker's checkpoint-exit."""
        c = self.config
        self.state = "rejoining"
        log(f"workers ended with exit {code} without a stop, as they do when a peer node is "
            f"lost: waiting up to {c.rejoin_timeout:g} s ({Env.REJOIN_TIMEOUT}) for the broker "
            f"to start a round after {self.round}, else exiting with {code}")
        self._beat()
        deadline = time.monotonic() + c.rejoin_timeout
        while not self._stop.is_set() and self.broker_round <= self.round:
            if time.monotonic() > deadline:
                log(f"no new round within {c.rejoin_timeout:g} s")
                return False
            self._stop.wait(c.rendezvous_poll)
            self.visit_rendezvous(self.round, None)
        return not self._stop.is_set()

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> int:
        c = self.config
        signal.signal(signal.SIGTERM, lambda s, _: self.request_stop(signal.Signals(s).name))
        signal.signal(signal.SIGINT, lambda s, _: self.request_stop(signal.Signals(s).name))
        signal.signal(signal.SIGUSR1, lambda *_: self.signal_workers(signal.SIGUSR1))
        master = "from the broker's rendezvous" if c.rendezvous else join_host_port(*self.master)
        # one line: shlex-quoted arguments, a new line inside one written as \n
        command = shlex.join(self.command).replace("\n", "\\n")
        log(
            f"job {c.job_id} attempt {c.attempt}: node {c.node_rank}/{c.nnodes}, "
            f"{c.nproc} workers, master {master}: {command}"
        )
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
        code = self.fetch_secrets()  # first: the token is read, none of the job's code ran
        if code is None:
            code = self.check_container()
        if code is None:
            code = self.place_files()
        if code is None:
            code = self._rounds()
        self._done.set()
        for helper in self._helpers:  # a docker stop still waiting out its grace period
            with contextlib.suppress(subprocess.TimeoutExpired):
                helper.wait(timeout=max(self.config.grace_period, 1.0) + 10)
        self.state = {EXIT_FINISHED: "finished", EXIT_STOPPED: "stopped"}.get(code, "failed")
        if c.broker_url:
            self.final_report(code)
        why = self.stop_reason or self.halt_reason
        log(f"{self.state} (exit {code})" + (f": {why}" if why else ""))
        shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def _rounds(self) -> int:
        """Run the workers, round after round in rendezvous mode; the agent's exit code."""
        rendezvous = self.config.rendezvous
        while True:
            if rendezvous and (failed := self.meet()) is not None:
                return failed
            self.halt_reason = None
            try:
                pumps = self.start_workers()
            except OSError as exc:
                log(f"cannot start {self.command[0]!r}: {exc}")
                return EXIT_USAGE
            self.state = "running"
            code = self._supervise()
            for t in pumps:
                t.join(timeout=5)
            if self._restart and code != EXIT_FINISHED and not self._stop.is_set():
                # a resize that needs new workers
                self._restart = False
                continue
            if code == EXIT_FINISHED or self._stop.is_set() or not rendezvous:
                return code
            if self.broker_round <= self.round and not self.await_round(code):
                return code

    def _halting(self) -> str | None:
        """Why this round's workers must stop now, if they must."""
        if self._stop.is_set():
            return self.stop_reason
        if self.broker_round > self.round:
            return f"the broker started round {self.broker_round}"
        if self._restart:
            return f"restarting at {self.config.nproc} workers"
        return None

    def _supervise(self) -> int:
        """Wait for this round's workers: on a stop, a newer round or a failed worker SIGTERM
        them all, SIGKILL after the grace period. Their combined exit code."""
        deadline: float | None = None
        failed: int | None = None
        while True:
            if self.resize_to is not None and deadline is None and failed is None:
                self._resize()
            codes = [p.poll() for p in self.procs]
            bad = [x for x in codes if x is not None and not self._clean(x, deadline is not None)]
            if bad and failed is None:
                failed = bad[0]
                log(f"a worker failed with exit code {failed}; stopping the others")
            why = self._halting() or (None if failed is None else f"worker exit code {failed}")
            if why and deadline is None:
                self.halt_reason = why
                log(f"stopping: {why}; workers have {self.config.grace_period:g} s")
                deadline = time.monotonic() + self.config.grace_period
                self.signal_workers(signal.SIGTERM)
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

    @staticmethod
    def _clean(code: int, signalled: bool) -> bool:
        # A worker the stop's SIGTERM reached before the library installed its handler had not
        # trained past the checkpoint it restored from, so it stopped cleanly too.
        return code in (EXIT_FINISHED, EXIT_STOPPED) or (signalled and code == -signal.SIGTERM)


def _refusal(exc: urllib.error.HTTPError) -> dict[str, Any]:
    """A broker's 4xx answer as ``{"status", "message"}`` (its error body's message, at most
    300 characters, else the HTTP reason)."""
    message: Any = None
    with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
        got = json.loads(exc.read() or b"{}")
        error = got.get("error") if isinstance(got, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
    text = message if isinstance(message, str) else str(exc.reason)
    return {"status": exc.code, "message": " ".join(text.split())[:300]}


def take_token(env: dict[str, str]) -> None:
    """Move the attempt token from FLEET_AGENT_TOKEN_FD (the local node's pipe) or
    FLEET_AGENT_TOKEN_FILE (a start script's 0600 file, deleted here), before any of the job's
    code runs, into ``env`` (this process's memory only: never into its environment, which a job
    could read in /proc/PID/environ); and make this process non-dumpable on Linux, so a non-root
    job cannot read its memory or /proc files either."""
    fd = env.pop(Env.AGENT_TOKEN_FD, None)
    path = env.pop(Env.AGENT_TOKEN_FILE, None)
    if fd:
        try:
            with open(int(fd), closefd=True) as f:
                env[Env.AGENT_TOKEN] = f.read().strip()
        except (OSError, ValueError) as exc:
            log(f"cannot read the token pipe: {exc}; reports will be refused")
    elif path:
        try:
            with open(path) as f:
                env[Env.AGENT_TOKEN] = f.read().strip()
        except OSError as exc:
            log(f"cannot read the token file: {exc.strerror}; reports will be refused")
        with contextlib.suppress(OSError):
            os.unlink(path)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0


def main(argv: Sequence[str] | None = None) -> int:
    env = dict(os.environ)
    take_token(env)
    try:
        config, command = parse(sys.argv[1:] if argv is None else argv, env)
    except AssignmentError as exc:
        log(f"error: {exc}")
        return EXIT_USAGE
    return Agent(config, command, env).run()


if __name__ == "__main__":
    sys.exit(main())
