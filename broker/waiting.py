"""Why a job waits, and whether it can ever run (pure: no I/O).

``never_runs`` judges a spec against the fleet at its most (the pools its fleet file declares,
none reclaimed, every cloud pool at its ``max_gpus``): what it finds can never change while
that fleet runs, so the API refuses such a submission with the field and the fix.
``no_pool_reason`` and ``too_big_reason`` say the same of a waiting job against the round's
pools, which can grow back (a reclaim ends, a cloud comes back), so the round marks the job
instead of dropping it.
``queue_positions`` numbers the jobs that wait for the same accelerators, in the order the round
considers them, so a job waiting for capacity shows where it stands, like Slurm's ``Reason=``
with the job's place in its partition's queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from broker.models import JobRecord, JobState
from broker.spec import Problem
from policies.models import Accelerator, JobSpec, Pool
from policies.placement import region_allowed

UNSCHEDULABLE = "unschedulable"
# What a queued job shows before the first round has looked at it.
NOT_YET_SEEN = "submitted; the next scheduling round considers it"
WAITING_STATES = (JobState.QUEUED, JobState.SUSPENDED)


def never_runs(spec: JobSpec, ceiling: Sequence[Pool], *, skypilot: bool = False,
               ) -> list[Problem]:
    """Why ``spec`` can never run on a fleet whose pools at their most are ``ceiling`` (empty:
    nothing is certain, no problem). ``skypilot``: name the task's fields in the fix."""
    if not ceiling:
        return []
    accels = "/".join(a.value for a in spec.accelerators)
    typed = [p for p in ceiling if p.accelerator in spec.accelerators]
    if not typed:
        have = ", ".join(sorted({p.accelerator.value for p in ceiling}))
        field = "resources.accelerators" if skypilot else "accelerators"
        return [Problem(field=field, value=accels, message=(
            f"no pool of this fleet offers {accels}; it has {have}: ask for one of those, or "
            "add a pool of that type to the fleet file"))]
    r = spec.regions
    placed = [p for p in typed if region_allowed(p, r.allow, r.deny)]
    if not placed:
        where = ", ".join(sorted({f"{p.cloud}:{p.region}" for p in typed}))
        field = "resources.infra" if skypilot else "regions"
        return [Problem(field=field, value=f"allow {r.allow} deny {r.deny}", message=(
            f"no {accels} pool lies in these regions; {accels} is offered in {where}: widen "
            "the allowed regions or narrow the denied ones"))]
    top = max(placed, key=lambda p: p.capacity)
    if spec.gpus.min > top.capacity:
        field = "resources.accelerators" if skypilot else "gpus.min"
        fix = (f"lower the GPU count or num_nodes (at most {top.capacity} GPUs in all)"
               if skypilot else f"lower gpus.min to at most {top.capacity} (in a SkyPilot "
               "task: the accelerator count times num_nodes)")
        return [Problem(field=field, value=f"{spec.gpus.min} GPUs", message=(
            f"asks for at least {spec.gpus.min} GPUs in one region, more than this fleet will "
            f"ever have there (its largest {accels} pool, {top.id}, holds {top.capacity}); "
            f"{fix}"))]
    return []


def no_pool_reason(spec: JobSpec) -> str:
    """The reason of a waiting job no pool of the round offers an accelerator for. A cloud may
    add such pools (its listing comes back), so the job is marked, not dropped."""
    accels = "/".join(a.value for a in spec.accelerators)
    return (f"{UNSCHEDULABLE}: no pool offers {accels} now; it waits until one does (or change "
            "its accelerators)")


def too_big_reason(spec: JobSpec, largest: int) -> str | None:
    """The reason of a waiting job that asks for more GPUs than the largest of its usable pools
    holds now (``largest``), or None. A reclaimed pool comes back, so it is marked, not dropped."""
    if spec.gpus.min <= largest:
        return None
    accels = "/".join(a.value for a in spec.accelerators)
    return (f"{UNSCHEDULABLE}: needs at least {spec.gpus.min} GPUs in one pool, and the largest "
            f"{accels} pool in its regions holds {largest} now; lower gpus.min, or it waits "
            "until a pool grows")


def waiting_for_capacity(accel: Accelerator) -> str:
    """The reason of a job the allocator gave no GPUs this round."""
    return (f"waiting for capacity: every {accel.value} GPU in its regions is in use or given "
            "to a job ahead of it")


@dataclass(frozen=True)
class QueuePlace:
    position: int  # 1: the next to be considered
    of: int  # jobs in that queue


def queue_positions(jobs: Iterable[JobRecord]) -> dict[str, QueuePlace]:
    """Each waiting job's place among the waiting jobs that share an accelerator with it, in
    the round's order (priority, then submission time)."""
    waiting = sorted((j for j in jobs if j.state in WAITING_STATES and not j.cancel_requested),
                     key=lambda j: (-j.spec.priority, j.submitted_at, j.id))
    # Jobs come in few accelerator sets: count per set, so a long queue costs jobs x sets.
    key_of = {j.id: frozenset(j.spec.accelerators) for j in waiting}
    sets = set(key_of.values())
    totals = {k: sum(1 for j in waiting if key_of[j.id] == k) for k in sets}
    seen = dict.fromkeys(sets, 0)
    out: dict[str, QueuePlace] = {}
    for job in waiting:
        mine = key_of[job.id]
        shared = [k for k in sets if k & mine]
        out[job.id] = QueuePlace(1 + sum(seen[k] for k in shared),
                                 sum(totals[k] for k in shared))
        seen[mine] += 1
    return out
