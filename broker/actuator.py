"""The actuator: carries out the outbox's intents through a provider, idempotently (the launch
key is job id + fence + attempt), and records each outcome and placement interval atomically
under the current leader's fence. Replaying an intent after a crash is always safe.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from broker import metrics, secrets, skyenv, transitions
from broker.auth import attempt_token
from broker.costs import ondemand_reference
from broker.models import Intent, IntentKind, JobRecord, JobState, Placement, carry_out_order
from broker.protocol import Env
from broker.runtime.files import FILES_ENV
from broker.sealed import Sealer, SealError
from broker.store import Conflict, Plan, Store
from policies.migration import (
    Blocklist,
    expire,
    location_keys,
    mark_launched,
    mark_refused,
    refusal_key,
    refused_zones,
)
from policies.models import FileMount, JobSpec, Market, Pool
from providers import registry
from providers.base import (
    CapacityError,
    LaunchRequest,
    Node,
    NodeState,
    Provider,
    ProviderError,
    QuotaError,
    launch_key_of,
    replacement_key,
)

log = logging.getLogger(__name__)


class ActuatorConfig(BaseModel):
    checkpoint_root: Path = Path(".state/checkpoints")
    broker_url: str | None = None  # where agents post heartbeats
    peer_urls: list[str] = []  # the other broker replicas: agents report there when it is down
    agent_token: str | None = None
    use_agent: bool = True  # run the command under ``broker.runtime.agent``
    heartbeat_interval_s: float = 5.0
    max_failures: int = 3
    # the broker's launch deadline (``Reconciler``): a gang's agents wait longer at the
    # rendezvous, so the broker, not a survivor, decides that a stand-in is not coming
    launch_deadline_s: float | None = None
    secrets_dir: Path | None = None  # where the key that opens the jobs' secrets is (its state dir)
    rendezvous_margin_s: float = 600.0  # a stand-in's launch, after the deadline, and its boot
    refusal_decay_s: float | None = None  # how long a refused pool stays marked (None: stored)


def launch_request(job: JobRecord, intent: Intent, pool: Pool, config: ActuatorConfig, *,
                   backend_starts_agent: bool = False,
                   avoid_zones: tuple[str, ...] = (),
                   ranks: tuple[int, int] | None = None,
                   zone: str | None = None,
                   secret_env: Mapping[str, str] | None = None,
                   fetch_secrets: bool = False) -> LaunchRequest:
    """The provider request for a launch intent: the job's command under the runtime agent with
    the assigned world size, batch size and checkpoint location in its environment. Where the
    backend's start script runs the agent itself (cloud VMs) the command is not wrapped again.
    ``avoid_zones``: the pool's zones that just refused a launch.

    A count the pool sells only as a gang (``Pool.shape``) is that many nodes; the provider
    gives each its rank, and their agents find rank 0 through the broker's rendezvous.
    ``ranks`` (first rank, nodes): a REPLACE intent's stand-ins for lost nodes of the job's
    current launch, under their own key (``providers.base.replacement_key``), shaped as the gang
    was launched (whatever the pool sells now) and in the survivors' ``zone``. ``secret_env``:
    the job's opened secrets, in its environment beside its envs; with ``fetch_secrets`` (a
    backend whose start script the cloud keeps in clear: ``Provider.keeps_secrets``) only their
    names are (``Env.SECRET_ENVS``), and the agent fetches the values from the broker with its
    attempt token (``ProviderError`` when this broker gives its agents no URL or token)."""
    spec = job.spec
    secret_env = secret_env or {}
    names = sorted(secret_env)
    if fetch_secrets and names and not (config.broker_url and config.agent_token):
        raise ProviderError(
            f"the job has secrets, which its agent on {pool.cloud} fetches from the broker, and "
            "this broker gives its agents no URL or token to fetch them with: set broker_url")
    if ranks is None:  # the gang the scheduler placed (its node count), else the pool's shape
        gang = spec.nodes or job.nodes
        nodes, per_node = (gang, intent.gpus // gang) \
            if (gang > 1 or spec.nodes) and intent.gpus % gang == 0 else \
            pool.shape(intent.gpus) or (1, intent.gpus)
        first_rank, count, key = 0, nodes, intent.key
    else:
        nodes, per_node = job.nodes, job.gpus // max(1, job.nodes)
        first_rank, count = ranks
        key = replacement_key(job.launch_key or intent.key, first_rank, intent.round)
    checkpoint = spec.checkpoint.uri or str((config.checkpoint_root / job.id).resolve())
    env = {
        **spec.envs,
        **(secret_env if not fetch_secrets else
           {Env.SECRET_ENVS: ",".join(names)} if names else {}),
        Env.JOB_ID: job.id,
        Env.ATTEMPT: str(intent.attempt),
        Env.LAUNCH_KEY: key,
        Env.NPROC: str(per_node),
        Env.NNODES: str(nodes),
        Env.ROUND: str(intent.round),
        Env.GLOBAL_BATCH_SIZE: str(intent.batch_size or spec.batch_size.initial),
        Env.BATCH_MODE: spec.batch_mode.value,
        Env.CHECKPOINT_URI: checkpoint,
        Env.RUN: spec.run,
        **({Env.SETUP: spec.setup} if spec.setup and spec.run_per_node else {}),
        Env.HEARTBEAT_INTERVAL: str(config.heartbeat_interval_s),
    }
    if nodes == 1:  # one node is its own master; a gang meets at the broker's rendezvous
        env[Env.MASTER_ADDR] = "127.0.0.1"
    elif config.launch_deadline_s is not None:
        env[Env.RENDEZVOUS_TIMEOUT] = f"{config.launch_deadline_s + config.rendezvous_margin_s:g}"
    # The spec's interval is the runtime's default; an interval the script passes itself wins.
    every, in_steps = spec.checkpoint.every
    env[Env.CHECKPOINT_EVERY_STEPS if in_steps else Env.CHECKPOINT_EVERY_SECONDS] = \
        str(every)
    if config.broker_url:
        env[Env.BROKER_URL] = ",".join(dict.fromkeys([config.broker_url, *config.peer_urls]))
    agent = config.use_agent or backend_starts_agent
    if config.agent_token and agent:  # the key, never handed out: the agent gets its attempt's
        # token (the provider hands it over in a way the job cannot read back, see docs/security)
        env[Env.AGENT_TOKEN] = attempt_token(config.agent_token, job.id, intent.attempt)
    if spec.workdir or spec.file_mounts:  # the agent places them before setup (runtime.files)
        env[FILES_ENV] = json.dumps({"workdir": spec.workdir, "mounts": [
            _placed_mount(m, pool.cloud) for m in spec.file_mounts]})
    if spec.container_image:  # the agent runs setup and run in it (broker.runtime.container)
        env[Env.CONTAINER_IMAGE] = spec.container_image
        env[Env.CONTAINER_ENV] = ",".join(sorted({*spec.envs, *names}))
    if spec.run_per_node:
        # A CPU node's one unit is the node, not a GPU: SkyPilot's count is 0 there.
        env.update(skyenv.task_env(job, pool, nodes=nodes,
                                   gpus_per_node=0 if spec.cpu_only else per_node,
                                   zone=zone or pool.zone))
    if spec.cpu_only:  # no GPU even on a machine with some, with the agent or without it
        env[Env.CPU_ONLY] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    # The agent starts first, so that it has taken its token before any of the job's code (its
    # setup included) runs; setup then runs in each worker before run, as on the clouds.
    script = _script(spec)
    command = [sys.executable, "-m", "broker.runtime.agent", "--", "sh", "-c", script] \
        if config.use_agent and not backend_starts_agent else ["sh", "-c", script]
    return LaunchRequest(idempotency_key=key, job_id=job.id, cloud=pool.cloud,
                         region=pool.region, zone=zone or pool.zone, avoid_zones=avoid_zones,
                         accelerator=pool.accelerator, gpus_per_node=per_node, nodes=count,
                         first_rank=first_rank, market=pool.market, env=env,
                         secret_names=frozenset(() if fetch_secrets else names),
                         command=command)


def _fetches_secrets(backend: Provider) -> bool:
    """Whether ``backend``'s agents fetch the job's secrets from the broker: its start script
    runs the agent and the cloud keeps that script in clear (user data)."""
    return backend.starts_agent and not backend.keeps_secrets


def _placed_mount(mount: FileMount, cloud: str) -> dict[str, Any]:
    """A mount as the agent gets it: a named bucket with no ``store`` lands on the store of the
    cloud the job is placed on, as SkyPilot's does; only here is that cloud known. On a cloud
    with no store (local: ``Cloud.object_store``) it stays unset and the agent fails the launch
    naming the fix."""
    out = mount.model_dump(mode="json")
    if mount.name and not mount.store:
        home = registry.clouds().get(cloud)
        out["store"] = home.object_store if home else None
    return out


def _script(spec: JobSpec) -> str:
    """The shell line a worker runs: setup, then run. A SkyPilot task's run as SkyPilot runs it:
    under bash (its examples use bash syntax), setup in a process of its own whose failure fails
    the node, the script text read from the environment (never spliced into a command line)."""
    if spec.run_per_node:
        setup = f'bash -c "${Env.SETUP}" || exit $?\n' if spec.setup else ""
        return setup + f'exec bash -c "${Env.RUN}"'
    return (f"{spec.setup}\n" if spec.setup else "") + f'exec sh -c "${Env.RUN}"'


def launch_price(nodes: list[Node], pool_price: float) -> float:
    """USD per GPU-hour of a launch: what the backend says the nodes cost where they landed (an
    AWS spot launch that fell back to a dearer AZ), else the pool's price."""
    known = [n.price_per_gpu_hour for n in nodes if n.price_per_gpu_hour is not None]
    return max(known) if nodes and len(known) == len(nodes) else pool_price


