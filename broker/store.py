"""The control plane's state in Redis: jobs, queue, pools, placements, intents outbox, events,
logs, agent progress and the leader lease. Every change is one atomic Lua step (``broker.lua``)
that checks the expected state; leader writes also carry the fencing token.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from broker import errors, lua, transitions
from broker.models import (
    TERMINAL_STATES,
    Event,
    Intent,
    JobRecord,
    JobState,
    Placement,
    check_transition,
)
from broker.protocol import CHECKPOINT_EXIT, CONTINUE
from policies.job_model import measurement_key
from policies.migration import Blocklist
from policies.models import Accelerator, JobSpec, Pool

log = logging.getLogger(__name__)

_PROGRESS_FIELDS = (
    "samples_done", "samples_per_sec", "measured_gpus", "measured_batch_size", "checkpoint_step",
    "checkpoint_bytes", "checkpoint_at", "grad_noise_scale", "resumable", "resize_in_place",
    "even_batch",
)
ACTIVE_STATES = tuple(s for s in JobState if s not in TERMINAL_STATES)
BLOCKLIST_KEY = "blocklist"  # the reclaimed spot locations (policies.migration.Blocklist JSON)
PREEMPTIONS_KEY = "pool:preemptions"  # hash: pool id -> preemptions the reconciler handled there
MIGRATIONS_KEY = "pool:migrations"  # hash: pool id -> jobs the scheduler moved out of it
NODE_HOURS_KEY = "pool:node_hours"  # hash: pool id -> node-hours of closed placement intervals
RENDEZVOUS_TTL_S = 86_400  # a job's rendezvous record outlives its last visit or heartbeat a day
BROKERS_KEY = "brokers"  # hash: a broker replica's API URL -> until when it counts as live


def report_field(kind: str, attempt: int, round: int, rank: int) -> str:
    """The progress-hash field of a node's ``exit`` code, ``notice`` or ``error`` in one attempt
    and round (``lua.HEARTBEAT`` names rank 0's final one the same way)."""
    return f"{kind}:{attempt}:{round}:{rank}"


def _rdzv_field(job: JobRecord, rank: int) -> str:
    """The field of the rendezvous hash where node ``rank`` checks in (``lua.RENDEZVOUS``)."""
    return f"{job.attempt}:{job.round}:{rank}"


def _action(state: str, cancel: str) -> str:
    """What an agent is told: stop for a stale attempt, a node the broker replaced
    ('superseded'), a cancel, or a job being stopped."""
    if cancel == "true" or state not in ("running", "launching"):
        return CHECKPOINT_EXIT
    return CONTINUE


@dataclass(frozen=True)
class AgentReport:
    """What a job's agents said about one attempt beyond progress: how each node's command
    ended in the current round (a cloud VM does not tell) and which nodes got a preemption
    notice. ``exit_code`` and ``notice`` summarise them as a single-node job has them."""

    exit_code: int | None = None  # rank 0's exit code in the job's current round
    notice: str | None = None  # the first notice of any rank in the job's current round
    first_beat: float | None = None  # when the attempt's agent first reported (epoch seconds)
    exits: dict[int, int] = field(default_factory=dict)  # node rank -> exit code
    notices: dict[int, str] = field(default_factory=dict)  # node rank -> preemption notice


@dataclass(frozen=True)
class Directive:
    """The store's answer to an agent's heartbeat: ``continue`` or ``checkpoint-exit``, and the
    job's rendezvous round (above the agent's: re-form the group in that round)."""

    action: str
    round: int


class StoreError(errors.FleetError):
    """Base of the store's refusals."""


class JobNotFound(StoreError, errors.NotFound):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} (fleet jobs lists yours)")
        self.job_id = job_id


class Conflict(StoreError, errors.Conflict):
    """The record changed since it was read (or is in an unexpected state); re-read, retry."""


class StaleFence(StoreError, errors.Conflict):
    """The caller's fencing token no longer holds the leader lease; it must stop acting."""


class NotDurable(StoreError, errors.Unavailable):
    """Redis took a write (or refused it) without confirming it durable: the caller must not
    acknowledge it. A retry with the same request key returns the same job once it is."""

    def __init__(self, why: str) -> None:
        # not acknowledged: the same Idempotency-Key on a retry never makes a second job
        super().__init__(f"not accepted: the submission could not be made durable ({why}); "
                         "retry later with the same Idempotency-Key",
                         headers={"Retry-After": "5"})


