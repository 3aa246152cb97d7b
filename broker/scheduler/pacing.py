"""Deadline pacing (Can't Be Late, ``policies.spot.choose_market``): where a deadline job
stands at its requested size, the market it is sent to, the sizes it takes on on-demand, and
placement with a second market for the jobs the first had no room for."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from broker.models import JobRecord, JobState
from broker.scheduler.choices import job_accelerator, job_model, samples_per_sec
from broker.scheduler.config import Policy, SchedulerConfig
from broker.scheduler.placing import Marks, held_gpus, lost_work_h, on_market, restart_s
from policies.elastic_dp import Choice
from policies.job_model import TablePrior
from policies.models import Accelerator, Market, Pool
from policies.placement import PlacementRequest, PlacementResult, PoolRisk, eligible, place
from policies.spot import DeadlineJob, choose_market, holds_pace, must_not_preempt, preemption_h
from policies.throughput import batch_candidates


def work_hours(job: JobRecord, choice: Choice, config: SchedulerConfig,
               accelerator: Accelerator | None = None) -> tuple[float, float]:
    """Hours the job's whole work takes at ``choice``'s GPUs, and hours of it done, at the
    scheduler's throughput estimate (``samples_per_sec``). A job whose spec names a measured
    model trains through epochs whose statistical efficiency differs (the gradient noise scale
    grows as training goes on, so larger batches pay off later): its hours add up each epoch's
    work at that epoch's rate, the best batch there (the choice's under a fixed batch), scaled
    as the fitted model scales the tables, and the current epoch at the rate estimated now.
    Counting all the work at the current epoch's rate would overstate a young job's hours
    several times over and send it to on-demand for a deadline it can meet on spot. Other jobs
    count all the work at the current rate (nothing is known of how their efficiency moves)."""
    spec = job.spec
    rate = samples_per_sec(job, choice.gpus, choice.batch_size, accelerator)
    work, done = spec.work_samples, min(job.samples_done, spec.work_samples)
    model = job_model(job)
    prior, accel = model.prior, accelerator or job_accelerator(job)
    if not isinstance(prior, TablePrior) or not prior.measured_on(accel):
        return work / rate / 3600, done / rate / 3600
    fixed = config.policy is not Policy.ELASTIC or spec.batch_mode.value == "fixed"
    batches = (choice.batch_size,) if fixed else tuple(
        batch_candidates(spec.batch_size.min, spec.batch_size.max, choice.gpus))
    rates = model.scale * _epoch_rates(replace(prior, epoch=0), accel, choice.gpus, batches)
    rates[prior.epoch] = rate
    rates = np.where(rates > 0, rates, rate)
    bounds = prior.app.efficiency.boundaries  # M0-iterations at each epoch's start
    starts, lengths = bounds[:-1], np.diff(bounds)
    lengths[-1] = np.inf  # the last epoch's rate past the tables' end (a longer job)
    m0 = prior.app.init_batch_size

    def hours(samples: float) -> float:
        return float(np.sum(np.clip(samples / m0 - starts, 0.0, lengths) * m0 / rates)) / 3600

    return hours(work), hours(done)


def hours_left(job: JobRecord, choice: Choice, config: SchedulerConfig,
               accelerator: Accelerator | None = None) -> float:
    """Hours the job's work left takes at ``choice`` (:func:`work_hours`)."""
    total, done = work_hours(job, choice, config, accelerator)
    return total - done


@functools.lru_cache(maxsize=4096)
def _epoch_rates(prior: TablePrior, accelerator: Accelerator, gpus: int,
                 batches: tuple[int, ...]) -> np.ndarray:
    """The tables' samples/s at ``gpus`` in every epoch, at the best of ``batches`` there."""
    epochs = len(prior.app.efficiency.boundaries) - 1
    out = np.array([max((replace(prior, epoch=e).rate(accelerator, gpus, b) for b in batches),
                        default=0.0) for e in range(epochs)])
    out.flags.writeable = False
    return out


