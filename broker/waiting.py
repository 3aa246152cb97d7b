"""Why a job waits, and whether it can ever run (pure: no I/O).

``never_runs`` judges a spec against the fleet at its most (the pools its fleet file declares,
none reclaimed, every cloud pool at its ``max_gpus``): what it finds can never change while
that fleet runs, so the API refuses such a submission with the field and the fix.
``Needs`` is the one test of whether a job may use a pool, whatever its size: the round, the
submission check and the preview share it, and ``no_usable_pool`` names the need no pool meets.
``unusable_reason`` and ``too_big_reason`` say the same of a waiting job against the round's
pools, which can grow back (a reclaim ends, a cloud comes back), so the round marks the job
instead of dropping it.
``queue_positions`` numbers the jobs that wait for the same accelerators, in the order the round
considers them, so a job waiting for capacity shows where it stands, like Slurm's ``Reason=``
with the job's place in its partition's queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from broker.models import JobRecord, JobState
from broker.spec import Problem
from policies.models import Accelerator, JobSpec, Market, Pool, size_fits
from policies.placement import region_allowed
from policies.spot import must_not_preempt

UNSCHEDULABLE = "unschedulable"
# What a queued job shows before the first round has looked at it.
NOT_YET_SEEN = "submitted; the next scheduling round considers it"
WAITING_STATES = (JobState.QUEUED, JobState.SUSPENDED)


class Unmet(IntEnum):
    """What a pool lacks for a job, whatever GPUs it has free, in the order the needs are
    tested: the first a pool fails is its reason, and the furthest any pool got is the job's."""

    ACCELERATOR = 1
    REGION = 2
    MARKET = 3  # spot: never, and the pool is spot
    NODE = 4  # a fixed node count whose share of GPUs the pool sells on no node
    CONTAINER = 5  # a container image, and the pool's nodes cannot run containers
    SIZE = 6  # a CPU job's cpus or memory per node, which the pool's nodes do not have


@dataclass(frozen=True, slots=True)
class Needs:
    """What a job asks of a pool whatever the pool's size: the one eligibility test of the
    round (``UsablePools``), the submission check (``never_runs``) and the preview. Hashable,
    so the round looks pools up once per distinct needs."""

    accelerators: frozenset[Accelerator]
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    on_demand: bool  # spot: never
    per_node: int | None  # GPUs on each node of a job of a fixed node count (JobSpec.nodes)
    container: bool = False  # runs in a container image (JobSpec.container_image)
    cpus: str | None = None  # a CPU job's vCPUs per node (JobSpec.cpus, '4' or '4+')
    memory: str | None = None  # and its GiB per node

    @classmethod
    def of(cls, spec: JobSpec) -> Needs:
        return cls(frozenset(spec.accelerators), tuple(spec.regions.allow),
                   tuple(spec.regions.deny), must_not_preempt(spec.spot),
                   spec.gpus.min // spec.nodes if spec.nodes else None,
                   spec.container_image is not None, spec.cpus, spec.memory)

    def unmet(self, pool: Pool) -> Unmet | None:
        """The first need ``pool`` fails, or None: the job may use it."""
        if pool.accelerator not in self.accelerators:
            return Unmet.ACCELERATOR
        if not region_allowed(pool, self.allow, self.deny):
            return Unmet.REGION
        if self.on_demand and pool.market is Market.SPOT:
            return Unmet.MARKET
        # A pool without instance sizes launches any count on one node; one with sizes
        # (a cloud's types, a local region of several nodes) only those per node.
        if self.per_node is not None and pool.gpu_prices is not None and \
                self.per_node not in pool.gpu_prices:
            return Unmet.NODE
        # never on the host instead: the job's commands need the image's software
        if self.container and not pool.containers:
            return Unmet.CONTAINER
        if not (size_fits(self.cpus, pool.cpus_per_node)
                and size_fits(self.memory, pool.memory_gib_per_node)):
            return Unmet.SIZE
        return None