# Kept outside ``doc``: the hash's plain fields and the agent-reported progress. ``reason`` is
# a field of its own (JSON), so that saying why a job waits rewrites no record; a release that
# reads the doc alone sees no reason (its default) rather than a record it cannot parse.
_NOT_IN_DOC = {"state", "version", "reason", "measured", *_PROGRESS_FIELDS}
# What a reader takes from a job's hash, in ``_decode_job``'s order.
_JOB_FIELDS = ("doc", "state", "version", "reason")


def _doc(job: JobRecord) -> str:
    return job.model_dump_json(exclude=_NOT_IN_DOC)


def _decode_job(doc: str, state: str, version: str | int, reason: str | None,
                progress: Sequence[str] = (),
                cache: dict[tuple[str | None, ...], JobRecord] | None = None) -> JobRecord:
    """A record from its hash (``_JOB_FIELDS``; a record written before ``reason`` had a
    field of its own holds it in its doc). ``cache`` maps what was read to the parsed record,
    so a scheduling round re-parses only the jobs that changed since the last one."""
    key = (doc, state, str(version), reason, *progress)
    if cache is not None and (hit := cache.get(key)) is not None:
        return hit
    prog = dict(zip(progress[::2], progress[1::2], strict=True))
    # One JSON text for pydantic's own parser (about a fifth faster than json.loads and then
    # validating the dict): the doc's fields, then the hash's and the progress's, which are
    # JSON scalars ``record_heartbeat`` wrote from typed values and, coming later, win over
    # any stale copy in the doc.
    measured = {k[2:]: float(v) for k, v in prog.items() if k.startswith("m:")}
    extra = ",".join([f'"state":{json.dumps(state)},"version":{int(version)}',
                      *((f'"reason":{reason}',) if reason is not None else ()),
                      *(f'"{k}":{prog[k]}' for k in _PROGRESS_FIELDS if k in prog),
                      f'"measured":{json.dumps(measured) if measured else "{}"}'])
    job = JobRecord.model_validate_json(f"{doc.rstrip()[:-1]},{extra}}}")  # a doc has an id
    if cache is not None:
        if len(cache) > 200_000:
            cache.clear()
        cache[key] = job
    return job


def _translate(exc: redis.ResponseError) -> StoreError:
    msg = str(exc)
    if msg.startswith("STALEFENCE"):
        return StaleFence(msg)
    if msg.startswith("NOTFOUND"):
        return JobNotFound(msg.split(" ", 1)[1])
    if msg.startswith("CONFLICT"):
        return Conflict(msg)
    raise exc


