"""One accelerator type's allocation (``policies.elastic_dp``) and placement: spot-paced
deadline jobs share spot first, admission, running jobs favoured by what a restart loses, and
fragmentation repair; and the type each job that accepts several is given."""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from broker.models import JobRecord, JobState
from broker.scheduler.config import Admission, Policy, SchedulerConfig
from broker.scheduler.intents import RoundResult, resizes_in_place
from broker.scheduler.pacing import (
    Paced,
    Placed,
    deadline_job,
    on_demand_choices,
    paced_choices,
    place_by_deadline,
    requested_choice,
    second_market,
    spare_on_demand,
    with_recovery,
)
from broker.scheduler.placing import Marks, held_gpus, placement_request, restart_s
from policies.elastic_dp import Choice, InfeasibleAllocation, JobChoices, allocate
from policies.models import Accelerator, Market, Pool
from policies.placement import PlacementRequest, PoolRisk, place
from policies.spot import must_not_preempt
from policies.type_assignment import assign_types


def choose_types(jobs: Sequence[JobRecord], offered: Mapping[str, list[Accelerator]],
           choices: Mapping[tuple[str, Accelerator], list[Choice]],
           pools_of: Mapping[Accelerator, list[Pool]],
           room: Mapping[str, int]) -> dict[str, Accelerator]:
    """One accelerator type per job that accepts several
    (``policies.type_assignment.assign_types``: a Lagrangian split of the types' GPUs, scored
    exactly with the allocator); a running job stays on its type, and a job with one offered
    type takes it."""
    multi = [j for j in jobs if len(offered[j.id]) > 1]
    if not multi:
        return {}
    capacity = {a: sum(room.get(p.id, 0) for p in ps) for a, ps in pools_of.items()}
    cands = {j.id: {a: JobChoices(j.id, choices[j.id, a]) for a in offered[j.id]}
             for j in jobs}
    return assign_types(cands, {a: c for a, c in capacity.items()
                                if any(a in offered[j.id] for j in jobs)})


def repair(res: RoundResult, jobs: list[JobRecord], choices: dict[str, list[Choice]],
            placed: Placed, pools: list[Pool], pools_by_id: dict[str, Pool],
            used: Mapping[str, int], risk: Mapping[str, PoolRisk], marks: Marks,
            config: SchedulerConfig, now: float, accel: Accelerator,
            passes: int = 2) -> Placed:
    """Fragmentation repair: the jobs placement left out (the allocator counts a type's GPUs
    as one heap, placement puts each gang in one pool) are allocated again over the room left
    in each pool, at sizes one pool still hosts, so no GPU idles while a waiting job fits."""
    for _ in range(passes):
        left = [j for j in jobs if placed.where.get(j.id) is None and j.id not in placed.waits]
        if not left:
            break
        held = held_gpus(used, placed.where)
        room = {p.id: max(0, p.capacity - held.get(p.id, 0)) for p in pools}
        hosts = functools.cache(lambda g, room=room: any(
            room[p.id] >= g and p.launchable(g) for p in pools))
        again = {j.id: [c for c in choices[j.id] if hosts(c.gpus)] for j in left}
        if not any(again.values()):
            break
        more = allocate_and_place(res, left, again, sum(room.values()), pools, pools_by_id,
                                   held, risk, marks, config, now, accel)
        got = {k: v for k, v in more.where.items() if v is not None}
        if not got:
            break
        placed.where.update(got)
        placed.waits |= more.waits
        for k in got:
            placed.notes.pop(k, None)
    return placed


