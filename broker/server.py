"""The broker process: an embedded ``redis-server`` (unless a URL is given), the leader loop
(lease, operator commands, reconcile, schedule, actuate) and the HTTP API in one process.

``build_broker(config)`` gives the leader loop alone (``python -m broker.server`` runs it; tests
kill it); ``Stack`` adds the embedded Redis and the API: it is what ``fleet up`` and ``fleet demo``
run. Several broker processes may share one Redis: one holds the lease and acts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis
from pydantic import BaseModel, Field

from broker import logs, metrics, secrets, transitions
from broker.actuator import Actuator, ActuatorConfig
from broker.errors import InvalidInput, NotFound
from broker.files import BlobStore
from broker.models import JobState
from broker.protocol import BrokerEnv
from broker.reconciler import QUICK_RECLAIM_S, Reconciler
from broker.scheduler import Scheduler, SchedulerConfig
from broker.sealed import Sealer
from broker.store import Conflict, Plan, StaleFence, Store
from policies.migration import DEFAULT_DECAY_S, DEFAULT_REFUSAL_DECAY_S
from policies.models import BLOB_PREFIX
from providers.fleet import FleetProvider, build_fleet_provider
from providers.local.provider import write_private

log = logging.getLogger(__name__)

# What `fleet up` says once at start when its local jobs run as its own user (docs/security.md).
JOBS_AS_BROKER_USER = (
    "local jobs run as the broker's own user: a job can read %s (tokens.json with the admin "
    "token and agent key, the Redis password) and act as the admin; run `fleet up` as root so "
    f"local jobs run as an unprivileged user ({BrokerEnv.JOB_USER}, default nobody), or run "
    "untrusted teams' jobs on cloud nodes (docs/security.md)")

# How often a replica looks for packs to delete: a listing of the active jobs, so not every
# round; what an operator tunes is how long an unneeded pack stays (blob_retention_s).
BLOB_SWEEP_S = 60.0

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FLEET = REPO / "examples" / "fleets" / "local.yaml"
REDIS_HINT = ("redis-server not found on PATH: install it (Debian/Ubuntu: apt-get install "
              "redis-server; macOS: brew install redis) or pass --redis-url redis://HOST:PORT")


class BrokerConfig(BaseModel):
    state_dir: Path = Path(".state")
    redis_url: str | None = None  # None: start an embedded redis-server under state_dir
    fleet: Path = DEFAULT_FLEET
    owner: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    tick_s: float = Field(default=1.0, gt=0, description="the round interval: the broker loop "
                          "wakes this often (and on every event) to plan and act")
    lease_ttl_s: float = Field(default=5.0, gt=0, description="the leader lease's time to live: "
                               "a replica takes over this long after the leader stopped renewing")
    lease_stall_s: float = Field(default=60.0, gt=0, description="a leader whose loop has not "
                                 "come round this long is taken to be hung and stops renewing "
                                 "its lease, so a standby takes over (a pass may wait this long "
                                 "on a cloud's API)")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    use_agent: bool = True
    broker_url: str | None = None
    agent_token: str | None = None
    heartbeat_interval_s: float = Field(default=5.0, gt=0, description="seconds between a job "
                                        "agent's heartbeats (its progress and liveness)")
    blocklist_decay_s: float = Field(default=DEFAULT_DECAY_S, gt=0,
                                     description="how long a reclaimed spot location stays "
                                     "blocked (SpotHedge's reset may free it earlier)")
    refusal_decay_s: float = Field(default=DEFAULT_REFUSAL_DECAY_S, gt=0,
                                   description="how long a pool whose cloud refused a launch "
                                   "(no capacity or quota) is passed over while other pools "
                                   "have room")
    final_report_wait_s: float = Field(default=120.0, gt=0, description="how long a job "
                                       "whose command finished waits for its agent's final "
                                       "report (its last progress) before it is recorded "
                                       "completed without it")
    confirm_durable: bool = Field(default=True, description="acknowledge a submission only "
                                  "once Redis confirmed it durable (docs/operations.md)")
    quick_reclaim_s: float = Field(default=QUICK_RECLAIM_S, gt=0, description="a spot reclaim "
                                   "this soon after a launch is an early one; two early ones "
                                   "within the blocklist's refusal decay put the pool under "
                                   "reclaim (backed off)")
    launch_deadline_s: float = Field(default=1200.0, gt=0,
                                     description="a cloud VM whose agent has not sent its first "
                                     "heartbeat this long after launch is terminated and its "
                                     "job requeued (needs broker_url: agents report there)")
    rendezvous_margin_s: float = Field(
        default=ActuatorConfig.model_fields["rendezvous_margin_s"].default, gt=0,
        description="how much longer than launch_deadline_s a multi-node job's agents wait at "
        "the rendezvous for a round's group (a stand-in's launch and boot), so that the broker, "
        "not a survivor, decides a stand-in is not coming")
    blob_retention_s: float = Field(default=3600.0, gt=0, description="a packed workdir or "
                                    "file mount (POST /v1/blobs) that no queued or running job "
                                    "references is deleted this long after its upload: the "
                                    "time a client has between uploading a pack and submitting "
                                    "its job")


# The embedded server's users (redis.io/docs/latest/operate/oss_and_stack/management/security/acl).
# The default user gets no password that can match, so no client signs in as it; it stays on
# with every right because Redis 7.0 replays the AOF's MULTI/EXEC with the default user's
# rights: a disabled default user made a restart silently drop every transaction.
ACL_DEFAULT = "user default on resetpass ~* &* +@all"
ACL_BROKER = "user {user} on >{password} ~fb:* &* +@all -@admin"


class EmbeddedRedis:
    """A redis-server child on loopback with AOF (everysec), no RDB snapshots and its data
    under ``data_dir``; it can be stopped (gracefully or ``kill -9``) and restarted on the same
    port and data, reloading the AOF.

    No client can sign in as its ``default`` user: the broker signs in as the ACL user ``user``
    with a password made once and kept in ``data_dir/password`` (mode 0600), handed to the
    server on its stdin, never on a command line; ``url`` carries both (keep it out of logs:
    ``broker.secrets.redact_url``). That user reaches only the store's keys (``fb:*``) and no
    administrative command (``CONFIG``, ``SHUTDOWN``, ``ACL``, ``MONITOR``…): a leaked password
    cannot turn the server into a file writer or stop it. Its files are 0600 in 0700
    directories. One process at a time runs the server of a data directory: ``start`` takes
    ``data_dir/lock`` (flock, held until ``stop``) and stops a server an earlier process left
    running on the directory (a ``kill -9``'d ``fleet up``), and the server gets SIGTERM when
    the thread that started it dies (Linux), so it does not outlive its broker. ``config``:
    more lines of redis.conf for the server (the fault suite asks for keyspace
    notifications)."""

    user = "fleet-broker"

    def __init__(self, data_dir: Path, port: int | None = None,
                 config: Sequence[str] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(REDIS_HINT)
        self.binary = binary
        self.dir = data_dir
        self.port = port or free_port()
        self.config = tuple(config)
        self.proc: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        self._lock: int | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.user}:{self.password}@127.0.0.1:{self.port}/0"

    def _prepare(self) -> None:
        """The data directory (0700), its lock, its password; no stale server on it."""
        from broker.auth import new_token

        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        if self._lock is None:
            self._lock = _lock_dir(self.dir, "the embedded Redis")
        for pid in _redis_servers_in(self.dir):
            log.warning("stopping redis-server pid %d left running on %s by an earlier broker",
                        pid, self.dir)
            _stop_pid(pid)
        if self.password is None:
            path = self.dir / "password"
            try:
                self.password = path.read_text().strip() or None
                os.chmod(path, 0o600)
            except FileNotFoundError:
                pass
            if self.password is None:
                self.password = new_token()
                write_private(path, self.password + "\n")
        secrets.register(self.password)

    def start(self) -> EmbeddedRedis:
        self._prepare()
        assert self.password is not None
        main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            [self.binary, "-", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.dir.resolve()), "--appendonly", "yes",
             "--appendfsync", "everysec", "--save", "", "--loglevel", "warning"],
            # its own session: a terminal's Ctrl-C reaches the broker, which drains the jobs
            # and then stops Redis, rather than killing Redis under the draining broker
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, umask=0o077,  # its AOF: owner only
            preexec_fn=_die_with_parent(os.getpid()) if main else None)
        assert self.proc.stdin is not None
        # the config on stdin: the password is in no command line (/proc/PID/cmdline is public)
        acl = ACL_BROKER.format(user=self.user, password=self.password)
        self.proc.stdin.write("".join(f"{line}\n" for line in (
            ACL_DEFAULT, acl, *self.config)).encode())
        self.proc.stdin.close()
        client = redis.Redis(port=self.port, username=self.user, password=self.password,
                             socket_connect_timeout=0.2)
        deadline = time.monotonic() + 15
        try:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    # PING answers while the AOF still loads; wait until data is served.
                    if client.ping() and client.info("persistence").get("loading", 0) == 0:
                        return self
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not start on port {self.port} (data {self.dir})")

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is not None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def restart(self, *, kill: bool = True) -> None:
        lock, self._lock = self._lock, None  # held across the restart
        try:
            self.stop(kill=kill)
        finally:
            self._lock = lock
        self.start()


def _die_with_parent(parent: int) -> Any:
    """On Linux, what a child runs before exec so that it gets SIGTERM (for redis-server a
    clean AOF flush and exit) when its parent dies: a ``kill -9``'d broker leaves no server
    behind. The signal comes when the forking thread ends, so only the main thread uses it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return setup


PR_SET_PDEATHSIG = 1


def _lock_dir(path: Path, what: str) -> int:
    """An exclusive flock on ``path/lock`` (the fd, held until closed; the kernel drops it when
    the process dies however it dies); a RuntimeError naming the holder when another has it."""
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RuntimeError(f"{path} is in use: process {holder} runs {what} there (another "
                           "`fleet up` on this --state-dir?); stop it or use another "
                           "--state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _redis_servers_in(data_dir: Path) -> list[int]:
    """Live redis-server processes working in ``data_dir`` (``--dir`` makes it their cwd)."""
    want = data_dir.resolve()
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if "redis-server" not in (entry / "comm").read_text() or \
                    Path(os.readlink(entry / "cwd")) != want:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _stop_pid(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid`` (redis-server flushes its AOF and exits), SIGKILL after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid) and time.monotonic() < deadline + 5:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """The leader loop over a store and a provider."""

    def __init__(self, config: BrokerConfig, store: Store, provider: FleetProvider,
                 skipped: dict[str, str] | None = None, blobs: BlobStore | None = None) -> None:
        self.config = config
        self.store = store
        self.provider = provider
        self.blobs = blobs  # this replica's packs (each replica keeps what it was sent)
        self._swept = -math.inf  # when this replica last deleted the packs no job needs
        self.skipped = skipped or {}  # declared clouds without credentials -> why
        secrets.register(config.agent_token)  # never in a stored reason
        self.scheduler = Scheduler(store, config.scheduler, priors=provider.interruption_priors,
                                   blocklist_decay_s=config.blocklist_decay_s,
                                   refusal_decay_s=config.refusal_decay_s)
        self.actuator = Actuator(store, provider, ActuatorConfig(
            checkpoint_root=config.state_dir / "checkpoints", broker_url=config.broker_url,
            agent_token=config.agent_token, use_agent=config.use_agent,
            heartbeat_interval_s=config.heartbeat_interval_s,
            max_failures=config.scheduler.max_failures,
            launch_deadline_s=config.launch_deadline_s if config.broker_url else None,
            secrets_dir=config.state_dir, rendezvous_margin_s=config.rendezvous_margin_s,
            refusal_decay_s=config.refusal_decay_s))
        self.reconciler = Reconciler(
            store, provider, max_failures=config.scheduler.max_failures,
            blocklist_decay_s=config.blocklist_decay_s, refusal_decay_s=config.refusal_decay_s,
            # without a broker URL no agent can report: no heartbeat is ever late
            launch_deadline_s=config.launch_deadline_s if config.broker_url else None,
            # agents re-form a multi-node group with a stand-in through the broker's rendezvous
            replace_lost_nodes=config.broker_url is not None,
            final_report_wait_s=config.final_report_wait_s
            if config.broker_url and config.use_agent else None,
            quick_reclaim_s=config.quick_reclaim_s)
        self.fence = 0
        self.rounds = 0
        self._announced = -math.inf  # when this replica last named its API URL in Redis
        self._buckets: dict[str, str | None] = {}  # checkpoint URI -> its bucket's region
        self._examined: set[str] = set()  # waiting jobs whose checkpoint bucket was looked at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._came_round = time.monotonic()  # when the loop last started a pass

    def step(self) -> bool:
        """One pass of the loop; returns whether this process is the leader."""
        self._announce()
        self._sweep_blobs()
        self.fence = self.store.acquire_lease(self.config.owner, self.config.lease_ttl_s)
        if not self.fence:
            return False
        try:
            for cmd in self.store.pop_commands():
                self._command(cmd)
            self.store.set_pools(self.provider.pools())
            self._locate_checkpoints()
            self.reconciler.run(self.fence)
            started = time.perf_counter()
            res = self.scheduler.run_round(self.fence)
            metrics.ROUND_SECONDS.observe(time.perf_counter() - started)
            metrics.SOLVE_SECONDS.observe(res.solve_s)
            self.actuator.run(self.fence)
            self.rounds += 1
        except StaleFence:
            log.warning("lost the leader lease (fence %s); standing by", self.fence)
            self.fence = 0
        return bool(self.fence)

    def _announce(self) -> None:
        """Name this replica's API a live one, a few times per lease: agents report to any
        replica (a launch lists them all)."""
        url, now = self.config.broker_url, time.monotonic()
        if url is None or now < self._announced + self.config.lease_ttl_s / 3:
            return
        self._announced = now
        self.store.announce_broker(url, ttl_s=3 * self.config.lease_ttl_s)

    def _sweep_blobs(self) -> None:
        """Delete this replica's packs that no job still waiting or running references, once
        ``blob_retention_s`` old (every replica: each keeps the packs it was sent). A finished
        job's packs go with it; a relaunch of a waiting job still finds its own."""
        now = time.monotonic()
        if self.blobs is None or now < self._swept + BLOB_SWEEP_S:
            return
        self._swept = now
        active = self.store.list_jobs(states=[s for s in JobState if not s.terminal])
        keep = {source.removeprefix(BLOB_PREFIX) for job in active
                for source in (job.spec.workdir, *(m.source for m in job.spec.file_mounts))
                if source and source.startswith(BLOB_PREFIX)}
        removed = self.blobs.collect(keep, self.config.blob_retention_s)
        if removed:
            log.info("deleted %d packed file(s) no active job references", removed)

    def _locate_checkpoints(self) -> None:
        """Name the region of a waiting job's checkpoint bucket where its spec does not
        (``checkpoint.region``), asking the clouds once per URI: placement prices the restore
        from there and every checkpoint written from elsewhere. Each job is read once per
        broker process (this runs every pass, beside thousands of waiting jobs)."""
        waiting = self.store.job_ids([JobState.QUEUED, JobState.SUSPENDED])
        self._examined &= waiting  # forget jobs that no longer wait
        for job_id in waiting - self._examined:
            self._examined.add(job_id)
            job = self.store.get_job(job_id)
            if job is None:
                continue
            ck = job.spec.checkpoint
            if ck.uri is None or ck.region is not None:
                continue
            if ck.uri not in self._buckets:
                self._buckets[ck.uri] = self.provider.bucket_region(ck.uri)
            region = self._buckets[ck.uri]
            if region is None:
                continue
            spec = job.spec.model_copy(update={"checkpoint": ck.model_copy(
                update={"region": region})})
            plan = Plan()
            transitions.checkpoint_located(plan, job, spec=spec, uri=ck.uri, region=region,
                                           fence=self.fence)
            try:
                self.store.apply(plan, fence=self.fence)
            except Conflict:  # the job changed meanwhile: look at it again next pass
                self._examined.discard(job_id)

    def _command(self, cmd: dict[str, Any]) -> None:
        if cmd.get("kind") == "node":
            self._node_chaos(str(cmd["job_id"]), int(cmd["rank"]), str(cmd["how"]))
        if cmd.get("kind") == "preempt":
            try:
                n = self.provider.reclaim(str(cmd["region"]), float(cmd.get("duration_s", 60)))
            except InvalidInput as exc:  # no such spot region, or no local regions at all
                log.warning("chaos preempt refused: %s", exc)
                return
            plan = Plan()
            plan.event("region-reclaimed", None, {"region": cmd["region"], "nodes": n})
            self.store.apply(plan, fence=self.fence)

    def _node_chaos(self, job_id: str, rank: int, how: str) -> None:
        """Chaos: reclaim or kill the node of ``rank`` of a job (local pretend regions)."""
        job = self.store.get_job(job_id)
        node = next((n for n in self.provider.nodes() if job is not None
                     and n.node_id in job.node_ids and (n.rank or 0) == rank), None)
        try:
            if node is None:
                raise NotFound(f"job {job_id} has no live node of rank {rank}")
            self.provider.node_chaos(node.node_id, how)
        except (NotFound, InvalidInput) as exc:
            log.warning("chaos on a node refused: %s", exc)
            return
        plan = Plan()
        plan.event("node-killed" if how == "kill" else "node-reclaimed", job_id,
                   {"node": node.node_id, "rank": rank})
        self.store.apply(plan, fence=self.fence)

    def _keep_lease(self) -> None:
        """Renew the lease a third of its TTL apart on this thread's own timer, so that neither
        a long pass nor API requests served by this process can let it lapse; a loop that has
        not come round for ``lease_stall_s`` is no longer renewed for."""
        while not self._stop.wait(self.config.lease_ttl_s / 3):
            fence = self.fence
            if not fence or time.monotonic() - self._came_round > self.config.lease_stall_s:
                continue
            try:
                held = self.store.acquire_lease(self.config.owner, self.config.lease_ttl_s)
            except redis.RedisError as exc:
                log.warning("could not renew the leader lease (%s); retrying", exc)
                continue
            if held != fence:  # the loop's next write with the old fence is refused
                log.warning("the leader lease (fence %s) lapsed; now %s", fence, held)

    def run_forever(self) -> None:
        keeper = threading.Thread(target=self._keep_lease, name="broker-lease", daemon=True)
        keeper.start()
        while not self._stop.is_set():
            self._came_round = time.monotonic()
            try:
                if not self.step():  # a standby polls the lease; it leaves the wakes alone
                    self._stop.wait(self.config.lease_ttl_s / 3)
                    continue
                self.store.wait_wake(0.1 if self.store.intents() else self.config.tick_s)
            except redis.ConnectionError as exc:  # Redis restarting or failing over
                log.warning("redis unavailable (%s); retrying", exc)
                self._stop.wait(min(1.0, self.config.tick_s))
            except Exception:  # one bad pass must not stop the control plane; state is in Redis
                log.exception("broker loop pass failed; retrying")
                self._stop.wait(self.config.tick_s)
        keeper.join()  # its last renewal lands before stop() releases the lease

    def start(self) -> Broker:
        self._thread = threading.Thread(target=self.run_forever, name="broker-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, release: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if release and self.fence:
            self.store.release_lease(self.fence)


def register_url_password(url: str) -> None:
    """Treat the password of a Redis URL (``redis://user:pass@host``) as a secret."""
    import urllib.parse

    with contextlib.suppress(ValueError):
        secrets.register(urllib.parse.unquote(urllib.parse.urlsplit(url).password or ""))


def build_broker(config: BrokerConfig, *, redis_url: str | None = None,
                 blobs: BlobStore | None = None) -> Broker:
    """A broker over ``redis_url`` (or ``config.redis_url``) with the fleet file's providers:
    its local pretend regions and the declared clouds that have credentials; it deletes the
    packs of ``blobs`` no active job needs."""
    url = redis_url or config.redis_url
    if url is None:
        raise InvalidInput("build_broker needs a redis URL; run_server starts an embedded one")
    provider, skipped = build_fleet_provider(config.fleet, config.state_dir, REPO,
                                             reason=secrets.reason)
    return Broker(config, Store.from_url(url, confirm_durable=config.confirm_durable),
                  provider, skipped, blobs)


def drain(provider: FleetProvider) -> None:
    """Ask every node to checkpoint and exit, and wait (killing after the grace period): a
    later broker resumes those jobs from their checkpoints."""
    from providers.base import NodeState

    for node in provider.nodes():
        provider.terminate(node.node_id)
    deadline = time.monotonic() + provider.grace_period_s + 5
    while time.monotonic() < deadline and any(
            n.state is not NodeState.TERMINATED for n in provider.nodes()):
        time.sleep(0.2)


def _tokens(state_dir: Path) -> dict[str, str]:
    """The admin and agent tokens: from FLEET_ADMIN_TOKEN / FLEET_AGENT_TOKEN, else made once
    and kept (mode 0600) in the state dir so clients keep working across restarts."""
    from broker.auth import new_token

    path = state_dir / "tokens.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    tokens = {"admin": os.environ.get(BrokerEnv.ADMIN_TOKEN) or saved.get("admin") or new_token(),
              "agent": os.environ.get(BrokerEnv.AGENT_TOKEN) or saved.get("agent") or new_token()}
    if tokens != saved:
        write_private(path, json.dumps(tokens))
    elif path.exists():
        os.chmod(path, 0o600)
    secrets.register(*tokens.values())
    return tokens


class Stack:
    """Everything ``fleet up`` runs: embedded redis-server (unless ``config.redis_url``), the
    HTTP API (agents' heartbeats included) on ``host:port`` and the broker loop."""

    def __init__(self, config: BrokerConfig, *, host: str = "127.0.0.1", port: int = 8470,
                 api: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.host, self.port = host, port or free_port()
        self.api = api  # the broker config's api section (broker.config)
        self.redis: EmbeddedRedis | None = None
        self.broker: Broker | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.tokens: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Stack:
        import uvicorn

        from broker.api import build_app
        from broker.auth import ApiConfig, Role

        state = self.config.state_dir
        state.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(state, 0o700)  # tokens, Redis data, checkpoints and job logs: owner only
        url = self.config.redis_url
        if url is None:
            self.redis = EmbeddedRedis(state / "redis").start()
            url = self.redis.url
        else:
            register_url_password(url)
        self.tokens = _tokens(state)
        api_config = (ApiConfig.load(self.api)
                      .with_token(self.tokens["admin"], Role.ADMIN)
                      .with_token(self.tokens["agent"], Role.AGENT)
                      .with_attempt_key(self.tokens["agent"]))
        config = self.config.model_copy(update={
            "redis_url": url, "broker_url": self.url, "agent_token": self.tokens["agent"]})
        blobs = BlobStore(state / "blobs", api_config.blob_quota_bytes)
        try:
            self.broker = build_broker(config, blobs=blobs)
        except Exception:
            self.stop()  # no embedded redis-server left behind
            raise
        local = self.broker.provider.local
        if local is not None and local.job_user is None:
            log.warning(JOBS_AS_BROKER_USER, state)
        app = build_app(self.broker.store, api_config, ceiling=self.broker.provider.ceiling,
                        sealer=Sealer.load(state), blobs=blobs)
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=self.host, port=self.port, log_level="warning", access_log=False,
            lifespan="off", log_config=None))  # its records go to broker.logs' handler
        self._thread = threading.Thread(target=self._server.run, name="api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"the API could not listen on {self.url} (port in use? "
                                   "pass --port)")
            time.sleep(0.05)
        self.broker.start()
        return self

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()
            drain(self.broker.provider)
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        if self.redis is not None:
            self.redis.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m broker.server --redis-url URL --state-dir DIR [--fleet F] [--no-agent]``:
    the leader loop alone (tests kill and restart it), tuned from the environment as ``fleet
    up`` is (``FLEET_SCHEDULER__...``, ``FLEET_BROKER__...``: docs/configuration.md)."""
    import argparse

    from broker import config as settings  # it imports this module

    ap = argparse.ArgumentParser(prog="python -m broker.server")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--fleet", type=Path, default=DEFAULT_FLEET)
    ap.add_argument("--tick", type=float, default=0.5)
    ap.add_argument("--lease-ttl", type=float, default=3.0)
    ap.add_argument("--owner", default=None)
    ap.add_argument("--no-agent", action="store_true")
    args = ap.parse_args(argv)
    logs.configure(os.environ.get(BrokerEnv.LOG_FORMAT, "text"),
                   os.environ.get(BrokerEnv.LOG_LEVEL, "warning"))
    os.umask(0o077)
    register_url_password(args.redis_url)
    tuned = settings.load(None, {"broker": {"tick_s": args.tick, "lease_ttl_s": args.lease_ttl}})
    config = tuned.broker_config(state_dir=args.state_dir, redis_url=args.redis_url,
                                 fleet=args.fleet, use_agent=not args.no_agent,
                                 **({"owner": args.owner} if args.owner else {}))
    build_broker(config).run_forever()


if __name__ == "__main__":
    main()
