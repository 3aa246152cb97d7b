"""The ``local`` provider: pretend regions on this machine, each with its own cloud name, market,
price and virtual GPUs (a virtual GPU is a worker process). A node is a process group started
under ``providers.local.node``; its state lives in a directory per node, so a restarted broker
finds the nodes an earlier broker process launched. Spot regions can be reclaimed on command or
on a schedule in the fleet file: their nodes get SIGTERM (the preemption notice), then SIGKILL
of the whole group after the grace period.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.errors import InvalidInput
from broker.protocol import BrokerEnv, Env
from policies.models import Accelerator, Market, Offer, Pool
from providers.base import (
    CapacityError,
    LaunchRequest,
    Node,
    NodeState,
    PreemptionNotice,
    Provider,
    ProviderError,
)
from providers.local.job_user import hand_over, job_user

log = logging.getLogger(__name__)


class LocalRegion(BaseModel):
    """A pretend region: ``gpus`` virtual GPUs over ``nodes`` nodes at ``price_per_gpu_hour``,
    or a CPU region, ``cpu_nodes`` nodes of ``cpus_per_node`` vCPUs at ``price_per_node_hour``
    (its pool is ``Accelerator.CPU``; its jobs see no GPU)."""

    model_config = ConfigDict(extra="forbid")

    cloud: str = "local"
    region: str
    market: Market = Market.ON_DEMAND
    price_per_gpu_hour: float | None = Field(default=None, ge=0)
    gpus: int | None = Field(default=None, ge=1, le=256,
                             description="virtual GPUs (worker processes)")
    nodes: int = Field(default=1, ge=1, le=64,
                       description="pretend nodes the GPUs are split over (evenly)")
    accelerator: Accelerator = Accelerator.T4
    cpu_nodes: int | None = Field(default=None, ge=1, le=64,
                                  description="a CPU region: its nodes (no GPUs)")
    cpus_per_node: float | None = Field(default=None, gt=0,
                                        description="a CPU region's vCPUs per node")
    memory_gib_per_node: float | None = Field(default=None, gt=0,
                                              description="a CPU region's GiB per node")
    price_per_node_hour: float | None = Field(default=None, ge=0,
                                              description="a CPU region's USD per node-hour")

    @model_validator(mode="after")
    def _one_kind(self) -> LocalRegion:
        cpu = {k for k in ("cpu_nodes", "cpus_per_node", "memory_gib_per_node",
                           "price_per_node_hour") if getattr(self, k) is not None}
        if cpu:
            # by value, not by what was set: a dumped and re-read region carries every key
            gpu = {k for k, unset in (("gpus", None), ("price_per_gpu_hour", None),
                                      ("nodes", 1), ("accelerator", Accelerator.T4))
                   if getattr(self, k) != unset}
            if gpu:
                raise ValueError(f"{sorted(gpu)[0]}: a CPU region (cpu_nodes) has no GPUs; "
                                 "declare GPUs in a region of their own")
            missing = [k for k in ("cpu_nodes", "cpus_per_node", "price_per_node_hour")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"a CPU region needs {', '.join(missing)} (e.g. cpu_nodes: 2, "
                                 "cpus_per_node: 4, price_per_node_hour: 0)")
            return self
        if self.gpus is None or self.price_per_gpu_hour is None:
            raise ValueError("a region needs gpus and price_per_gpu_hour (GPUs), or cpu_nodes, "
                             "cpus_per_node and price_per_node_hour (CPU nodes)")
        if self.accelerator is Accelerator.CPU:
            raise ValueError("accelerator: CPU nodes are declared with cpu_nodes, "
                             "cpus_per_node and price_per_node_hour, not as GPUs")
        if self.gpus % self.nodes:
            raise ValueError(f"gpus ({self.gpus}) must split evenly over nodes ({self.nodes})")
        return self

    # A CPU region's pool counts nodes, one unit each (policies.models.Pool): these give both
    # kinds of region in the pool's terms.
    @property
    def kind(self) -> Accelerator:
        """The pool's type: ``Accelerator.CPU`` for a CPU region."""
        return Accelerator.CPU if self.cpu_nodes is not None else self.accelerator

    @property
    def node_count(self) -> int:
        return self.cpu_nodes if self.cpu_nodes is not None else self.nodes

    @property
    def units(self) -> int:
        """Virtual GPUs (a CPU region: its nodes)."""
        units = self.cpu_nodes if self.cpu_nodes is not None else self.gpus
        assert units is not None  # the validator requires one
        return units

    @property
    def unit_price(self) -> float:
        """USD per GPU-hour (a CPU region: per node-hour)."""
        price = self.price_per_node_hour if self.cpu_nodes is not None else \
            self.price_per_gpu_hour
        assert price is not None  # the validator requires it
        return price

    def pool(self, reclaimed: bool = False, containers: bool = False) -> Pool:
        """The region as a pool; one of several nodes sells any count up to a node, and more
        only as a gang of whole nodes (a multi-node job, one process group per node). A CPU
        region sells whole nodes only."""
        per_node = self.units // self.node_count
        sizes = None if self.node_count == 1 and self.cpu_nodes is None else \
            dict.fromkeys(range(1, per_node + 1), self.unit_price)
        return Pool(cloud=self.cloud, region=self.region, accelerator=self.kind,
                    market=self.market, nodes=0 if reclaimed else self.node_count,
                    gpus_per_node=per_node, price_per_gpu_hour=self.unit_price,
                    gpu_prices=sizes, containers=containers, cpus_per_node=self.cpus_per_node,
                    memory_gib_per_node=self.memory_gib_per_node)