def allocate_and_place(res: RoundResult, jobs: list[JobRecord],
                        choices: dict[str, list[Choice]], capacity: int, pools: list[Pool],
                        pools_by_id: dict[str, Pool], used: Mapping[str, int],
                        risk: Mapping[str, PoolRisk], marks: Marks,
                        config: SchedulerConfig, now: float,
                        accel: Accelerator | None = None) -> Placed:
    """One accelerator's allocation and placement; the deadline jobs that wait for spot or
    found no room in any market they may use (see :func:`place_by_deadline`) give their share
    back: the others are allocated and placed again without them, and those sent to on-demand
    on a second try that found no room there are allocated on on-demand (:func:`paced_choices`).
    A deadline job is judged at its requested size (:func:`requested_choice`), its safety net
    against the on-demand room held for its recovery (:func:`with_recovery`). One whose
    deadline is lost (no recovery, and the work left at its requested size ends past it) is
    placed as a job without one: on-demand bought for it saves no deadline and takes the room
    the jobs that can still meet theirs may need."""
    room = {p.id: p.capacity - used.get(p.id, 0) for p in pools}
    spare = spare_on_demand(jobs, pools, used)
    paced = {}
    for job in (j for j in jobs if j.spec.deadline_s is not None):
        if (c := requested_choice(job, choices[job.id], pools, marks)) is not None:
            view = with_recovery(job, deadline_job(job, c, pools_by_id, config, now, accel),
                                 choices[job.id], pools, spare, marks, config, accel)
            if view.recovery_slack_h < 0:
                continue
            paced[job.id] = Paced.of(c, view, on_demand_choices(
                job, choices[job.id], c, pools, marks, room, config, view, accel))
    waiting: set[str] = set()
    missed: dict[str, PlacementRequest] = {}  # gave their share back: what they asked for
    notes: dict[str, str] = {}
    spot_room = sum(room[p.id] for p in pools if p.market is Market.SPOT)
    for last in (False, True):
        active = [j for j in jobs if j.id not in waiting and j.id not in missed]
        t0 = time.perf_counter()
        chosen = _allocate_spot_first(active, choices, capacity, spot_room, paced, waiting,
                                      pools_by_id, config, now, accel)
        res.solve_s += time.perf_counter() - t0
        requests = []
        for job in active:
            c = chosen.get(job.id)
            if c is None:
                continue
            fallbacks = sorted((x.gpus for x in choices[job.id] if x.gpus < c.gpus), reverse=True)
            requests.append(placement_request(job, c, fallbacks, marks, pools_by_id, config,
                                              accel, now))
        placed = place_by_deadline(requests, paced, pools, used, risk, config, below_pace=last)
        notes.update(placed.notes)
        if not placed.waits and not placed.switched and not placed.missed:
            break
        waiting |= placed.waits
        missed.update({r.job_id: r for r in requests if r.job_id in placed.missed})
        paced.update({k: replace(paced[k], market=Market.ON_DEMAND) for k in placed.switched})
    placed.waits = waiting
    asked = [*requests, *(r for k, r in missed.items() if k not in placed.where)]
    placed.notes = notes | _refusal_notes(asked, placed, pools, used, risk, marks, config)
    return placed


def _allocate_spot_first(jobs: list[JobRecord], choices: dict[str, list[Choice]],
                         capacity: int, spot_room: int, paced: dict[str, Paced],
                         waiting: set[str], pools_by_id: dict[str, Pool],
                         config: SchedulerConfig, now: float,
                         accel: Accelerator | None) -> dict[str, Choice | None]:
    """The allocation as Can't Be Late has it. The deadline jobs the pace rule sends to spot
    share the spot pools' room (``spot_room``) first: spot is "available" to a job when the
    allocator finds it spot GPUs. One that gets none takes its second market
    (:func:`second_market`): on-demand when behind its pace (``paced`` is updated), else it
    waits for spot (added to ``waiting``, it holds nothing). Then every other job shares what
    is left, each deadline job at the sizes its market allows (:func:`paced_choices`).
    Allocated over every pool of the type at once, spot jobs would be sized for GPUs only
    on-demand has, and the overflow would land there."""
    on_spot = [j for j in jobs if (p := paced.get(j.id)) is not None and p.market is Market.SPOT]
    chosen: dict[str, Choice | None] = {}
    if on_spot:
        # the others' running spot jobs keep their GPUs: they are not the spot jobs' to share
        kept = sum(j.gpus for j in jobs if j not in on_spot and j.state is JobState.RUNNING
                   and (p := pools_by_id.get(j.pool or "")) is not None
                   and p.market is Market.SPOT)
        allowed, required = paced_choices(on_spot, choices, paced, pools_by_id, accel)
        chosen = _allocate(on_spot, allowed, max(0, min(capacity, spot_room - kept)),
                           pools_by_id, config, now, required)
        for job in on_spot:
            if chosen.get(job.id) is not None:
                continue
            market = second_market(Market.SPOT, paced[job.id].view)
            if market is None:
                waiting.add(job.id)
            else:
                paced[job.id] = replace(paced[job.id], market=market)
    taken = sum(c.gpus for c in chosen.values() if c is not None)
    rest = [j for j in jobs if chosen.get(j.id) is None and j.id not in waiting]
    allowed, required = paced_choices(rest, choices, paced, pools_by_id, accel)
    chosen.update(_allocate(rest, allowed, max(0, capacity - taken), pools_by_id, config, now,
                            required))
    return chosen