def no_usable_pool(spec: JobSpec, pools: Sequence[Pool], *, skypilot: bool = False,
                   ) -> tuple[Unmet, Problem] | None:
    """Why none of ``pools`` may host ``spec``: the furthest need any pool got to and failed,
    with the field and the fix (``skypilot``: the task's fields); None when one may."""
    needs = Needs.of(spec)
    failed = [(u, p) for p in pools if (u := needs.unmet(p)) is not None]
    if len(failed) < len(pools) or not failed:
        return None
    cause = max(u for u, _ in failed)
    near = [p for u, p in failed if u is cause]  # the pools that met every need before it
    accels = "/".join(a.value for a in spec.accelerators)
    if cause is Unmet.ACCELERATOR and spec.cpu_only:
        return cause, Problem(
            field="resources.accelerators" if skypilot else "accelerators", value="none (CPU)",
            message=f"a CPU-only task, and this fleet has no CPU pool; {CPU_POOL_FIX}")
    if cause is Unmet.ACCELERATOR:
        have = ", ".join(sorted({p.accelerator.value for p in pools}))
        return cause, Problem(
            field="resources.accelerators" if skypilot else "accelerators", value=accels,
            message=f"no pool of this fleet offers {accels}; it has {have}: ask for one of "
            "those, or add a pool of that type to the fleet file")
    if cause is Unmet.REGION:
        r = spec.regions
        where = ", ".join(sorted({f"{p.cloud}:{p.region}" for p in near}))
        return cause, Problem(
            field="resources.infra" if skypilot else "regions",
            value=f"allow {r.allow} deny {r.deny}",
            message=f"regions allow {r.allow} deny {r.deny} leave no {accels} pool; {accels} "
            f"is offered in {where}: widen regions.allow or narrow regions.deny"
            + (" (resources.infra)" if skypilot else ""))
    # The round does not know a job's format: these fixes name both forms' fields.
    if cause is Unmet.MARKET:
        return cause, Problem(
            field="resources.use_spot" if skypilot else "spot", value="never",
            message=f"spot: never, and no on-demand {accels} pool in its regions: allow spot "
            "(use_spot: true / spot: allowed) or add on-demand capacity")
    if cause is Unmet.CONTAINER:
        where = ", ".join(sorted({f"{p.cloud}:{p.region}" for p in near}))
        return cause, Problem(
            field="resources.image_id" if skypilot else "container_image",
            value=spec.container_image, message=(
                f"runs in a container image, and the {accels} pools in its regions ({where}) "
                "cannot run containers (no usable Docker on their machine): install Docker on "
                "the local fleet's machine, or run on a cloud pool"))
    if cause is Unmet.SIZE:
        have = ", ".join(sorted({f"{p.id} ({_size(p)})" for p in near}))
        asked = ", ".join(f"{k} {v}" for k, v in (("cpus", spec.cpus), ("memory", spec.memory))
                          if v is not None)
        return cause, Problem(
            field=f"resources.{'cpus' if spec.cpus else 'memory'}" if skypilot else
            ("cpus" if spec.cpus else "memory"), value=asked,
            message=f"asks {asked} per node; the CPU nodes in its regions have {have}: ask "
            f"what one of them has (a trailing + means at least), or {CPU_POOL_FIX}")
    sizes = sorted({g for p in near for g in p.gpu_prices or ()})
    per_node, total = needs.per_node, spec.gpus.min
    field = "resources.accelerators" if skypilot else "nodes"
    if per_node is not None and per_node < sizes[-1]:  # between or below the sizes sold
        return cause, Problem(field=field, value=f"{per_node} GPUs per node", message=(
            f"needs {per_node} GPUs on each node; {accels} nodes in its regions come with "
            f"{', '.join(map(str, sizes))}: ask one of those per node"))
    split = f"num_nodes (nodes): {total // sizes[-1]} of {accels}:{sizes[-1]}" \
        if total % sizes[-1] == 0 else "more num_nodes (nodes)"
    return cause, Problem(field=field, value=f"{per_node} GPUs per node", message=(
        f"needs {per_node} GPUs on one node; the largest {accels} node in its regions has "
        f"{sizes[-1]}: ask {split}, or fewer GPUs"))


# The fix of a CPU job no pool can host, named in every such refusal and waiting reason.
CPU_POOL_FIX = ("add a CPU pool to the fleet file: a region like {region: lab, cpu_nodes: 2, "
                "cpus_per_node: 4, price_per_node_hour: 0} (docs/clouds.md#cpu-pools)")


def _size(pool: Pool) -> str:
    cpus = "?" if pool.cpus_per_node is None else f"{pool.cpus_per_node:g}"
    memory = "?" if pool.memory_gib_per_node is None else f"{pool.memory_gib_per_node:g}"
    return f"{cpus} vCPUs, {memory} GiB"