def deadline_job(job: JobRecord, choice: Choice, pools_by_id: Mapping[str, Pool],
                 config: SchedulerConfig, now: float,
                 accelerator: Accelerator | None = None) -> DeadlineJob:
    """Where the job stands against its deadline for ``policies.spot.choose_market``.

    Hours of work are counted at ``choice`` (GPUs, batch), the job's requested size
    (:func:`requested_choice`: what it would get if placed, whatever this round allocates), at
    the scheduler's throughput estimate there (the agent's measurement where it has one, else the
    fitted model), epoch by epoch where the model's tables know them (:func:`work_hours`): the
    total is ``work_samples``, the progress the samples done (the fraction done is exact; the
    hours are as good as the rate estimate). One preemption costs ``reaction_s``, :func:`restart_s`
    and the work it loses (:func:`lost_work_h`). ``spot: never`` is ``must_not_preempt``."""
    spec = job.spec
    rate = samples_per_sec(job, choice.gpus, choice.batch_size, accelerator)
    total_h, progress_h = work_hours(job, choice, config, accelerator)
    pool = pools_by_id.get(job.pool or "") if job.state is JobState.RUNNING else None
    return DeadlineJob(
        total_h=total_h, progress_h=progress_h, elapsed_h=max(0.0, now - job.submitted_at) / 3600,
        deadline_h=None if spec.deadline_s is None else spec.deadline_s / 3600,
        restart_h=preemption_h(config.reaction_s / 3600, restart_s(job, config, now) / 3600,
                               lost_work_h(job, choice.batch_size, rate, config),
                               total_h - progress_h),
        switch_h=restart_s(job, config, now) / 3600, must_not_preempt=must_not_preempt(spec.spot),
        current=None if pool is None else pool.market)


def spare_on_demand(jobs: Sequence[JobRecord], pools: Sequence[Pool],
                    used: Mapping[str, int]) -> dict[str, int]:
    """GPUs of each on-demand pool that no job holds (pool id -> GPUs): what recoveries from
    preemptions can be promised (:func:`with_recovery`)."""
    spare = {p.id: p.capacity - used.get(p.id, 0) for p in pools if p.market is Market.ON_DEMAND}
    for job in jobs:
        if job.state is JobState.RUNNING and job.pool in spare:
            spare[job.pool] -= job.gpus
    return spare


def with_recovery(job: JobRecord, view: DeadlineJob, opts: Sequence[Choice],
                  pools: Sequence[Pool], spare: dict[str, int], marks: Marks,
                  config: SchedulerConfig, accelerator: Accelerator | None = None,
                  ) -> DeadlineJob:
    """``view`` with the recovery a preemption would take (``DeadlineJob.recover_h``) for a job
    whose slack at its pace's size no longer covers one, when an elastic recovery does: the
    smallest size (of ``opts``) whose work left on on-demand, restarted after the preemption,
    still meets the deadline, in an on-demand pool it may use with that many ``spare`` GPUs
    (:func:`spare_on_demand`), which are then held for it (taken out of ``spare``), so two
    jobs a preemption hits together never count on the same GPUs. Without such room, or for a
    job the plain net covers, ``view`` as it is."""
    if view.must_not_preempt or view.deadline_h is None or view.slack_h > view.net_h:
        return view
    probe = PlacementRequest(job.id, 0, spot=job.spec.spot, allow=job.spec.regions.allow,
                             deny=job.spec.regions.deny, refused=frozenset(marks.refused),
                             markets=frozenset({Market.ON_DEMAND}))
    usable = [p for p in pools if p.id in spare and eligible(p, probe)]
    budget = view.deadline_h - view.elapsed_h - view.net_h  # hours the recovery may take
    for c in sorted(opts, key=lambda c: c.gpus):
        host = next((p for p in usable if spare[p.id] >= c.gpus and p.launchable(c.gpus)), None)
        if host is None:
            continue
        left = hours_left(job, c, config, accelerator)
        if left < budget:
            spare[host.id] -= c.gpus
            return view.model_copy(update={"recover_h": left})
    return view


@dataclass
class Placed:
    """A round's placements (job id -> pool and GPUs, or ``None``), the deadline jobs that wait
    for spot and give their share back, and why some jobs got nothing (job id -> reason)."""

    where: dict[str, PlacementResult | None]
    waits: set[str] = field(default_factory=set)
    notes: dict[str, str] = field(default_factory=dict)
    # sent to on-demand on the second try, no room there at its sizes: allocated anew
    switched: set[str] = field(default_factory=set)
    # sent to on-demand first, no room in any market it may use: gives its share back
    missed: set[str] = field(default_factory=set)


WAIT_FOR_ON_DEMAND = ("waiting for on-demand: it must not be preempted (spot: never) and no "
                      "on-demand pool it may use has room for it")


