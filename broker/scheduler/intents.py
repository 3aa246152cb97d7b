"""The diff against what runs: each job's transition (launch, resize, migrate, suspend,
wait, drop) and the intents the actuator carries out, written into one round's result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker import transitions
from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.scheduler.config import Admission, SchedulerConfig
from broker.store import Plan
from broker.waiting import Needs
from policies.models import Accelerator, Pool


@dataclass
class RoundResult:
    plan: Plan
    launches: int = 0
    resizes: int = 0
    migrations: int = 0
    suspends: int = 0
    stops: int = 0
    dropped: int = 0
    solve_s: float = 0.0
    changed: list[str] = field(default_factory=list)


def _nodes(job: JobRecord, pool: Pool | None, gpus: int) -> int:
    """Nodes of a launch of ``gpus`` GPUs in ``pool``: the job's own node count where its spec
    fixes one (a SkyPilot task's num_nodes), else ``Pool.shape`` (one where unknown)."""
    if job.spec.nodes is not None and gpus % job.spec.nodes == 0:
        return job.spec.nodes
    shape = pool.shape(gpus) if pool is not None else None
    return shape[0] if shape else 1


def diff(res: RoundResult, job: JobRecord, target: tuple[str, int, int] | None, fence: int,
         config: SchedulerConfig, pools_by_id: Mapping[str, Pool], now: float) -> None:
    if job.state is JobState.RUNNING:
        if target is None:
            stop(res, job, fence, IntentKind.SUSPEND, "allocator gave its GPUs to other jobs")
        elif target[0] != job.pool:
            stop(res, job, fence, IntentKind.MIGRATE, f"moving to {target[0]}", target)
        elif target[1:] != (job.gpus, job.batch_size):
            if resizes_in_place(job, pools_by_id.get(target[0]), target[1], target[2]):
                transitions.resized_in_place(res.plan, job, gpus=target[1], fence=fence,
                                             now=now)
                res.plan.add_intent(Intent(kind=IntentKind.RESIZE_IN_PLACE, job_id=job.id,
                                           fence=fence, attempt=job.attempt, gpus=target[1],
                                           batch_size=target[2], pool=target[0]))
                res.resizes += 1
                res.changed.append(job.id)
            else:
                stop(res, job, fence, IntentKind.RESIZE,
                     f"resize to {target[1]} GPUs, batch {target[2]}", target)
        return
    if target is None:
        if dropped_if_left_out(job, config):
            _drop(res, job, "admission control: no room when it arrived")
        return
    pool, gpus, batch = target
    attempt = job.attempt + 1
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=fence, attempt=attempt,
                    gpus=gpus, batch_size=batch, pool=pool)
    relaunch = job.attempt > 0 and job.pool is not None
    moved = relaunch and pool != job.pool
    resized = relaunch and not moved and (gpus, batch) != (job.gpus, job.batch_size)
    # the node count is known before any node boots: the rendezvous answers with it at once
    transitions.launching(res.plan, job, intent, nodes=_nodes(job, pools_by_id.get(pool), gpus),
                          moved=moved, resized=resized)
    res.plan.add_intent(intent)
    res.launches += 1
    res.migrations += moved
    res.resizes += resized
    res.changed.append(job.id)


def resizes_in_place(job: JobRecord, pool: Pool | None, gpus: int, batch: int | None) -> bool:
    """Can the running ``job`` go to ``gpus`` GPUs in ``pool`` without a relaunch? Where its one
    node stays: the job's pool, one that sells any count on one node (a local region), the
    same batch, and a job that runs the runtime or an integration (it reported progress). Its
    agent then re-forms the group in place where the workers can (``JobRecord.
    resize_in_place``; only then does the allocator price the resize at ``resize_in_place_s``)
    and else restarts them from a checkpoint on the node (docs/runtime.md). Anything else
    checkpoints and relaunches."""
    return (pool is not None and pool.id == job.pool and pool.gpu_prices is None
            and job.nodes == 1 and pool.shape(gpus) == (1, gpus) and batch == job.batch_size
            and job.samples_done > 0)