def never_runs(spec: JobSpec, ceiling: Sequence[Pool], *, skypilot: bool = False,
               ) -> list[Problem]:
    """Why ``spec`` can never run on a fleet whose pools at their most are ``ceiling`` (empty:
    nothing is certain, no problem). ``skypilot``: name the task's fields in the fix."""
    if not ceiling:
        return []
    if (found := no_usable_pool(spec, ceiling, skypilot=skypilot)) is not None:
        return [found[1]]
    needs = Needs.of(spec)
    top = max((p for p in ceiling if needs.unmet(p) is None), key=lambda p: p.capacity)
    if spec.gpus.min > top.capacity and spec.cpu_only:
        return [Problem(
            field="num_nodes" if skypilot else "nodes", value=f"{spec.nodes} CPU nodes",
            message=f"asks for {spec.nodes} CPU nodes in one region, more than this fleet will "
            f"ever have there (its largest CPU pool, {top.id}, has {top.capacity}); lower "
            "num_nodes or add CPU nodes to the fleet file")]
    if spec.gpus.min > top.capacity:
        accels = "/".join(a.value for a in spec.accelerators)
        field = "resources.accelerators" if skypilot else "gpus.min"
        fix = (f"lower the GPU count or num_nodes (at most {top.capacity} GPUs in all)"
               if skypilot else f"lower gpus.min to at most {top.capacity} (in a SkyPilot "
               "task: the accelerator count times num_nodes)")
        return [Problem(field=field, value=f"{spec.gpus.min} GPUs", message=(
            f"asks for at least {spec.gpus.min} GPUs in one region, more than this fleet will "
            f"ever have there (its largest {accels} pool, {top.id}, holds {top.capacity}); "
            f"{fix}"))]
    return []


def unusable_reason(spec: JobSpec, pools: Sequence[Pool]) -> tuple[str, str]:
    """The event and reason of a waiting job none of the round's ``pools`` may host (there is
    one: ``no_usable_pool`` found why). Pools come back (a reclaim ends, a cloud lists them
    again), so the job is marked, not dropped."""
    found = no_usable_pool(spec, pools)
    if found is None or found[0] is Unmet.ACCELERATOR:  # no pool at all, or none of its types
        return UNSCHEDULABLE, no_pool_reason(spec)
    cause, problem = found
    if cause is Unmet.REGION:
        return "no-region", problem.message
    return UNSCHEDULABLE, f"{UNSCHEDULABLE}: {problem.message}"


def no_pool_reason(spec: JobSpec) -> str:
    """The reason of a waiting job no pool of the round offers an accelerator for. A cloud may
    add such pools (its listing comes back), so the job is marked, not dropped."""
    if spec.cpu_only:
        return (f"{UNSCHEDULABLE}: a CPU job, and no CPU pool is offered now; it waits until "
                f"one is, or {CPU_POOL_FIX}")
    accels = "/".join(a.value for a in spec.accelerators)
    return (f"{UNSCHEDULABLE}: no pool offers {accels} now; it waits until one does (or change "
            "its accelerators)")


def too_big_reason(spec: JobSpec, largest: int) -> str | None:
    """The reason of a waiting job that asks for more GPUs than the largest of its usable pools
    holds now (``largest``), or None. A reclaimed pool comes back, so it is marked, not dropped."""
    if spec.gpus.min <= largest:
        return None
    if spec.cpu_only:
        return (f"{UNSCHEDULABLE}: needs {spec.nodes} CPU nodes in one pool, and the largest "
                f"CPU pool in its regions has {largest} now; lower nodes, or it waits until a "
                "pool grows")
    accels = "/".join(a.value for a in spec.accelerators)
    return (f"{UNSCHEDULABLE}: needs at least {spec.gpus.min} GPUs in one pool, and the largest "
            f"{accels} pool in its regions holds {largest} now; lower gpus.min, or it waits "
            "until a pool grows")


def waiting_for_capacity(accel: Accelerator) -> str:
    """The reason of a job the allocator gave no GPUs (or CPU nodes) this round."""
    what = "CPU node" if accel is Accelerator.CPU else f"{accel.value} GPU"
    return (f"waiting for capacity: every {what} in its regions is in use or given to a job "
            "ahead of it")


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