class Actuator:
    def __init__(self, store: Store, provider: Provider,
                 config: ActuatorConfig | None = None) -> None:
        self.store = store
        self.provider = provider
        self.config = config or ActuatorConfig()
        self._sealer: Sealer | None = None  # opens the jobs' secrets, once one has them

    def _secret_env(self, job: JobRecord) -> dict[str, str]:
        """The job's secrets, opened for its launch (also where its agent fetches them: a key
        that cannot open them fails the launch here, not on the node); ``ProviderError`` (the
        launch fails with the reason) when this broker cannot open them."""
        if not job.sealed_secrets:
            return {}
        if self.config.secrets_dir is None:
            raise ProviderError("the job has secrets and this broker has no secrets key")
        try:
            self._sealer = self._sealer or Sealer.load(self.config.secrets_dir)
            return self._sealer.open(job.sealed_secrets)
        except SealError as exc:
            raise ProviderError(str(exc)) from None

    def run(self, fence: int) -> int:
        """Carry out every pending intent; returns how many were settled."""
        intents = self.store.intents()
        if not intents:
            return 0
        pools = {p.id: p for p in self.store.pools()}
        if self.config.broker_url:  # the replicas live now: a launch's agents report to any
            self.config.peer_urls = [u for u in self.store.broker_urls()
                                     if u != self.config.broker_url]
        done = 0
        for intent in carry_out_order(intents):
            try:
                done += self._one(intent, fence, pools)
            except Conflict as exc:  # the job moved on; the next pass sees its new state
                log.info("intent %s: %s", intent.id, exc)
        return done

    def _one(self, intent: Intent, fence: int, pools: dict[str, Pool]) -> int:
        job = self.store.get_job(intent.job_id)
        plan = Plan(intents_del=[intent.id])
        if job is None:
            self.store.apply(plan, fence=fence)
            return 1
        if intent.kind is IntentKind.LAUNCH:
            return self._launch(job, intent, fence, pools, plan)
        if intent.kind is IntentKind.REPLACE:
            return self._replace(job, intent, fence, pools, plan)
        if intent.kind is IntentKind.RESIZE_IN_PLACE:
            if job.state is JobState.RUNNING and job.attempt == intent.attempt:
                for node_id in job.node_ids:
                    self.provider.resized(node_id, intent.gpus)
            self.store.apply(plan, fence=fence)
            return 1
        # resize / migrate / suspend / stop: ask the nodes to checkpoint and exit. The
        # reconciler records the outcome when they are gone.
        for node_id in job.node_ids:
            self.provider.terminate(node_id)
        plan.event(intent.kind.value + "-sent", job.id, {"nodes": job.node_ids})
        self.store.apply(plan, fence=fence)
        return 1

    def _refused(self, job: JobRecord, pool: Pool, exc: ProviderError, fence: int,
                 plan: Plan) -> None:
        """The cloud refused the launch for want of capacity or quota, which says nothing
        about the job: suspend it without counting a failure, and block the pool in the stored
        blocklist for ``refusal_decay_s`` (the same atomic step) so the next round places the
        job elsewhere while any other pool has room. A refusal in one zone while the pool has
        others (an AWS spot AZ) blocks only that zone: the next round's attempt, a new launch
        key, may go to the same pool and avoids the zone (``launch_request``)."""
        what = self._mark_refused(job, pool, exc, plan)
        transitions.launch_failed(plan, job, secrets.reason(f"{what}: {exc}"), fence=fence,
                                  max_failures=self.config.max_failures, counted=False)
        self.store.apply(plan, fence=fence)

    def _blocklist(self) -> tuple[Blocklist, str | None]:
        return self.store.blocklist(refusal_decay_s=self.config.refusal_decay_s)

    def _mark_refused(self, job: JobRecord, pool: Pool, exc: ProviderError, plan: Plan) -> str:
        """Put ``pool``'s (or its zone's) refusal mark into ``plan``; returns what was missing."""
        now = time.time()
        missing = "capacity" if isinstance(exc, CapacityError) else "quota"
        zone = exc.zone if isinstance(exc, CapacityError) else None
        blocklist, read = self._blocklist()
        blocklist = mark_refused(expire(blocklist, now), refusal_key(pool.id, zone), now,
                                 missing)
        plan.set_blocklist(blocklist, read=read)
        what = f"no {missing}"
        plan.event("pool-refused", job.id, {"pool": pool.id, "zone": zone, "error": what,
                                          "decay_s": blocklist.refusal_decay_s})
        return what

    def _launch(self, job: JobRecord, intent: Intent, fence: int, pools: dict[str, Pool],
                plan: Plan) -> int:
        if job.state is not JobState.LAUNCHING or job.launch_key != intent.key:
            self.store.apply(plan, fence=fence)  # superseded
            return 1
        if job.cancel_requested:
            transitions.cancelled(plan, job, "cancelled before launch", fence=fence)
            self.store.apply(plan, fence=fence)
            return 1
        # Never two attempts at once: an older attempt's node must be gone first.
        if self._in_the_way(self.provider.nodes(), job,
                            lambda n: n.idempotency_key != intent.key):
            return 0
        pool = pools.get(intent.pool or "")
        if pool is None:
            transitions.launch_failed(plan, job, f"pool {intent.pool} is gone", fence=fence,
                                      max_failures=self.config.max_failures, counted=False)
            self.store.apply(plan, fence=fence)
            return 1
        if not self._leads(fence):
            return 0  # lost the lease: leave the intent to the next leader
        try:
            backend = self.provider.for_cloud(pool.cloud)
            starts_agent = backend.starts_agent
            request = launch_request(job, intent, pool, self.config,
                                     backend_starts_agent=starts_agent,
                                     avoid_zones=self._refused_zones(pool),
                                     secret_env=self._secret_env(job),
                                     fetch_secrets=_fetches_secrets(backend))
            if request.nodes > 1 and starts_agent and not self.config.broker_url:
                raise ProviderError(
                    f"a {request.nodes}-node gang on {pool.cloud} meets at the broker's "
                    "rendezvous, and this broker has no URL its agents can reach: set the "
                    "broker's broker_url, or give the job at most "
                    f"{request.gpus_per_node} GPUs")
            nodes = self.provider.launch(request)
        except (CapacityError, QuotaError) as exc:
            metrics.provider_error(pool.cloud, exc)
            self._refused(job, pool, exc, fence, plan)
            return 1
        except ProviderError as exc:
            metrics.provider_error(pool.cloud, exc)
            transitions.launch_failed(plan, job, secrets.reason(f"launch failed: {exc}"),
                                      fence=fence, max_failures=self.config.max_failures)
            self.store.apply(plan, fence=fence)
            return 1
        now = time.time()
        start = min((n.launched_at.timestamp() for n in nodes if n.launched_at), default=now)
        if job.attempt > 1:  # EC2's LaunchTime has whole seconds: never before the last end
            ends = [p.end for p in self.store.placements(job.id) if p.end is not None]
            start = max([start, *ends])
        transitions.running(plan, job, node_ids=[n.node_id for n in nodes], started=start,
                            fence=fence)
        plan.open_placement(Placement(
            job_id=job.id, attempt=intent.attempt, start=start, pool=pool.id, cloud=pool.cloud,
            region=pool.region, market=pool.market, gpus=intent.gpus,
            batch_size=intent.batch_size,
            price_per_gpu_hour=launch_price(nodes, pool.price_for(intent.gpus)),
            ondemand_price_per_gpu_hour=ondemand_reference(pool, pools.values())))
        if pool.market is Market.SPOT:
            self._reactivate(job, pool, plan)
        self.store.apply(plan, fence=fence)
        if job.started_at is None:  # its first launch: it waited since submission
            metrics.first_launch(job.team, start - job.submitted_at)
        return 1

    def _replace(self, job: JobRecord, intent: Intent, fence: int, pools: dict[str, Pool],
                 plan: Plan) -> int:
        """Launch stand-ins for a running multi-node job's lost ranks in its pool, each under
        its own key (idempotent), and add them to the job; its survivors wait for them in the
        intent's rendezvous round. When the pool refuses (capacity, quota) or is gone, the whole
        job checkpoints and moves instead (``policies.migration.Recovery.MIGRATE``)."""
        if job.state is not JobState.RUNNING or job.attempt != intent.attempt or \
                job.round != intent.round:
            self.store.apply(plan, fence=fence)  # superseded: the job moved on
            return 1
        # The node a stand-in replaces must be gone first (a reclaimed one checkpoints within
        # its grace period), as for an older attempt: it still holds its GPUs and quota.
        launch = job.launch_key or ""
        inventory = self.provider.nodes()
        if self._in_the_way(inventory, job, lambda n: n.node_id not in job.node_ids
                            and launch_key_of(n.idempotency_key) == launch
                            and (n.rank or 0) in intent.ranks and n.idempotency_key !=
                            replacement_key(launch, n.rank or 0, intent.round)):
            return 0
        if not self._leads(fence):
            return 0  # lost the lease: leave the intent to the next leader
        pool = pools.get(job.pool or "")
        # the survivors' zone: a gang's collectives stay inside one AZ
        zone = next((n.zone for n in inventory if n.node_id in job.node_ids and n.zone), None)
        nodes: list[Node] = []
        try:
            if pool is None:
                raise ProviderError(f"pool {job.pool} is gone")
            backend = self.provider.for_cloud(pool.cloud)
            secret_env = self._secret_env(job)
            for rank in intent.ranks:
                nodes += self.provider.launch(launch_request(
                    job, intent, pool, self.config, backend_starts_agent=backend.starts_agent,
                    ranks=(rank, 1), zone=zone, secret_env=secret_env,
                    fetch_secrets=_fetches_secrets(backend)))
        except ProviderError as exc:
            if pool is not None:
                metrics.provider_error(pool.cloud, exc)
            if pool is not None and isinstance(exc, CapacityError | QuotaError):
                self._mark_refused(job, pool, exc, plan)
            for node_id in [*job.node_ids, *(n.node_id for n in nodes)]:
                self.provider.terminate(node_id)  # the survivors checkpoint and exit
            transitions.stopping(
                plan, job, event="replace-failed",
                data={"ranks": intent.ranks, "error": secrets.reason(exc)},
                reason=secrets.reason(f"no stand-in for lost node(s) {intent.ranks}: {exc}; "
                                      "moving the job"), fence=fence)
            self.store.apply(plan, fence=fence)
            return 1
        # No SpotHedge reactivation: a stand-in goes where its gang runs, not to a location
        # chosen as a last resort, and must not undo the block of the reclaim it mends.
        transitions.nodes_replaced(plan, job, ranks=intent.ranks, round_=intent.round,
                                   node_ids=[n.node_id for n in nodes], fence=fence)
        self.store.apply(plan, fence=fence)
        return 1

    def _leads(self, fence: int) -> bool:
        """Whether ``fence`` still holds the leader lease (checked right before a launch)."""
        leader = self.store.leader()
        return leader is not None and leader[0] == fence

    def _in_the_way(self, inventory: list[Node], job: JobRecord,
                    leaving: Callable[[Node], bool]) -> bool:
        """Stop the job's live nodes of ``inventory`` that must be gone before a launch
        (``leaving``); True while any is still there (the intent waits for the next pass)."""
        doomed = [n for n in inventory if n.job_id == job.id
                  and n.state is not NodeState.TERMINATED and leaving(n)]
        for n in doomed:
            self.provider.terminate(n.node_id)
        return bool(doomed)

    def _refused_zones(self, pool: Pool) -> tuple[str, ...]:
        """The zones of an unpinned spot pool that just refused a launch (``_refused``)."""
        if pool.market is not Market.SPOT or pool.zone:
            return ()
        return refused_zones(self._blocklist()[0], pool.id, time.time())

    def _reactivate(self, job: JobRecord, pool: Pool, plan: Plan) -> None:
        """SpotHedge's ``mark_launched``: a spot launch that succeeded in a blocked location
        (placement's last resort when nothing else had room) shows capacity is back there, so
        the location is active again, in the launch's atomic step."""
        now = time.time()
        blocklist, read = self._blocklist()
        back = [k for k in location_keys(pool) if blocklist.is_blocked(k, now)]
        if not back:
            return
        for key in back:
            blocklist = mark_launched(blocklist, key)
        plan.set_blocklist(blocklist, read=read)
        plan.event("location-active", job.id, {"locations": back, "pool": pool.id})
