"""A job's transitions, one function each: what each sets, and what it resets because the state
it leaves no longer means it. Every write of a job's record goes through one of these (and
``Plan.change``, which checks the transition against ``broker.models`` and writes the event), so
what an attempt, a round or a stop owns is decided in one place.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from broker.models import Intent, JobRecord, JobState
from policies.models import JobSpec

if TYPE_CHECKING:  # the store writes plans and makes its own transitions with these
    from broker.store import Plan

# In the event of every transition that counts a preemption (the dashboard's timeline finds
# them by it, whatever the event's type).
PREEMPTED = {"preempted": True}


def launching(plan: Plan, job: JobRecord, intent: Intent, *, nodes: int, moved: bool,
              resized: bool) -> None:
    """A new attempt (``intent``, a launch) of ``nodes`` nodes: the attempt's pool, size and
    launch key; a move or a resize counted; nothing of the last attempt's nodes, exit code or
    rendezvous round carries over."""
    plan.change(job, JobState.LAUNCHING,
                event_data={"pool": intent.pool, "gpus": intent.gpus,
                            "batch_size": intent.batch_size},
                attempt=intent.attempt, launch_key=intent.key, gpus=intent.gpus,
                batch_size=intent.batch_size, pool=intent.pool, fence=intent.fence, nodes=nodes,
                migrations=job.migrations + moved, rescales=job.rescales + resized,
                reason="resumed from checkpoint" if job.attempt > 0 and job.pool else "placed",
                node_ids=[], exit_code=None, round=0, stand_ins={}, replaced_at=None,
                resized_to=None)
    if moved and job.pool:
        plan.count_migration(job.pool)


def running(plan: Plan, job: JobRecord, *, node_ids: list[str], started: float,
            fence: int) -> None:
    """The attempt's nodes are up (``started``: when the first came up): its first round."""
    plan.change(job, JobState.RUNNING,
                event_data={"pool": job.pool, "gpus": job.gpus, "batch_size": job.batch_size},
                node_ids=node_ids, launched_at=started, nodes=len(node_ids), round=0,
                started_at=job.started_at or started, fence=fence, reason="running")


def resized_in_place(plan: Plan, job: JobRecord, *, gpus: int, fence: int, now: float) -> None:
    """The running attempt's one node runs ``gpus`` workers from now on, its processes kept
    (its agent is told in the next heartbeat reply): no new attempt, a rescale counted, and the
    config's start (``launched_at``) the round's ``now`` (a simulation's clock is virtual), so
    the rescale interval holds it as a launch would."""
    plan.change(job, event="resize-in-place", event_data={"from": job.gpus, "gpus": gpus},
                gpus=gpus, resized_to=gpus, rescales=job.rescales + 1, launched_at=now,
                fence=fence, reason=f"resized in place to {gpus} GPUs")


def stopping(plan: Plan, job: JobRecord, *, event: str, reason: str, fence: int | None = None,
             data: dict[str, Any] | None = None, preempted: bool = False,
             failed: bool = False) -> None:
    """The attempt is asked to stop (checkpoint and exit: a suspend, move, resize, cancel,
    reclaim or lost nodes), counting a preemption or a failure when that is why."""
    fields: dict[str, Any] = {"reason": reason}
    if fence is not None:
        fields["fence"] = fence
    if preempted:
        fields["preemptions"] = job.preemptions + 1
        data = {**(data or {}), **PREEMPTED}
    if failed:
        fields["failures"] = job.failures + 1
    plan.change(job, JobState.SUSPENDING, event=event, event_data=data, **fields)


def launch_failed(plan: Plan, job: JobRecord, reason: str, *, fence: int, max_failures: int,
                  counted: bool = True) -> None:
    """The launch did not happen: back to the queue (``suspended``), or ``failed`` once a
    ``counted`` failure is one more than ``max_failures`` (a refusal or a pool gone is not
    counted)."""
    failures = job.failures + counted
    state = JobState.FAILED if counted and failures > max_failures else JobState.SUSPENDED
    plan.change(job, state, reason=reason, failures=failures, fence=fence)


def ended(plan: Plan, job: JobRecord, state: JobState, *, reason: str, exit_code: int | None,
          fence: int, event: str | None = None, preempted: bool = False,
          failed: bool = False) -> None:
    """Every node of the attempt is gone: how it ended (completed, suspended, failed,
    cancelled), with the exit code, counting a preemption or a failure when that is why."""
    fields: dict[str, Any] = {"exit_code": exit_code, "fence": fence}
    if preempted:
        fields["preemptions"] = job.preemptions + 1
    if failed:
        fields["failures"] = job.failures + 1
    plan.change(job, state, event=event, event_data=PREEMPTED if preempted else None,
                reason=reason, **fields)


def cancelled(plan: Plan, job: JobRecord, reason: str, *, fence: int | None = None) -> None:
    """Cancelled before it ran (queued, suspended or not yet launched)."""
    fields: dict[str, Any] = {"cancel_requested": True}
    if fence is not None:
        fields["fence"] = fence
    plan.change(job, JobState.CANCELLED, reason=reason, **fields)


def cancel_requested(plan: Plan, job: JobRecord) -> None:
    """A running job's cancel: the next round stops it."""
    plan.change(job, event="cancel-requested", cancel_requested=True)


def dropped(plan: Plan, job: JobRecord, reason: str) -> None:
    """Admission drop: no room when it arrived."""
    plan.change(job, JobState.DROPPED, reason=reason)


def noted(plan: Plan, job: JobRecord, event: str, reason: str) -> None:
    """Why the job waits, as the round sees it (no state change)."""
    plan.note(job, event, reason)


def replacing_nodes(plan: Plan, job: JobRecord, *, ranks: list[int], alive: list[str],
                    reason: str, recovery: str, fence: int, preempted: bool) -> int:
    """Lost ranks are replaced in the job's pool while the survivors stay: a new rendezvous
    round, whose stand-ins the ranks now hold. Returns that round."""
    round_ = job.round + 1
    fields: dict[str, Any] = {"fence": fence}
    if preempted:
        fields["preemptions"] = job.preemptions + 1
    plan.change(job, event="nodes-lost",
                event_data={"ranks": ranks, "round": round_, "recovery": recovery,
                            **(PREEMPTED if preempted else {})},
                reason=reason, round=round_, node_ids=alive,
                stand_ins={**job.stand_ins, **dict.fromkeys(ranks, round_)}, **fields)
    return round_


def nodes_replaced(plan: Plan, job: JobRecord, *, ranks: list[int], round_: int,
                   node_ids: list[str], fence: int) -> None:
    """The stand-ins for ``ranks`` are up: the gang has them."""
    plan.change(job, event="nodes-replaced",
                event_data={"ranks": ranks, "round": round_, "nodes": node_ids},
                node_ids=[*job.node_ids, *node_ids], replaced_at=time.time(), fence=fence)


def checkpoint_located(plan: Plan, job: JobRecord, *, spec: JobSpec, uri: str, region: str,
                       fence: int) -> None:
    """The job's checkpoint bucket's region, found once: placement prices restores from it."""
    plan.change(job, event="checkpoint-located", event_data={"uri": uri, "region": region},
                spec=spec, fence=fence)