# What a job inherits from the broker's environment (everything else it gets from the launch
# request: its FLEET_* assignment and its spec's envs). The broker's own environment holds its
# tokens, its Redis URL and cloud credentials: none of that reaches a job.
PASS_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ",
                      "TMPDIR", "TERM", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
                      "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"})
PASS_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_")
# Never passed, even when a fleet file's pass_env names them.
BROKER_SECRETS = BrokerEnv.SECRETS


def job_environment(broker_env: dict[str, str], extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The part of the broker's environment a local job may see: ``PASS_ENV``, the locale and
    CUDA variables, and the fleet file's ``pass_env`` names (never ``BROKER_SECRETS``)."""
    return {k: v for k, v in broker_env.items() if k not in BROKER_SECRETS and (
        k in PASS_ENV or k.startswith(PASS_ENV_PREFIXES) or k in extra)}


class Reclaim(BaseModel):
    """Reclaim spot region ``region`` ``at_s`` seconds after the provider starts."""

    model_config = ConfigDict(extra="forbid")

    region: str
    at_s: float = Field(ge=0)
    duration_s: float = Field(default=60.0, gt=0)


class LocalFleet(BaseModel):
    """A fleet file (``examples/fleets/*.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "local"
    grace_period_s: float = Field(default=10.0, ge=0, le=600)
    regions: list[LocalRegion] = Field(min_length=1)
    reclaims: list[Reclaim] = Field(default_factory=list)
    pass_env: list[str] = Field(default_factory=list, description="more variables of the "
                                "broker's environment its local jobs get (e.g. a proxy); the "
                                "broker's tokens and Redis URL are never passed")

    @model_validator(mode="after")
    def _consistent(self) -> LocalFleet:
        refused = sorted(set(self.pass_env) & BROKER_SECRETS)
        if refused:
            raise ValueError(f"pass_env: {refused} are the broker's secrets; jobs never get them")
        names = [r.region for r in self.regions]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"regions: region names must be unique, repeated: {sorted(dup)}")
        for rc in self.reclaims:
            self.region(rc.region, spot_only=True)
        return self

    def region(self, name: str, *, spot_only: bool = False) -> LocalRegion:
        for r in self.regions:
            if r.region == name:
                if spot_only and r.market is not Market.SPOT:
                    raise InvalidInput(f"region {name!r} is on-demand; only spot regions "
                                       "can be reclaimed")
                return r
        known = ", ".join(r.region for r in self.regions)
        raise InvalidInput(f"unknown region {name!r}; the fleet has: {known}")

    @classmethod
    def load(cls, path: str | Path) -> LocalFleet:
        """Read a fleet file; errors name the file and the field."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidInput(f"{path}: cannot read fleet file: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise InvalidInput(f"{path}: {where}: {first['msg']}") from None


def _proc_start(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (the agent starts its workers in sessions of their own,
    so the node's process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_node(pid: int) -> None:
    """SIGKILL a node's supervisor, its process group and every process below it, as a machine
    that dies takes all of them."""
    below = _descendants(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` whole: a listing that reads it meanwhile sees the old or the new."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _ts(x: float | None) -> datetime | None:
    return datetime.fromtimestamp(x, UTC) if x is not None else None


class LocalProvider(Provider):
    name = "local"

    def __init__(self, fleet: LocalFleet, state_dir: str | Path,
                 workdir: str | Path | None = None,
                 checkpoint_root: str | Path | None = None) -> None:
        self.fleet = fleet
        # Jobs run as an unprivileged user when the broker is root; their checkpoint
        # directories under ``checkpoint_root`` (the broker's) become theirs.
        self.job_user = job_user()
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root else None
        self.dir = Path(state_dir)
        self.nodes_dir = self.dir / "nodes"
        self.nodes_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.nodes_dir, 0o700)  # jobs' logs and their agents' tokens: owner only
        self.workdir = Path(workdir) if workdir else Path.cwd()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        started = _read_json(self.dir / "provider.json")
        if started is None:
            started = {"started_at": time.time()}
            (self.dir / "provider.json").write_text(json.dumps(started))
        self.started_at = float(started["started_at"])

    # ---- capacity ---------------------------------------------------------------------------

    def _reclaimed(self) -> dict[str, float]:
        """Spot regions reclaimed now -> until when; applies the fleet file's schedule."""
        now = time.time()
        state = _read_json(self.dir / "reclaims.json") or {"until": {}, "done": []}
        for i, rc in enumerate(self.fleet.reclaims):
            if str(i) not in state["done"] and now >= self.started_at + rc.at_s:
                state["done"].append(str(i))
                self._write_reclaims(state)
                self.reclaim(rc.region, rc.duration_s)
                state = _read_json(self.dir / "reclaims.json") or state
        return {r: u for r, u in state["until"].items() if u > now}

    def _write_reclaims(self, state: dict[str, Any]) -> None:
        tmp = self.dir / "reclaims.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.dir / "reclaims.json")

    def reclaim(self, region: str, duration_s: float = 60.0) -> int:
        """Take a spot region away for ``duration_s``: every node there gets a preemption
        notice (SIGTERM) and is killed after the grace period. Returns the nodes notified."""
        self.fleet.region(region, spot_only=True)
        state = _read_json(self.dir / "reclaims.json") or {"until": {}, "done": []}
        state["until"][region] = time.time() + duration_s
        self._write_reclaims(state)
        hit = [n for n in self._scan() if n.region == region and n.state is NodeState.RUNNING]
        for n in hit:
            self._signal_stop(n.node_id, reason="spot-reclaim")
        return len(hit)

    def resized(self, node_id: str, gpus: int) -> None:
        path = self.nodes_dir / node_id / "meta.json"
        meta = _read_json(path)
        if meta is not None and meta.get("gpus") != gpus:
            _write_json(path, {**meta, "gpus": gpus})

    def reclaim_node(self, node_id: str) -> None:
        """Reclaim one spot node (a cloud reclaims single instances too): its preemption notice
        (SIGTERM), then SIGKILL after the grace period; the region keeps its other nodes."""
        meta = _read_json(self.nodes_dir / node_id / "meta.json")
        if meta is None or meta.get("market") != Market.SPOT.value:
            raise InvalidInput(f"node {node_id!r} is not a spot node of this fleet")
        self._signal_stop(node_id, reason="spot-reclaim")

    @functools.cached_property
    def containers(self) -> bool:
        """Can this machine run a job's container image (a working ``docker``)? Asked once: a
        job with an image is never run on the host instead (``broker.waiting.Needs``)."""
        # The same test the node's agent makes before it starts such a job
        # (broker.runtime.container.unusable); providers do not import the job-side runtime.
        exe = shutil.which("docker")
        try:
            works = exe is not None and subprocess.run(
                [exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                timeout=20, stdin=subprocess.DEVNULL, check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            works = False
        if not works:
            log.info("local fleet: no working docker (docker info fails or no docker on PATH): "
                     "jobs with a container image cannot run here")
        return works

    def pools(self) -> list[Pool]:
        reclaimed = self._reclaimed()
        return [r.pool(r.region in reclaimed, self.containers) for r in self.fleet.regions]

    def offers(self) -> list[Offer]:
        return [Offer(cloud=r.cloud, region=r.region, instance_type=f"local-{r.units}x",
                      accelerator=r.kind, accelerator_count=r.units,
                      vcpus=r.cpus_per_node, memory_gib=r.memory_gib_per_node,
                      price=None if r.market is Market.SPOT else r.unit_price * r.units,
                      spot_price=r.unit_price * r.units if r.market is Market.SPOT
                      else None)
                for r in self.fleet.regions]

    def capacity(self) -> dict[str, int]:
        used: dict[str, int] = {}
        for n in self.nodes():
            if n.state is not NodeState.TERMINATED:
                used[n.region] = used.get(n.region, 0) + n.gpus
        return {p.id: p.capacity - used.get(p.region, 0) for p in self.pools()}

    # ---- nodes ------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> list[Node]:
        base = request.idempotency_key.replace(":", "_").replace("/", "_")
        ranks = range(request.first_rank, request.first_rank + request.nodes)
        dirs = [self.nodes_dir / (base if request.nodes == 1 else f"{base}-n{r}") for r in ranks]
        if dirs[0].exists():  # the same intent again: hand back the nodes it made
            return [self._node(d) for d in dirs if d.exists()]
        region = self.fleet.region(request.region)
        if region.market is not request.market:
            raise ProviderError(f"region {region.region} sells {region.market.value}, "
                                f"not {request.market.value}")
        if region.region in self._reclaimed():
            raise CapacityError(f"spot region {region.region} is reclaimed")
        gpus = request.gpus_per_node * request.nodes
        if self.capacity().get(region.pool().id, 0) < gpus:
            unit = "CPU nodes" if region.cpu_nodes is not None else "GPUs"
            raise CapacityError(f"region {region.region} has fewer than {gpus} free {unit}")
        checkpoint = urlparse(request.env.get(Env.CHECKPOINT_URI, ""))
        if self.job_user and self.checkpoint_root and checkpoint.path and \
                checkpoint.scheme in ("", "file"):
            hand_over(Path(checkpoint.path), self.checkpoint_root, self.job_user)
        try:
            dirs[0].mkdir()
        except FileExistsError:
            return [self._node(d) for d in dirs if d.exists()]
        env = {**job_environment(dict(os.environ), tuple(self.fleet.pass_env)),
               **request.env, Env.WORKDIR: str(self.workdir)}
        # The attempt token goes to each node's supervisor on its stdin, never in an environment
        # (a job could read /proc/PID/environ) nor in a file (another job could read it first).
        token = env.pop(Env.AGENT_TOKEN, None)
        # Jobs run from the work dir with this interpreter's tools first on PATH, so `python
        # examples/x.py` finds the same packages as the broker.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (str(self.workdir), env.get("PYTHONPATH")) if x)
        env.setdefault(Env.GRACE_PERIOD, str(self.fleet.grace_period_s))
        if Env.MASTER_ADDR in env or Env.BROKER_URL not in env:
            # no rendezvous: the nodes of this launch meet on this machine's loopback
            env.setdefault(Env.MASTER_ADDR, "127.0.0.1")
            env.setdefault(Env.MASTER_PORT, str(_free_port()))
        for rank, node_dir in zip(ranks, dirs, strict=True):
            node_dir.mkdir(exist_ok=True)
            # the node's home for its files (broker.runtime.files): ~ and relative mount paths
            node_env = {**env, Env.NODE_RANK: str(rank), Env.FILES_ROOT: str(node_dir.resolve())}
            self._start(node_dir, request, region, rank, node_env, token)
        return [self._node(d) for d in dirs]

    def _start(self, node_dir: Path, request: LaunchRequest, region: LocalRegion, rank: int,
               env: dict[str, str], token: str | None) -> None:
        """One node: its metadata, then its supervisor process in a session of its own, which
        reads the attempt ``token`` (if any) from its stdin."""
        meta = {"job_id": request.job_id, "key": request.idempotency_key,
                "region": region.region, "market": region.market.value,
                "accelerator": region.kind.value, "gpus": request.gpus_per_node,
                "rank": rank, "launched_at": time.time()}
        _write_json(node_dir / "meta.json", meta)
        proc = subprocess.Popen(
            [sys.executable, "-m", "providers.local.node", str(node_dir), str(self.workdir),
             *(["--user", self.job_user.name] if self.job_user else []),
             *(["--token", Env.AGENT_TOKEN_FD] if token else []), "--", *request.command],
            env=env, start_new_session=True,
            stdin=subprocess.PIPE if token else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        if token and proc.stdin is not None:
            # 64 bytes, far below a pipe's buffer; the agent reads to EOF, which a broker that
            # dies here also gives it (an empty token: the agent says reports are refused)
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(token.encode())
            proc.stdin.close()
        self._children[node_dir.name] = proc
        st = _proc_start(proc.pid)
        (node_dir / "pid.json").write_text(json.dumps({"pid": proc.pid,
                                                       "start": st[1] if st else 0}))
        with open(self.dir / "launches.log", "a") as f:  # audit: one line per real spawn
            f.write(f"{request.idempotency_key} {node_dir.name} {time.time():.3f}\n")

    def terminate(self, node_id: str) -> None:
        self._signal_stop(node_id, reason="terminate")

    def lose(self, node_id: str) -> None:
        """Kill a node outright, as a machine that dies: no notice, no grace, no exit record
        (demos and tests of lost-node recovery)."""
        pid = self._live_pid(self.nodes_dir / node_id)
        if pid is not None:
            _kill_node(pid)

    def _signal_stop(self, node_id: str, reason: str) -> None:
        node_dir = self.nodes_dir / node_id
        if not node_dir.exists():
            return
        term = node_dir / "term.json"
        if not term.exists():
            term.write_text(json.dumps({"deadline": time.time() + self.fleet.grace_period_s,
                                        "reason": reason}))
        pid = self._live_pid(node_dir)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)

    def nodes(self) -> list[Node]:
        self._reclaimed()
        return self._scan()

    def _scan(self) -> list[Node]:
        for proc in self._children.values():
            proc.poll()  # reap finished supervisors so they do not linger as zombies
        return [self._node(d) for d in sorted(self.nodes_dir.iterdir()) if d.is_dir()]

    def notices(self) -> list[PreemptionNotice]:
        out = []
        for d in sorted(self.nodes_dir.iterdir()):
            term = _read_json(d / "term.json")
            # Kept after the node ended (until forgotten) so the broker learns the node was
            # preempted even when it exited between two looks.
            if term and term.get("reason") == "spot-reclaim":
                meta = _read_json(d / "meta.json") or {}
                out.append(PreemptionNotice(node_id=d.name, region=meta.get("region", "?"),
                                            deadline=_ts(term["deadline"]) or datetime.now(UTC)))
        return out

    def forget(self, node_id: str) -> None:
        node_dir = self.nodes_dir / node_id
        if node_dir.exists() and self._node(node_dir).state is NodeState.TERMINATED:
            shutil.rmtree(node_dir, ignore_errors=True)
            self._children.pop(node_id, None)

    def read_log(self, node_id: str, offset: int = 0) -> tuple[list[str], int]:
        try:
            with open(self.nodes_dir / node_id / "output.log", "rb") as f:
                f.seek(offset)
                data = f.read(1 << 20)
        except OSError:
            return [], offset
        end = data.rfind(b"\n") + 1  # complete lines only
        lines = data[:end].decode(errors="replace").splitlines()
        return lines, offset + end

    def _live_pid(self, node_dir: Path) -> int | None:
        info = _read_json(node_dir / "pid.json")
        if not info:
            return None
        st = _proc_start(info["pid"])
        if st is None or st[0] in ("Z", "X") or st[1] != info["start"]:
            return None
        return int(info["pid"])

    def _node(self, node_dir: Path) -> Node:
        meta = _read_json(node_dir / "meta.json") or {}
        region = self.fleet.region(meta["region"]) if meta.get("region") else None
        done = _read_json(node_dir / "exit.json")
        term = _read_json(node_dir / "term.json")
        if done is not None:
            state, code, ended = NodeState.TERMINATED, int(done["code"]), done["ended_at"]
        else:
            code, ended = None, None
            pid = self._live_pid(node_dir)
            if pid is None:
                young = time.time() - meta.get("launched_at", 0) < 10
                state = NodeState.PENDING if young and not (node_dir / "pid.json").exists() \
                    else NodeState.TERMINATED
            elif term is not None:
                state = NodeState.PREEMPTING
                if time.time() >= term["deadline"]:
                    _kill_node(pid)
            else:
                state = NodeState.RUNNING
        return Node(node_id=node_dir.name, provider=self.name,
                    region=meta.get("region", "?"), job_id=meta.get("job_id"),
                    idempotency_key=meta.get("key"),
                    accelerator=region.kind if region else Accelerator.T4,
                    gpus=meta.get("gpus", 0), market=region.market if region else Market.SPOT,
                    state=state, launched_at=_ts(meta.get("launched_at")), exit_code=code,
                    ended_at=_ts(ended), rank=meta.get("rank"))