def dropped_if_left_out(job: JobRecord, config: SchedulerConfig) -> bool:
    """Does a job the round gives no GPUs get dropped (admission drop, in the round it
    arrives)? Then it gets no 'waiting' note first: one change per job and plan."""
    return config.admission is Admission.DROP and job.state is JobState.QUEUED


def stop(res: RoundResult, job: JobRecord, fence: int, kind: IntentKind, reason: str,
         target: tuple[str, int, int] | None = None) -> None:
    pool, gpus, batch = target or (None, 0, None)
    intent = Intent(kind=kind, job_id=job.id, fence=fence, attempt=job.attempt, gpus=gpus,
                    batch_size=batch, pool=pool, reason=reason)
    transitions.stopping(res.plan, job, event=kind.value, data={"reason": reason}, reason=reason,
                         fence=fence)
    res.plan.add_intent(intent)
    res.changed.append(job.id)
    if kind is IntentKind.STOP:
        res.stops += 1
    else:
        res.suspends += 1


WAIT_FOR_SPOT = ("waiting for spot: ahead of its deadline's pace, so no on-demand yet (it takes "
                 "on-demand once behind that pace)")


def wait_for_spot(res: RoundResult, job: JobRecord, fence: int) -> None:
    """A deadline job the market rule keeps off GPUs this round: a running one checkpoints and
    waits; a waiting one says why (once) instead of staying queued without a word."""
    if job.state is JobState.RUNNING:
        stop(res, job, fence, IntentKind.SUSPEND, WAIT_FOR_SPOT)
    else:
        note(res, job, "waiting-for-spot", WAIT_FOR_SPOT)


def note(res: RoundResult, job: JobRecord, event: str, reason: str) -> None:
    """Say on a job why it gets no GPUs (an ``event`` with the reason), once: a round that
    finds the same reason changes nothing."""
    if job.reason != reason:
        transitions.noted(res.plan, job, event, reason)
        res.changed.append(job.id)


def unlaunchable(res: RoundResult, job: JobRecord, accel: Accelerator, sizes: list[int],
                 config: SchedulerConfig, reason: str | None = None) -> None:
    """No instance type of the fleet has a GPU count the job accepts (or ``reason``): say so on
    the job (once), or drop it under admission drop, instead of leaving it queued without a
    word."""
    g = job.spec.gpus
    reason = reason or (f"gpus {g.min}:{g.max}: no {accel.value} instance type in this fleet "
                        f"has that many GPUs (sizes {', '.join(map(str, sizes))}); widen the "
                        "job's gpus range")
    if config.admission is Admission.DROP:
        _drop(res, job, reason)
    else:
        note(res, job, "unlaunchable", reason)


def no_pool(res: RoundResult, job: JobRecord, event: str, reason: str,
            config: SchedulerConfig) -> None:
    """No pool may host a waiting job (``UsablePools.why_none`` says why): say so on the job
    (once) as ``event``; a queued one is dropped instead under admission drop."""
    if job.state is JobState.QUEUED and config.admission is Admission.DROP:
        _drop(res, job, reason)
    else:
        note(res, job, event, reason)


def on_demand_launches(job: JobRecord, pools: Sequence[Pool]) -> bool:
    """Does a pool the job may use (``Needs``: on-demand, for the ``spot: never`` job this
    asks about) launch a GPU count it accepts?"""
    g, needs = job.spec.gpus, Needs.of(job.spec)
    return any(needs.unmet(p) is None and
               any(p.launchable(n) for n in range(g.min, min(g.max, p.capacity) + 1))
               for p in pools)


def _drop(res: RoundResult, job: JobRecord, reason: str) -> None:
    transitions.dropped(res.plan, job, reason)
    res.dropped += 1
    res.changed.append(job.id)