@dataclass(frozen=True)
class Paced:
    """A deadline job's standing: its requested size (:func:`requested_choice`), where it stands
    at that size (:func:`deadline_job`), the market ``choose_market`` picks while spot is there,
    and the sizes it takes on on-demand, largest first (:func:`on_demand_choices`)."""

    requested: Choice
    view: DeadlineJob
    market: Market | None
    on_demand: tuple[Choice, ...] = ()

    @classmethod
    def of(cls, requested: Choice, view: DeadlineJob, on_demand: Sequence[Choice] = ()) -> Paced:
        return cls(requested, view, choose_market(view, spot_available=True), tuple(on_demand))


def place_by_deadline(requests: Sequence[PlacementRequest], paced: Mapping[str, Paced],
                      pools: Sequence[Pool], used: Mapping[str, int],
                      risk: Mapping[str, PoolRisk], config: SchedulerConfig,
                      below_pace: bool = False) -> Placed:
    """Placement with each job in ``paced`` (the jobs with a deadline) on its market while spot
    is there; one that finds no pool with room there is asked again (:func:`second_market`):
    sent to spot, on-demand when behind its pace (:func:`_retry`), else it waits this round
    (holds no GPUs); sent to on-demand, spot (progress beats
    waiting; a running job keeps its spot pool), unless it must not be preempted: that one waits
    for on-demand room and says so. On the round's last try (``below_pace``) on-demand also
    takes the smaller sizes the job accepts: running beats idling behind pace. A job sent to
    on-demand first that finds no room anywhere is ``missed``: it gives its share back. Others
    use any market."""
    first = {r.job_id: paced[r.job_id].market for r in requests if r.job_id in paced}
    placed = place([on_market(r, first.get(r.job_id)) for r in requests], pools, dict(used), risk,
                   config.egress, config.move_margin)
    missed = [r for r in requests if r.job_id in first and placed[r.job_id] is None]
    second = {r.job_id: second_market(first[r.job_id], paced[r.job_id].view) for r in missed}
    retry = [_retry(r, m, paced[r.job_id], below_pace) for r in missed
             if (m := second[r.job_id]) is not None]
    if retry:
        placed.update(place(retry, pools, held_gpus(used, placed), risk, config.egress,
                            config.move_margin))
    out = Placed(placed)
    for k, market in second.items():
        if market is None and first[k] is Market.SPOT:
            out.waits.add(k)
        elif market is None:
            out.notes[k] = WAIT_FOR_ON_DEMAND
        elif market is Market.ON_DEMAND and placed[k] is None and paced[k].on_demand:
            out.switched.add(k)
        if first[k] is Market.ON_DEMAND and placed[k] is None:
            out.missed.add(k)
    return out


def _retry(req: PlacementRequest, market: Market, paced: Paced,
           below_pace: bool = False) -> PlacementRequest:
    """The request on the second market: on-demand at the sizes it takes there
    (``Paced.on_demand``, largest first; none fits: allocated anew, ``Placed.switched``), and
    with ``below_pace`` (the round's last try) then at the size allocated and its fallbacks:
    running beats idling when another job behind pace holds the rest of the room. Spot as
    allocated with its fallbacks."""
    if market is Market.ON_DEMAND and paced.on_demand:
        top, *rest = paced.on_demand
        smaller = {c.gpus for c in rest} | ({req.gpus, *req.fallbacks} if below_pace else set())
        req = replace(req, gpus=top.gpus,
                      fallbacks=tuple(sorted((g for g in smaller if g < top.gpus), reverse=True)))
    return on_market(req, market)


def second_market(first: Market | None, view: DeadlineJob) -> Market | None:
    """The market a deadline job tries when ``first`` had no room for it (``None``: none)."""
    if first is Market.SPOT:
        return choose_market(view, spot_available=False)
    return None if view.must_not_preempt else Market.SPOT