def _allocate(jobs: list[JobRecord], choices: dict[str, list[Choice]], capacity: int,
              pools_by_id: dict[str, Pool], config: SchedulerConfig,
              now: float, required: Collection[str] = ()) -> dict[str, Choice | None]:
    """Run the allocator with running jobs' current config favoured (by the share of the
    restart horizon a restart would lose, :func:`restart_s`: a plain script's whole attempt
    too, a script that commits its own checkpoints the work since the newest) and, for
    jobs started less than ``min_rescale_interval_s`` ago (or under the static policy) and jobs
    that must not be preempted (``spot: never``: no suspension or rescale to rebalance), pinned;
    so are the ``required`` jobs to one of their choices (:func:`paced_choices`). Under
    admission drop a running job is never suspended to admit a newcomer (required, as in the
    seed paper), and a newcomer is admitted, in order, only while its smallest size still fits
    beside those admitted before it (:func:`_admitted`). Pins are dropped when they cannot all
    be honoured (capacity was lost)."""
    admitted = _admitted(jobs, choices, capacity) if config.admission is Admission.DROP else set()

    def build(pin: bool) -> list[JobChoices]:
        out = []
        for job in jobs:
            opts = choices[job.id]
            if pin and job.id in admitted:
                out.append(JobChoices(job.id, opts, required=True))
                continue
            if pin and job.id in required:
                out.append(JobChoices(job.id, opts, required=True))
                continue
            if job.state is JobState.RUNNING:
                pool = pools_by_id.get(job.pool or "")
                cur = [c for c in opts if (c.gpus, c.batch_size) == (job.gpus, job.batch_size)]
                pinned = (config.policy is Policy.STATIC or must_not_preempt(job.spec.spot) or
                          now - (job.launched_at or 0) < config.min_rescale_interval_s)
                if pin and cur and pinned and pool is not None and pool.capacity >= job.gpus:
                    out.append(JobChoices(job.id, cur, required=True))
                    continue
                # Leaving the current config costs a restart; a size the job reaches in place
                # on its node costs only the in-place resize, so it is favoured by the rest.
                # Only a job whose agent said its workers re-form in place is priced so: the
                # others (a framework integration, FSDP, not known yet) checkpoint and restart
                # their workers on such a resize, a restart's loss.
                restart = restart_s(job, config, now)
                bonus = 1.0 + restart / config.restart_horizon_s
                near = 1.0 + max(0.0, restart - config.resize_in_place_s) / \
                    config.restart_horizon_s
                opts = [Choice(c.gpus, c.batch_size, c.value * bonus) if c in cur else
                        Choice(c.gpus, c.batch_size, c.value * near)
                        if job.resize_in_place and
                        resizes_in_place(job, pool, c.gpus, c.batch_size) else c
                        for c in opts]
            out.append(JobChoices(job.id, opts))
        return out

    try:
        return allocate(build(pin=True), capacity)
    except InfeasibleAllocation:
        return allocate(build(pin=False), capacity)


def _admitted(jobs: Sequence[JobRecord], choices: Mapping[str, list[Choice]],
              capacity: int) -> set[str]:
    """Admission drop: the running jobs, and the newcomers (queued, in the round's order) whose
    smallest size fits beside them; the others get nothing, and a newcomer left out is
    dropped."""
    out, taken = set(), 0
    for job in sorted(jobs, key=lambda j: j.state is not JobState.RUNNING):
        opts = choices[job.id]
        if not opts or job.state not in (JobState.RUNNING, JobState.QUEUED):
            continue
        smallest = min(c.gpus for c in opts)
        if job.state is JobState.QUEUED and taken + smallest > capacity:
            continue
        taken += smallest
        out.add(job.id)
    return out


def _refusal_notes(requests: Sequence[PlacementRequest], placed: Placed, pools: Sequence[Pool],
                   used: Mapping[str, int], risk: Mapping[str, PoolRisk], marks: Marks,
                   config: SchedulerConfig) -> dict[str, str]:
    """Why the jobs left out are: those that the room left would take, were it not for a
    refusal mark, are told which pool refused and until when (job id -> reason)."""
    left = [replace(r, refused=frozenset()) for r in requests
            if placed.where.get(r.job_id) is None and r.job_id not in placed.waits]
    if not left or not marks.refused:
        return {}
    held = held_gpus(used, placed.where)
    would = place(left, pools, held, risk, config.egress, config.move_margin)
    return {k: marks.refused[got.pool] for k, got in would.items()
            if got is not None and got.pool in marks.refused}
