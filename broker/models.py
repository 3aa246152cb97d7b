"""Control-plane records kept in Redis: job states and their legal transitions, job records,
placement intervals, intents (the scheduler's outbox) and events.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from broker.errors import Conflict
from policies.models import JobSpec, Market

# A job's translation notes as a client sends them (``POST /v1/jobs?note=``): at most this many,
# each at most this long; the API adds its own translation's.
MAX_NOTES, MAX_NOTE_CHARS = 32, 300


class JobState(StrEnum):
    """Life cycle of a job. ``TRANSITIONS`` lists every legal step; the store enforces it."""

    QUEUED = "queued"  # accepted, waiting for GPUs
    LAUNCHING = "launching"  # a launch intent is in the outbox; the provider starts nodes
    RUNNING = "running"  # nodes are up and the job makes progress
    SUSPENDING = "suspending"  # asked to checkpoint and exit (resize, migrate, preempt, cancel)
    SUSPENDED = "suspended"  # checkpointed and off GPUs; eligible to be placed again
    COMPLETED = "completed"  # the command exited 0
    FAILED = "failed"  # the command failed more often than the retry budget allows
    CANCELLED = "cancelled"  # a user cancelled it
    DROPPED = "dropped"  # admission control ("drop") refused it: no room when it arrived

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def holds_gpus(self) -> bool:
        """States in which the job occupies (or is about to occupy) GPUs in a pool."""
        return self in (JobState.LAUNCHING, JobState.RUNNING, JobState.SUSPENDING)


TERMINAL_STATES = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.DROPPED}
)

# Why each step exists:
#   queued     -> launching   scheduler gave it GPUs and wrote a launch intent
#   queued     -> cancelled   user cancelled before it ever ran
#   queued     -> dropped     admission "drop": no allocation in the round it arrived
#   launching  -> running     actuator: provider started the nodes
#   launching  -> suspended   actuator: provider had no capacity / launch failed (retry later)
#   launching  -> suspending  cancel or preemption before the launch was confirmed
#   launching  -> failed      launch failed more often than the retry budget
#   launching  -> cancelled   cancelled before the launch was carried out
#   running    -> suspending  resize, migrate, suspend, preemption notice or cancel
#   running    -> completed   the command exited 0
#   running    -> suspended   the node exited 75 (checkpointed) or was lost; placed again later
#   running    -> failed      the command failed more often than the retry budget
#   suspending -> suspended   the node checkpointed and exited (or was killed after the grace)
#   suspending -> completed   the job finished while it was being asked to stop
#   suspending -> cancelled   a cancelled job's node is gone
#   suspending -> failed      the command failed while stopping, out of retries
#   suspended  -> launching   placed again (resume from the checkpoint)
#   suspended  -> cancelled   user cancelled while it waited
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.LAUNCHING, JobState.CANCELLED, JobState.DROPPED}),
    JobState.LAUNCHING: frozenset(
        {JobState.RUNNING, JobState.SUSPENDED, JobState.SUSPENDING, JobState.FAILED,
         JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUSPENDING, JobState.COMPLETED, JobState.SUSPENDED, JobState.FAILED}
    ),
    JobState.SUSPENDING: frozenset(
        {JobState.SUSPENDED, JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.SUSPENDED: frozenset({JobState.LAUNCHING, JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.DROPPED: frozenset(),
}


class IllegalTransition(Conflict, ValueError):
    """A job state change that ``TRANSITIONS`` does not allow."""


def check_transition(old: JobState, new: JobState) -> None:
    """Raise ``IllegalTransition`` unless ``old -> new`` is in ``TRANSITIONS``."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"illegal job transition {old.value} -> {new.value}")