def requested_choice(job: JobRecord, opts: Sequence[Choice], pools: Sequence[Pool],
                     marks: Marks, market: Market | None = None,
                     room: Mapping[str, int] | None = None) -> Choice | None:
    """The job's requested size: its largest configuration (``opts``) up to ``gpus.default``
    (the size it asks for; none: ``gpus.max``) that one pool it may use (markets, regions, no
    refusal mark unless it runs there, as placement lets it stay; only ``market``'s when given)
    holds (its capacity, or its ``room`` this round when given: pool id -> GPUs) and can
    launch."""
    spec = job.spec
    opts = [c for c in opts if c.gpus <= spec.gpus.requested]
    current = job.pool if job.state is JobState.RUNNING else None
    probe = PlacementRequest(job.id, 0, current_pool=current, spot=spec.spot,
                             allow=spec.regions.allow, deny=spec.regions.deny,
                             refused=frozenset(marks.refused),
                             markets=frozenset(Market) if market is None else frozenset({market}))
    usable = [p for p in pools if eligible(p, probe)]
    return max((c for c in opts if any(
        (p.capacity if room is None else room.get(p.id, 0)) >= c.gpus and p.launchable(c.gpus)
        for p in usable)), key=lambda c: c.gpus, default=None)


def on_demand_choices(job: JobRecord, opts: Sequence[Choice], requested: Choice,
                      pools: Sequence[Pool], marks: Marks, room: Mapping[str, int],
                      config: SchedulerConfig, view: DeadlineJob,
                      accelerator: Accelerator | None = None) -> list[Choice]:
    """The sizes a deadline job takes on on-demand, largest first: the smallest that keeps its
    pace (as fast as at ``requested``, the size its pace is judged at) and, started there now
    (``view``: where it stands), still finishes by its deadline (:func:`hours_left`: a job whose
    slack a preemption took must run faster than its pace; so must one whose recovery
    :func:`with_recovery` counted on) and fits an on-demand pool's ``room`` this round (pool id
    -> GPUs not held by jobs the round does not move): on on-demand a job buys its pace and no
    more, which costs fewer on-demand hours and banks no slack that would send it back to spot
    at once; where none fits, every size from the largest one on-demand pool it may use holds
    (:func:`requested_choice` on that market) down to its smallest: running beats idling
    behind pace."""
    top = requested_choice(job, opts, pools, marks, Market.ON_DEMAND)
    if top is None:
        return []
    sizes = sorted((c for c in opts if c.gpus <= top.gpus), key=lambda c: -c.gpus)
    pace = samples_per_sec(job, requested.gpus, requested.batch_size, accelerator)
    budget = None if view.deadline_h is None else \
        view.deadline_h - view.elapsed_h - config.restart_s / 3600
    smallest = next((c for c in reversed(sizes)
                     if samples_per_sec(job, c.gpus, c.batch_size, accelerator) >= pace
                     and (budget is None or view.recovery_slack_h > view.net_h
                          or hours_left(job, c, config, accelerator) <= budget)), None)
    if smallest is not None and requested_choice(job, [smallest], pools, marks,
                                                 Market.ON_DEMAND, room):
        return [smallest]
    return sizes


def paced_choices(jobs: Sequence[JobRecord], choices: Mapping[str, list[Choice]],
                   paced: Mapping[str, Paced], pools_by_id: Mapping[str, Pool],
                   accelerator: Accelerator | None = None,
                   ) -> tuple[dict[str, list[Choice]], set[str]]:
    """The configurations the allocator may give each job, and the jobs that must get one of
    theirs (while all such pins can be honoured): a
    deadline job the pace rule sends to on-demand runs at one of its ``Paced.on_demand`` sizes
    (running, or its current one) and comes first; one sent to spot that ``holds_pace``,
    running on spot at a configuration at least as fast as its pace, keeps it (a rescale's
    restart would cost the slack it lacks). Shrinking such a job below pace is the allocator's
    call: the safety net sends it to on-demand if it falls behind."""
    allowed, required = dict(choices), set()
    for job in jobs:
        p = paced.get(job.id)
        if p is None:
            continue
        opts = choices[job.id]
        running = job.state is JobState.RUNNING
        current = [c for c in opts if running and (c.gpus, c.batch_size) == (job.gpus,
                                                                              job.batch_size)]
        if p.market is Market.ON_DEMAND and p.on_demand:
            allowed[job.id] = [*p.on_demand, *(c for c in current if c not in p.on_demand)]
            if not p.view.must_not_preempt:
                required.add(job.id)
        elif p.market is Market.SPOT and holds_pace(p.view):
            pace = samples_per_sec(job, p.requested.gpus, p.requested.batch_size, accelerator)
            pool = pools_by_id.get(job.pool or "")
            kept = [c for c in current
                    if samples_per_sec(job, c.gpus, c.batch_size, accelerator) >= pace]
            if kept and pool is not None and pool.market is Market.SPOT:
                allowed[job.id] = kept
                required.add(job.id)
    return allowed, required