@dataclass(frozen=True)
class PoolStats:
    """What the broker observed per pool (kept in Redis, so it outlives broker restarts):
    preemptions it handled there and node-hours of the placement intervals that closed there."""

    preemptions: dict[str, int] = field(default_factory=dict)
    node_hours: dict[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    """A batch of job changes, intents, placements and events applied in one atomic step."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    sets: list[dict[str, Any]] = field(default_factory=list)
    intents_add: list[dict[str, str]] = field(default_factory=list)
    intents_del: list[str] = field(default_factory=list)
    placement_open: list[dict[str, str]] = field(default_factory=list)
    placement_close: list[dict[str, str]] = field(default_factory=list)
    events: list[dict[str, str]] = field(default_factory=list)
    kv: list[dict[str, str]] = field(default_factory=list)
    incr: list[dict[str, str]] = field(default_factory=list)
    wake: bool = False
    # job id -> the fields this plan gives it, for a caller that carries the plan out in
    # memory (the simulator) rather than in Redis; not part of ``ops``.
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)

    def change(
        self, job: JobRecord, state: JobState | None = None, *, event: str | None = None,
        event_data: dict[str, Any] | None = None, **fields: Any,
    ) -> None:
        """Move ``job`` (as read, at its version) to ``state`` and set ``fields``."""
        if state is not None and state != job.state:
            check_transition(job.state, state)
        now = time.time()
        values = {**fields, "updated_at": now}
        if state is not None and state.terminal:
            values.setdefault("finished_at", now)
        new = job.model_copy(update=values)
        self.updates.setdefault(job.id, {}).update(values)
        self.checks.append({"job": job.id, "version": job.version})
        entry: dict[str, Any] = {"job": job.id, "fields": {
            "doc": _doc(new), "attempt": str(new.attempt), "reason": json.dumps(new.reason),
            "cancel_requested": json.dumps(new.cancel_requested)}}
        if state is not None:
            entry["state"] = state.value
        self.sets.append(entry)
        if event or (state is not None and state != job.state):
            data = {"from": job.state.value, **(event_data or {})}
            if state is not None:
                data["to"] = state.value
            self.event(event or state.value, job.id, data)  # type: ignore[union-attr]

    def note(self, job: JobRecord, event: str, reason: str) -> None:
        """Say why ``job`` (as read, at its version) waits: its reason and an ``event`` with
        it, leaving the rest of the record as it is (no record is rewritten)."""
        self.checks.append({"job": job.id, "version": job.version})
        self.sets.append({"job": job.id, "fields": {"reason": json.dumps(reason)}})
        self.updates.setdefault(job.id, {})["reason"] = reason
        self.event(event, job.id, {"from": job.state.value, "reason": reason})

    def event(self, etype: str, job_id: str | None = None, data: dict[str, Any] | None = None,
              ) -> None:
        self.events.append({"type": etype, "job": job_id or "", "data": json.dumps(data or {})})

    def add_intent(self, intent: Intent) -> None:
        self.intents_add.append({"id": intent.id, "json": intent.model_dump_json()})

    def open_placement(self, placement: Placement) -> None:
        self.placement_open.append({"job": placement.job_id, "json": placement.model_dump_json()})

    def close_placement(self, placement: Placement) -> None:
        self.placement_close.append({"job": placement.job_id, "json": placement.model_dump_json()})

    def put(self, key: str, value: str, *, expect: str | None) -> None:
        """Set plain key ``key`` (under the store prefix) if it still holds ``expect`` (None:
        absent); otherwise the whole plan is refused with ``Conflict``."""
        self.kv.append({"key": key, "value": value, "expect": expect or ""})

    def set_blocklist(self, blocklist: Blocklist, *, read: str | None) -> None:
        """Store ``blocklist``, which was derived from the stored text ``read``."""
        self.put(BLOCKLIST_KEY, blocklist.model_dump_json(), expect=read)

    def count_preemption(self, pool_id: str) -> None:
        """One more preemption observed in ``pool_id`` (``Store.pool_stats``)."""
        self.incr.append({"key": PREEMPTIONS_KEY, "field": pool_id, "by": "1"})

    def count_migration(self, pool_id: str) -> None:
        """One more job moved out of ``pool_id`` to another pool (``fleet_migrations_total``)."""
        self.incr.append({"key": MIGRATIONS_KEY, "field": pool_id, "by": "1"})

    def add_node_hours(self, pool_id: str, hours: float) -> None:
        """Node-hours a closed placement interval spent in ``pool_id`` (``Store.pool_stats``).
        A non-finite count (from broken timestamps upstream) is logged and left out: Redis
        refuses it, and one bad interval must not block the rest of the plan."""
        if not math.isfinite(hours):
            log.warning("pool %s: dropped a non-finite node-hours increment %r", pool_id, hours)
        elif hours > 0:
            self.incr.append({"key": NODE_HOURS_KEY, "field": pool_id, "by": repr(hours)})

    def empty(self) -> bool:
        return not (self.sets or self.intents_add or self.intents_del or self.events
                    or self.placement_open or self.placement_close or self.kv or self.incr)

    def ops(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items()
                               if v and k not in ("wake", "updates")}
        if self.wake:
            out["wake"] = True
        return out


@dataclass
class Snapshot:
    """One consistent read for a scheduling round: active jobs, pools and pending intents."""

    jobs: list[JobRecord]
    pools: list[Pool]
    intents: list[Intent]


class Store:
    """FleetBroker's state over one ``redis.Redis`` client (``decode_responses=True``)."""

    LOG_CAP = 20_000  # log lines kept per job

    def __init__(self, client: redis.Redis, *, prefix: str = "fb:", confirm_durable: bool = True,
                 durable_timeout_s: float = 3.0) -> None:
        if not client.get_connection_kwargs().get("decode_responses"):
            raise StoreError("Store needs a redis client made with decode_responses=True")
        self.r = client
        self.p = prefix
        # Whether a submission returns only once Redis confirmed it durable (``_confirm_durable``)
        self.confirm_durable = confirm_durable
        self.durable_timeout_s = durable_timeout_s
        self._waitaof: bool | None = None  # Redis has WAITAOF (7.2+); None: not asked yet
        self._parsed: dict[tuple[str, ...], JobRecord] = {}
        self._submit = client.register_script(lua.SUBMIT)
        self._apply = client.register_script(lua.APPLY)
        self._acquire = client.register_script(lua.ACQUIRE)
        self._release = client.register_script(lua.RELEASE)
        self._snapshot = client.register_script(lua.SNAPSHOT)
        self._heartbeat = client.register_script(lua.HEARTBEAT)
        self._rendezvous = client.register_script(lua.RENDEZVOUS)
        self._append_log = client.register_script(lua.APPEND_LOG)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "fb:", confirm_durable: bool = True) -> Store:
        return cls(redis.Redis.from_url(url, decode_responses=True), prefix=prefix,
                   confirm_durable=confirm_durable)

    # ---- jobs (API side) ------------------------------------------------------------------

    def submit(self, spec: JobSpec, *, team: str, request_key: str | None = None,
               notes: Sequence[str] = (), sealed_secrets: str | None = None) -> JobRecord:
        """Queue a job atomically, with the ``notes`` its spec's translation made and its
        ``sealed_secrets`` (``broker.sealed``: the values of its ``secret_envs``, never in
        clear). With ``request_key`` a retried submission returns the first job instead of
        making a second one. Durable once it returns (``_confirm_durable``); ``NotDurable``
        when that cannot be confirmed (the job may exist all the same: a retry with the same
        ``request_key`` confirms it)."""
        now = time.time()
        rec = JobRecord(id="pending", spec=spec, team=team, submitted_at=now, updated_at=now,
                        notes=list(notes), sealed_secrets=sealed_secrets)
        doc = rec.model_dump_json(exclude={"id", *_NOT_IN_DOC})
        try:
            job_id = self._submit(args=[self.p, team, spec.name, now, request_key or "", doc])
        except redis.ResponseError as exc:
            if str(exc).startswith("MISCONF"):  # Redis refuses writes it cannot persist
                raise NotDurable(f"redis refuses writes because it cannot persist them: {exc}; "
                                 "free or enlarge its disk") from None
            raise
        self._confirm_durable()
        if request_key:  # may be an earlier job: read what was stored
            got = self.get_job(job_id)
            assert got is not None  # written by the script above or before
            return got
        return rec.model_copy(update={"id": job_id, "version": 1})

    def _confirm_durable(self) -> None:
        """Return once the writes this store made so far are durable, else raise ``NotDurable``.
        Redis 7.2+ (and Valkey): ``WAITAOF 1 0``, the append-only file fsynced on the primary.
        Older Redis: its AOF write status read after the write's reply (Redis writes the AOF
        before it replies, and reports a failed write or fsync as ``aof_last_write_status:err``,
        keeping the data in memory only), waiting while a write postponed behind a slow fsync is
        still in its buffer. Without AOF (a managed Redis): ``WAIT 1``, a replica's copy."""
        if not self.confirm_durable:
            return
        ms = max(1, int(self.durable_timeout_s * 1000))
        if self._waitaof is None:
            version = str(self.r.info("server").get("redis_version", "0"))
            self._waitaof = tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) >= (7, 2)
        if self._waitaof:
            try:
                local, _ = self.r.execute_command("WAITAOF", 1, 0, ms)
            except redis.ResponseError as exc:
                if "appendonly" not in str(exc):
                    raise
            else:
                if int(local) >= 1:
                    return
                raise NotDurable(f"redis did not fsync its append-only file within "
                                 f"{self.durable_timeout_s:g} s (WAITAOF): its disk may be "
                                 "full, read-only or slow")
        deadline = time.monotonic() + self.durable_timeout_s
        while True:
            info = self.r.info("persistence")
            if not info.get("aof_enabled"):
                break
            if info.get("aof_last_write_status") != "ok":
                raise NotDurable("redis could not write its append-only file "
                                 "(aof_last_write_status:err): its disk is full or read-only")
            if not info.get("aof_buffer_length"):
                return
            if time.monotonic() > deadline:
                raise NotDurable(f"redis did not write its append-only file within "
                                 f"{self.durable_timeout_s:g} s: its disk is slow")
            time.sleep(0.002)
        if self.r.info("replication").get("connected_slaves") and \
                int(self.r.execute_command("WAIT", 1, ms)) >= 1:
            return
        raise NotDurable("redis has no append-only file (appendonly no) and no replica took "
                         "the write: nothing makes it durable; turn on appendonly, or add a "
                         "replica, or start the broker with confirm_durable off to accept the "
                         "risk")

    def get_job(self, job_id: str) -> JobRecord | None:
        got = self._get_many([job_id])
        return got[0] if got else None

    def list_jobs(self, *, team: str | None = None,
                  states: Iterable[JobState | str] | None = None) -> list[JobRecord]:
        """Jobs in submission order, optionally of one team and in some states."""
        ids = self.list_ids(team=team)
        if states is not None:
            members = self.job_ids(states)
            ids = [i for i in ids if i in members]
        return self._get_many(ids)

    def list_ids(self, *, team: str | None = None) -> list[str]:
        """The ids of every job (or one team's) in submission order (no record is read)."""
        return self.r.zrange(f"{self.p}team:{team}" if team else f"{self.p}jobs", 0, -1)

    def job_ids(self, states: Iterable[JobState | str]) -> set[str]:
        """The ids of the jobs in ``states`` (no record is read)."""
        members: set[str] = set()
        for s in states:
            members |= self.r.smembers(f"{self.p}state:{JobState(s).value}")
        return members

    def request_cancel(self, job_id: str) -> JobRecord:
        """Cancel a job: at once when it holds no GPUs, else flag it for the scheduler to stop.
        Cancelling a finished job changes nothing and returns it."""
        for _ in range(20):
            job = self._require(job_id)
            if job.state.terminal or job.cancel_requested:
                return job
            plan = Plan(wake=True)
            if job.state in (JobState.QUEUED, JobState.SUSPENDED):
                transitions.cancelled(plan, job, "cancelled by user")
            else:
                transitions.cancel_requested(plan, job)
            try:
                self.apply(plan)
            except Conflict:
                continue
            return self._require(job_id)
        raise Conflict(f"job {job_id} kept changing; try again")

    def record_heartbeat(self, job_id: str, attempt: int, *, node_rank: int = 0, round: int = 0,
                         launch_key: str | None = None, samples_done: int | None = None,
                         samples_per_sec: float | None = None, world_size: int | None = None,
                         global_batch_size: int | None = None,
                         checkpoint_step: int | None = None, checkpoint_bytes: int | None = None,
                         checkpoint_age_seconds: float | None = None,
                         grad_noise_scale: float | None = None, resumable: bool | None = None,
                         resize_in_place: bool | None = None, even_batch: bool | None = None,
                         accelerator: Accelerator | None = None,
                         exit_code: int | None = None, notice: str | None = None,
                         error: str | None = None, **_: Any) -> Directive:
        """Record an agent's report: progress from node rank 0 of the job's current round (the node
        whose rank-0 worker measures it; the others report liveness, exit codes and notices), and
        the exit code and any preemption notice of node ``node_rank`` in ``round`` of ``attempt``
        (dropped for a round the job has not reached or a rank it lacks). ``launch_key`` is the
        node's launch key: a node that does not hold the rank's current key (``lua.HEARTBEAT``)
        records nothing and is told to stop. The checkpoint's size and, for a script that
        commits its own checkpoints, when it was committed (``checkpoint_age_seconds`` before
        now) are kept with its step (unknown when the report has none), so neither ever
        describes another checkpoint than the one recorded. Returns the action for the agent
        (``continue``, or ``checkpoint-exit`` for a stale attempt, a replaced node, a requested
        cancel or a job being stopped) and the job's current round. Throughput is kept per
        configuration on the node's ``accelerator`` (the scheduler's job model is fitted to
        it), with the gradient noise scale the runtime measured, and whether a move resumes
        the job (``resumable``: the agent tells it from the runtime's progress file or the
        script's own committed checkpoints; a plain script without either restarts from the
        beginning), kept across attempts: the script does not change. So are what the runtime
        reports of its loop: whether a resize on the node keeps the workers' processes
        (``resize_in_place``: the scheduler prices the resize by it) and whether the global
        batch must divide evenly over the workers (``even_batch``: the choice table offers only
        such batches)."""
        progress = _progress_values(samples_done, samples_per_sec, world_size,
                                    global_batch_size, checkpoint_step, checkpoint_bytes,
                                    checkpoint_age_seconds)
        if grad_noise_scale is not None:
            progress["grad_noise_scale"] = float(grad_noise_scale)
        for name, flag in (("resumable", resumable), ("resize_in_place", resize_in_place),
                           ("even_batch", even_batch)):
            if flag is not None:
                progress[name] = bool(flag)
        if samples_per_sec and world_size and global_batch_size and accelerator is not None:
            key = measurement_key(accelerator, int(world_size), int(global_batch_size))
            progress[f"m:{key}"] = float(samples_per_sec)
        report: dict[str, Any] = {}
        if exit_code is not None:
            report[report_field("exit", attempt, round, node_rank)] = int(exit_code)
        if notice:
            report[report_field("notice", attempt, round, node_rank)] = notice[:500]
        if error:  # why the command failed (broker.runtime.failure); the reconciler shows it
            report[report_field("error", attempt, round, node_rank)] = error[:500]
        # The script decides what it takes: progress from the current round's rank 0 only.
        flat = [x for k, v in (progress | report).items() for x in (k, json.dumps(v))]
        state, cancel, current = self._heartbeat(args=[
            self.p, job_id, json.dumps(int(attempt)), time.time(), int(round), int(node_rank),
            launch_key or "", len(progress), RENDEZVOUS_TTL_S, *flat])
        if state == "missing":
            raise JobNotFound(job_id)
        return Directive(_action(state, cancel), int(current))

    def rendezvous(self, job_id: str, attempt: int, round: int, node_rank: int,
                   addr: str | None, launch_key: str | None = None) -> dict[str, Any]:
        """One node's visit to its job's rendezvous: checks node ``node_rank`` in for ``round``
        of ``attempt`` when both are the job's current ones (with ``addr``, "host:port": rank 0
        must send its own, the round's master; another rank may) and the node holds the rank's
        current ``launch_key`` (the launch's, or its stand-in's; None only for a job whose record
        has no launch key), and returns ``{"round", "nnodes", "master", "addrs", "action"}``:
        the job's current round and node count, the address rank 0 registered for that round
        once every rank of the job checked in for it (None until then, for a stale attempt and
        for a node the broker replaced; it never changes once given), every rank's address by
        rank ('' where it gave none) once the master is named, and the action, as for a
        heartbeat (``continue`` or ``checkpoint-exit``)."""
        reply = self._rendezvous(args=[self.p, job_id, int(attempt), int(round),
                                       int(node_rank), addr or "", RENDEZVOUS_TTL_S,
                                       launch_key or ""])
        if reply[0] == "missing":
            raise JobNotFound(job_id)
        state, cancel, current, nodes, master, *rest = reply
        addrs = [str(a) for a in rest[0]] if rest and rest[0] else None
        return {"round": int(current), "nnodes": int(nodes), "master": master, "addrs": addrs,
                "action": _action(state, cancel)}

    def checked_in(self, jobs: Iterable[JobRecord]) -> dict[str, set[int]]:
        """Per job id, the node ranks that checked in at the rendezvous for the job's current
        attempt and round (a stand-in missing there never came up)."""
        jobs = list(jobs)
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            ranks = range(max(job.nodes, 1))
            pipe.hmget(f"{self.p}rdzv:{job.id}", *(_rdzv_field(job, r) for r in ranks))
        return {job.id: {r for r, v in enumerate(got) if v is not None}
                for job, got in zip(jobs, pipe.execute(), strict=True)}

    # ---- events, logs, placements -----------------------------------------------------------

    def events(self, *, since: str = "0", job_id: str | None = None,
               limit: int = 100) -> list[Event]:
        """Events after stream id ``since`` (exclusive), oldest first."""
        key = f"{self.p}events:{job_id}" if job_id else f"{self.p}events"
        start = "-" if since in ("0", "", "-") else f"({since}"
        rows = self.r.xrange(key, min=start, max="+", count=max(1, min(limit, 10_000)))
        return [Event(id=eid, ts=float(f["ts"]), type=f["type"], job_id=f.get("job") or None,
                      data=json.loads(f.get("data") or "{}")) for eid, f in rows]

    def last_event_id(self) -> str:
        """The newest event's id ("0" when none): pass it as ``since`` to follow new events."""
        rows = self.r.xrevrange(f"{self.p}events", count=1)
        return rows[0][0] if rows else "0"

    def append_log(self, job_id: str, lines: Sequence[str]) -> None:
        if lines:
            self._append_log(args=[self.p, job_id, self.LOG_CAP, *lines])

    def read_logs(self, job_id: str, offset: int = 0, limit: int = 1000) -> tuple[list[str], int]:
        """Lines from absolute ``offset``; returns them and the offset to ask for next."""
        base = int(self.r.get(f"{self.p}logbase:{job_id}") or 0)
        start = max(offset, base)
        lines = self.r.lrange(f"{self.p}logs:{job_id}", start - base, start - base + limit - 1)
        return lines, start + len(lines)

    def placements(self, job_id: str) -> list[Placement]:
        return self.placements_of([job_id])[job_id]

    def placements_of(self, job_ids: Sequence[str]) -> dict[str, list[Placement]]:
        """Every placement interval of each job, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.lrange(f"{self.p}placements:{job_id}", 0, -1)
        return {job_id: [Placement.model_validate_json(x) for x in raw]
                for job_id, raw in zip(job_ids, pipe.execute(), strict=True)}

    # ---- pools and operator commands ------------------------------------------------------------

    def pools(self) -> list[Pool]:
        return [Pool.model_validate_json(v) for v in self.r.hgetall(f"{self.p}pools").values()]

    def set_pools(self, pools: Iterable[Pool]) -> None:
        """Replace the fleet's pools (capacity and prices) in one step; wakes the scheduler
        when anything changed."""
        new = {p.id: p.model_dump_json() for p in pools}
        key = f"{self.p}pools"
        if self.r.hgetall(key) == new:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        if new:
            pipe.hset(key, mapping=new)
        pipe.lpush(f"{self.p}wake", "1")
        pipe.ltrim(f"{self.p}wake", 0, 0)
        pipe.execute()

    def request_command(self, kind: str, **args: Any) -> None:
        """Queue an operator command for the leader (e.g. ``preempt`` a region)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(f"{self.p}commands", json.dumps({"kind": kind, **args}))
        pipe.lpush(f"{self.p}wake", "1")
        pipe.ltrim(f"{self.p}wake", 0, 0)
        pipe.execute()

    def request_preempt(self, region: str, *, duration_s: float = 60.0) -> None:
        """Ask the leader to reclaim a spot region (chaos): its jobs get a preemption notice."""
        self.request_command("preempt", region=region, duration_s=duration_s)

    def pop_commands(self) -> list[dict[str, Any]]:
        pipe = self.r.pipeline(transaction=True)
        pipe.lrange(f"{self.p}commands", 0, -1)
        pipe.delete(f"{self.p}commands")
        raw, _ = pipe.execute()
        return [json.loads(x) for x in raw]

    def agent_reports(self, jobs: Iterable[JobRecord]) -> dict[str, AgentReport]:
        """Each job's agent report for its current attempt and round, every node of it (jobs
        without one are left out)."""
        jobs = list(jobs)
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            ranks = range(max(job.nodes, 1))
            pipe.hmget(f"{self.p}progress:{job.id}", f"beat:{job.attempt}", "heartbeat_at",
                       *(report_field("exit", job.attempt, job.round, r) for r in ranks),
                       *(report_field("notice", job.attempt, job.round, r) for r in ranks))
        out = {}
        for job, (beat, last, *per_rank) in zip(jobs, pipe.execute(), strict=True):
            # An attempt whose first beat predates that record (a broker before it, a restored
            # backup) still reported if the job's last heartbeat came after its launch: the
            # heartbeat script takes beats of the current attempt only.
            if beat is None and last is not None and job.launched_at is not None and \
                    float(last) >= job.launched_at:
                beat = last
            n = len(per_rank) // 2
            exits = {r: int(json.loads(v)) for r, v in enumerate(per_rank[:n]) if v is not None}
            notices = {r: json.loads(v) for r, v in enumerate(per_rank[n:]) if v is not None}
            if exits or notices or beat is not None:
                out[job.id] = AgentReport(
                    exit_code=exits.get(0), notice=next(iter(notices.values()), None),
                    first_beat=None if beat is None else float(beat),
                    exits=exits, notices=notices)
        return out

    def agent_error(self, job: JobRecord) -> str | None:
        """The cause of failure an agent of the job's current attempt and round reported (the
        lowest rank's), if any."""
        fields = [report_field("error", job.attempt, job.round, r)
                  for r in range(max(job.nodes, 1))]
        found = [v for v in self.r.hmget(f"{self.p}progress:{job.id}", fields) if v]
        return str(json.loads(found[0])) if found else None

    def announce_broker(self, url: str, ttl_s: float) -> None:
        """Name ``url`` a live broker replica for ``ttl_s`` seconds (``broker_urls``) and forget
        replicas past their time."""
        key, now = f"{self.p}{BROKERS_KEY}", time.time()
        gone = [u for u, until in self.r.hgetall(key).items() if float(until) <= now]
        pipe = self.r.pipeline(transaction=True)
        if gone:
            pipe.hdel(key, *gone)
        pipe.hset(key, url, now + ttl_s)
        pipe.execute()

    def broker_urls(self) -> list[str]:
        """The API URLs of the live broker replicas: a launch lists them all to its agents,
        which report to any of them."""
        now = time.time()
        return sorted(u for u, until in self.r.hgetall(f"{self.p}{BROKERS_KEY}").items()
                      if float(until) > now)

    def blocklist(self, decay_s: float | None = None,
                  refusal_decay_s: float | None = None) -> tuple[Blocklist, str | None]:
        """The stored blocklist and its stored text (pass it to ``Plan.set_blocklist``); a new
        one when none is stored yet. ``decay_s`` and ``refusal_decay_s``, the broker's
        settings, replace the stored ones, so a changed setting takes effect at the next
        restart."""
        raw = self.r.get(f"{self.p}{BLOCKLIST_KEY}")
        stored = Blocklist() if raw is None else Blocklist.model_validate_json(raw)
        settings = {k: v for k, v in (("decay_s", decay_s), ("refusal_decay_s", refusal_decay_s))
                    if v is not None}
        if settings:
            stored = stored.model_copy(update=settings)
        return stored, raw

    def pool_stats(self) -> PoolStats:
        """Preemptions and closed node-hours per pool, as the reconciler counted them."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(f"{self.p}{PREEMPTIONS_KEY}")
        pipe.hgetall(f"{self.p}{NODE_HOURS_KEY}")
        preemptions, node_hours = pipe.execute()
        return PoolStats({k: int(float(v)) for k, v in preemptions.items()},
                         {k: float(v) for k, v in node_hours.items()})

    # ---- leader side: lease, snapshot, plans, intents ------------------------------------------

    def acquire_lease(self, owner: str, ttl_s: float) -> int:
        """Take or renew the leader lease; returns the fence held, or 0 if another owner leads."""
        return int(self._acquire(args=[self.p, owner, int(ttl_s * 1000)]))

    def release_lease(self, fence: int) -> None:
        self._release(args=[self.p, fence])

    def leader(self) -> tuple[int, str] | None:
        cur = self.r.get(f"{self.p}leader")
        if not cur:
            return None
        fence, owner = cur.split("|", 1)
        return int(fence), owner

    def snapshot(self) -> Snapshot:
        jobs, progress, pools, outbox = self._snapshot(args=[self.p, *ACTIVE_STATES])
        return Snapshot(
            jobs=[_decode_job(*j, pr, cache=self._parsed)
                  for j, pr in zip(jobs, progress, strict=True)],
            pools=[Pool.model_validate_json(v) for v in pools[1::2]],
            intents=sorted((Intent.model_validate_json(v) for v in outbox[1::2]),
                           key=lambda i: i.created_at),
        )

    def apply(self, plan: Plan, *, fence: int | None = None) -> list[int]:
        """Apply ``plan`` atomically; with ``fence``, only while that fence holds the lease.
        Raises ``Conflict``, ``JobNotFound`` or ``StaleFence`` and then writes nothing."""
        try:
            return self._apply(args=[self.p, "" if fence is None else fence, time.time(),
                                     json.dumps(plan.ops())])
        except redis.ResponseError as exc:
            raise _translate(exc) from None

    def intents(self) -> list[Intent]:
        return sorted((Intent.model_validate_json(v)
                       for v in self.r.hvals(f"{self.p}outbox")), key=lambda i: i.created_at)

    def wait_wake(self, timeout_s: float) -> bool:
        """Block until something wakes the scheduler (submission, cancel, pool change)."""
        return self.r.blpop([f"{self.p}wake"], timeout=max(timeout_s, 0.01)) is not None

    # ---- helpers ---------------------------------------------------------------------------------

    def _job_key(self, job_id: str) -> str:
        return f"{self.p}job:{job_id}"

    def _require(self, job_id: str) -> JobRecord:
        job = self.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _get_many(self, ids: Sequence[str]) -> list[JobRecord]:
        pipe = self.r.pipeline(transaction=True)  # MULTI: each record read with its progress
        for i in ids:
            pipe.hmget(self._job_key(i), *_JOB_FIELDS)
            pipe.hgetall(f"{self.p}progress:{i}")
        raw = pipe.execute()
        return [_decode_job(*j, _flatten(pr), cache=self._parsed)
                for j, pr in zip(raw[::2], raw[1::2], strict=True) if j[0] is not None]


def _progress_values(samples_done: int | None, samples_per_sec: float | None,
                     world_size: int | None, global_batch_size: int | None,
                     checkpoint_step: int | None, checkpoint_bytes: int | None,
                     checkpoint_age_seconds: float | None) -> dict[str, Any]:
    """The progress fields a heartbeat sets (what it does not report stays as it was); a
    checkpoint's age becomes the time it was committed: now less the age."""
    values: dict[str, Any] = {}
    if samples_done is not None:
        values["samples_done"] = int(samples_done)
    if samples_per_sec is not None:
        values["samples_per_sec"] = float(samples_per_sec)
        values["measured_gpus"] = world_size
        values["measured_batch_size"] = global_batch_size
    if checkpoint_step is not None:
        values["checkpoint_step"] = int(checkpoint_step)
        values["checkpoint_bytes"] = None if checkpoint_bytes is None else int(checkpoint_bytes)
        values["checkpoint_at"] = None if checkpoint_age_seconds is None else \
            time.time() - float(checkpoint_age_seconds)
    return values


def _flatten(d: dict[str, str]) -> list[str]:
    return [x for kv in d.items() for x in kv]