class JobRecord(BaseModel):
    """A job as the control plane knows it. ``version`` grows by one with every change."""

    model_config = ConfigDict(extra="ignore")

    id: str
    spec: JobSpec
    team: str
    state: JobState = JobState.QUEUED
    version: int = 0
    fence: int = 0  # fencing token of the leader that made the last change (0 = user/API)
    attempt: int = 0  # grows by one with every launch
    gpus: int = 0  # assigned GPUs (0 when off GPUs)
    batch_size: int | None = None  # assigned global batch size
    pool: str | None = None  # assigned pool id (cloud:region:market:accelerator)
    node_ids: list[str] = Field(default_factory=list)
    nodes: int = 1  # nodes of the current attempt (a gang of the pool's largest instance)
    # Rendezvous round of the current attempt: 0 at launch, one more with every lost node the
    # broker replaced (the survivors' agents re-form the group in the new round).
    round: int = 0
    replaced_at: float | None = None  # when the last stand-ins for lost nodes were launched
    # rank -> the round its current stand-in was launched for (its key is
    # ``replacement_key(launch_key, rank, round)``); ranks not here are the launch's own nodes
    stand_ins: dict[int, int] = Field(default_factory=dict)
    # Workers the attempt's one node runs since the broker resized it in place (its agent
    # hears ``resize`` until rank 0 reports that world size); None: as launched
    resized_to: int | None = None
    launch_key: str | None = None  # idempotency key of the current attempt's launch
    # The values of spec.secret_envs, sealed (``broker.sealed``): never shown by the API
    sealed_secrets: str | None = Field(default=None, repr=False)
    samples_done: int = 0
    samples_per_sec: float | None = None  # last measured throughput (agent heartbeats)
    measured_gpus: int | None = None  # configuration the measurement was taken at
    measured_batch_size: int | None = None
    # Samples/s measured at each configuration the job ran in, keyed
    # "<accelerator>:<gpus>x<global batch>" (``policies.job_model.measurements``).
    measured: dict[str, float] = Field(default_factory=dict)
    grad_noise_scale: float | None = None  # in samples, as its agent last measured it
    checkpoint_step: int | None = None
    checkpoint_bytes: int | None = None  # that checkpoint's size, as its agent measured it
    # When that checkpoint was committed (this clock), known only for a script that commits its
    # own DCP checkpoints: it takes none at a stop, so a restart loses the work since then.
    # None: a job on the runtime (it checkpoints at the stop), or not known.
    checkpoint_at: float | None = None
    # Does a move resume it where it stopped (its agent saw the runtime's progress) or from its
    # script's own newest DCP checkpoint (checkpoint_at known)? False: a plain script, which a
    # move, resize or preemption restarts from the beginning; None: not known yet (no
    # heartbeat has said).
    resumable: bool | None = None
    # Does a resize on its node keep its workers' processes (its agent saw the runtime's own
    # loop re-form the group in place)? False or None (not known yet): the resize costs a
    # checkpoint and restart, and the scheduler prices it so.
    resize_in_place: bool | None = None
    # Must its global batch divide evenly over its workers (a framework integration that
    # averages equal micro-batches refuses any other)? The choice table then offers only such.
    even_batch: bool | None = None
    failures: int = 0
    rescales: int = 0
    migrations: int = 0
    preemptions: int = 0
    cancel_requested: bool = False
    reason: str | None = None  # why the last transition happened
    # what translating its spec left out or changed (a SkyPilot field with no meaning here)
    notes: list[str] = Field(default_factory=list, max_length=2 * MAX_NOTES)
    exit_code: int | None = None
    submitted_at: float = Field(default_factory=time.time)
    started_at: float | None = None  # first time it ran
    launched_at: float | None = None  # when the current attempt started running
    updated_at: float = Field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def progress(self) -> float:
        return min(1.0, self.samples_done / self.spec.work_samples)


class Placement(BaseModel):
    """One interval during which a job held GPUs in one pool; ``end`` is None while open."""

    job_id: str
    attempt: int
    start: float
    end: float | None = None
    pool: str
    cloud: str
    region: str
    market: Market
    gpus: int
    batch_size: int | None = None
    price_per_gpu_hour: float
    # What the same GPUs cost on on-demand when the interval opened (broker.costs); None in
    # records written before it was kept, which then count at their own price.
    ondemand_price_per_gpu_hour: float | None = None

    @property
    def gpu_hours(self) -> float:
        end = self.end if self.end is not None else time.time()
        return max(0.0, end - self.start) * self.gpus / 3600.0

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour


class IntentKind(StrEnum):
    LAUNCH = "launch"  # start the job's nodes in ``pool`` with ``gpus`` and ``batch_size``
    RESIZE = "resize"  # checkpoint, then relaunch in the same pool with new gpus/batch
    MIGRATE = "migrate"  # checkpoint, then relaunch in another pool
    SUSPEND = "suspend"  # checkpoint and go back to the queue
    STOP = "stop"  # terminate for good (cancel)
    # launch stand-ins for a running multi-node job's lost ``ranks`` in its pool, for
    # rendezvous ``round``; the survivors keep their nodes and re-form the group with them
    REPLACE = "replace"
    # the running job's one node keeps its processes and runs ``gpus`` workers from now on:
    # the backend learns the node's new size, so its free count holds for the round's launches
    RESIZE_IN_PLACE = "resize-in-place"


class Intent(BaseModel):
    """A side effect the scheduler decided on, written to the outbox with its fencing token.

    The actuator carries it out; ``key`` (job id + fence + attempt) makes the provider call
    idempotent, so replaying an intent after a crash never launches a second node.
    """

    kind: IntentKind
    job_id: str
    fence: int
    attempt: int
    gpus: int = 0
    batch_size: int | None = None
    pool: str | None = None
    reason: str | None = None
    ranks: list[int] = Field(default_factory=list)  # REPLACE: the node ranks to stand in for
    round: int = 0  # REPLACE: the rendezvous round the stand-ins join
    created_at: float = Field(default_factory=time.time)

    @property
    def key(self) -> str:
        return f"{self.job_id}:{self.fence}:{self.attempt}"

    @property
    def id(self) -> str:
        # one REPLACE per round: a second loss in the same pass of the same leader is a new one
        suffix = f".{self.round}" if self.kind is IntentKind.REPLACE else ""
        return f"{self.kind.value}:{self.key}{suffix}"


def carry_out_order(intents: Iterable[Intent]) -> list[Intent]:
    """The order the actuator (and the simulator) carries out a plan's intents in: a node shrunk
    in place first, so the backend frees its GPUs before a launch of the same plan counts on
    them; the rest as written."""
    return sorted(intents, key=lambda i: i.kind is not IntentKind.RESIZE_IN_PLACE)


class Event(BaseModel):
    """One entry of the event stream (Redis stream id, time, type, job, details)."""

    id: str
    ts: float
    type: str
    job_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
