"""One scheduling round: snapshot -> per-accelerator allocation (``policies.elastic_dp``) ->
placement (``policies.placement``, by expected cost: price, preemption risk from the Spot Advisor
prior and the preemptions the broker counted per pool, restart and checkpoint egress; a running
job moves only past the stickiness margin), with a deadline job's market chosen by Can't Be
Late's rule (``policies.spot.choose_market``, see :func:`deadline_job`) -> diff against what
runs -> a plan of job transitions and intents written atomically with the leader's fencing token.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pydantic import BaseModel, Field

from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.store import Plan, PoolStats, Snapshot, Store
from policies.apps import APP_SPECS, Application
from policies.choices import assign_types
from policies.elastic_dp import Choice, InfeasibleAllocation, JobChoices, allocate
from policies.job_model import (
    GenericPrior,
    JobModel,
    Measurement,
    Prior,
    TablePrior,
    fit,
    measurements,
)
from policies.migration import Blocklist, location_keys
from policies.models import Accelerator, JobSpec, Market, Pool
from policies.placement import (
    PlacementRequest,
    PlacementResult,
    PoolRisk,
    eligible,
    place,
    region_allowed,
)
from policies.region_score import DEFAULT_RESTART_S, Egress, Stickiness
from policies.spot import DeadlineJob, choose_market, holds_pace, must_not_preempt, preemption_h
from policies.throughput import batch_candidates
from providers.measurements import load_application

log = logging.getLogger(__name__)


class Policy(StrEnum):
    ELASTIC = "elastic"  # the allocator picks GPU count and batch size
    FIXED_BATCH = "fixed-batch"  # GPU count scales, batch stays at the spec's initial size
    STATIC = "static"  # gpus.min at the initial batch, never rescaled once running


class Admission(StrEnum):
    QUEUE = "queue"  # a job that does not fit waits
    DROP = "drop"  # a job that does not fit in the round it arrives is dropped (seed paper)


class SchedulerConfig(BaseModel):
    policy: Policy = Policy.ELASTIC
    admission: Admission = Admission.QUEUE
    stickiness: float = Field(default=0.1, ge=0, description="bonus on a running job's config")
    min_rescale_interval_s: float = Field(
        default=30.0, ge=0, description="a job keeps its config at least this long after start")
    max_failures: int = Field(default=3, ge=0, description="failed attempts before 'failed'")
    restart_s: float = Field(
        default=DEFAULT_RESTART_S, ge=0, description="what a relaunch costs (node start, setup, "
        "checkpoint restore): placement prices it into a move and into every preemption")
    checkpoint_gb: float = Field(
        default=0.0, ge=0, description="checkpoint size assumed for egress on a move to another "
        "region or cloud for a job whose agent has not reported its checkpoint's size yet")
    egress: Egress = Field(default_factory=Egress, description="checkpoint transfer prices")
    reaction_s: float = Field(
        default=6.0, ge=0, description="from a preemption to the broker's relaunch decision (a "
        "heartbeat, 5 s, and a loop tick, 1 s, by default): the deadline rule counts it with "
        "restart_s and a checkpoint interval in what one preemption can cost")
    checkpoint_on_notice: bool = Field(
        default=False, description="jobs checkpoint on the preemption notice (FleetBroker's "
        "agent does: AWS warns 2 min ahead, GCP and Azure 30 s), so a preemption loses no work "
        "since the last checkpoint; placement and the deadline rule then price a preemption as "
        "its reaction and restart only")
    move_margin: Stickiness = Field(
        default_factory=Stickiness, description="the saving a running job's move to a cheaper "
        "pool must beat (its restart counted): max(min_saving_usd, min_saving_fraction x cost)")


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


@functools.cache
def _application(name: str) -> Application | None:
    """The measured tables of a model the spec names (``policies.apps``), else None."""
    return load_application(name) if name in APP_SPECS else None


def _pool_accelerator(pool_id: str | None) -> Accelerator | None:
    """The accelerator of a pool id (``cloud:region[/zone]:market:accelerator``)."""
    try:
        return Accelerator(pool_id.rsplit(":", 1)[1]) if pool_id else None
    except (IndexError, ValueError):
        return None


def job_accelerator(job: JobRecord) -> Accelerator:
    """The type a job runs (or last ran) on, else the first its spec accepts."""
    return _pool_accelerator(job.pool) or job.spec.accelerators[0]


def job_model(job: JobRecord) -> JobModel:
    """The job's model (``policies.job_model``): the measured tables of ``spec.model`` at the
    job's epoch, else the generic prior, fitted to what its agent measured on the type it ran
    on (:func:`job_accelerator`)."""
    spec = job.spec
    generic = GenericPrior(per_gpu_max=spec.batch_size.per_gpu_max,
                           init_batch=spec.batch_size.initial)
    app = _application(spec.model) if spec.model else None
    prior: Prior = generic
    if app is not None:
        epoch = app.efficiency.epoch(job.samples_done / app.init_batch_size)
        prior = TablePrior(app.name, epoch, app, generic)
    seen = measurements(job.measured)
    if not seen and job.measured_gpus and job.measured_batch_size and job.samples_per_sec:
        seen = ((job.measured_gpus, job.measured_batch_size, job.samples_per_sec),)
    return _fitted(prior, seen, job_accelerator(job))


@functools.lru_cache(maxsize=65_536)
def _fitted(prior: Prior, seen: tuple[Measurement, ...],
            accelerator: Accelerator | None) -> JobModel:
    return fit(prior, seen, accelerator)


def samples_per_sec(job: JobRecord, gpus: int, batch: int,
                    accelerator: Accelerator | None = None) -> float:
    """The scheduler's estimate of ``job``'s useful samples/s at ``gpus`` GPUs of
    ``accelerator`` (default: :func:`job_accelerator`) and global ``batch``."""
    return job_model(job).rate(accelerator or job_accelerator(job), gpus, batch)


def job_choices(job: JobRecord, policy: Policy, max_gpus: int,
                accelerator: Accelerator | None = None, base: float | None = None,
                ) -> list[Choice]:
    """Each GPU count's best batch size on ``accelerator`` and its value: the speed-up over
    ``base`` samples/s (default: the job's best on one GPU of that type)."""
    spec = job.spec
    fixed = policy is not Policy.ELASTIC or spec.batch_mode.value == "fixed"
    lo, hi = spec.gpus.min, min(spec.gpus.max, max_gpus)
    if policy is Policy.STATIC:
        hi = min(hi, lo)
    b = spec.batch_size
    return list(_choice_table(lo, hi, b.min, b.max, b.initial, fixed, spec.priority,
                              job_model(job), accelerator or job_accelerator(job), base))


def one_gpu_rate(job: JobRecord, accelerator: Accelerator, fixed: bool = False) -> float:
    """The job's best useful samples/s on one GPU of ``accelerator``."""
    b = job.spec.batch_size
    return _one_gpu(job_model(job), accelerator, b.min, b.max, b.initial, fixed)


def _batches(bmin: int, bmax: int, binit: int, fixed: bool, gpus: int) -> list[int]:
    if fixed:
        return [binit] if binit >= gpus else []
    return batch_candidates(bmin, bmax, gpus)


@functools.lru_cache(maxsize=65_536)
def _one_gpu(model: JobModel, accelerator: Accelerator, bmin: int, bmax: int, binit: int,
             fixed: bool) -> float:
    return max((model.rate(accelerator, 1, x) for x in _batches(bmin, bmax, binit, fixed, 1)),
               default=0.0) or model.rate(accelerator, 1, binit)


@functools.lru_cache(maxsize=65_536)
def _choice_table(lo: int, hi: int, bmin: int, bmax: int, binit: int, fixed: bool,
                  priority: int, model: JobModel, accelerator: Accelerator,
                  base: float | None) -> tuple[Choice, ...]:
    """Choices depend only on these numbers; jobs of the same shape share one table."""
    base = base or _one_gpu(model, accelerator, bmin, bmax, binit, fixed)
    if not base > 0:
        return ()
    weight = 2.0 ** (priority / 25.0)
    out = []
    for g in range(lo, hi + 1):
        options = _batches(bmin, bmax, binit, fixed, g)
        if not options:
            continue
        rates = {x: model.rate(accelerator, g, x) for x in options}
        best = max(options, key=rates.__getitem__)
        if rates[best] > 0:
            out.append(Choice(g, best, weight * rates[best] / base))
    return tuple(out)


class _Usable:
    """The pools each set of region filters lets a job use, looked up once per round (many
    jobs share their filters)."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.pools = pools
        self._memo: dict[tuple, list[Pool]] = {}

    def __call__(self, spec: JobSpec) -> list[Pool]:
        """Pools with GPUs in the job's regions, on-demand only for ``spot: never``."""
        r, never = spec.regions, must_not_preempt(spec.spot)
        key = (tuple(r.allow), tuple(r.deny), never)
        if (hit := self._memo.get(key)) is None:
            hit = self._memo[key] = [
                p for p in self.pools if p.capacity > 0 and region_allowed(p, r.allow, r.deny)
                and not (never and p.market is Market.SPOT)]
        return hit


def _offered(job: JobRecord, usable: _Usable) -> list[Accelerator]:
    """The types a job may be given: the one it runs on, else those of its accelerators that
    a pool in its regions offers, in the spec's order."""
    if job.state is JobState.RUNNING and (accel := _pool_accelerator(job.pool)) is not None:
        return [accel]
    offered = {p.accelerator for p in usable(job.spec)}
    return [a for a in job.spec.accelerators if a in offered]


def _no_region(job: JobRecord, pools: Iterable[Pool]) -> str | None:
    """Why the job's regions leave it no pool: its allow and deny lists and the regions that
    offer its accelerators (``None``: no pool offers them anywhere)."""
    where = sorted({f"{p.cloud}:{p.region}" for p in pools
                    if p.capacity > 0 and p.accelerator in job.spec.accelerators})
    if not where:
        return None
    r, accels = job.spec.regions, "/".join(a.value for a in job.spec.accelerators)
    return (f"regions allow {r.allow} deny {r.deny} leave no {accels} pool; {accels} is offered "
            f"in {', '.join(where)}: widen regions.allow or narrow regions.deny")


@dataclass(frozen=True)
class Marks:
    """What the blocklist says of this round's pools: ``blocked``, spot pools in a location just
    reclaimed (avoided while another pool has room), and ``refused``, pools where the cloud just
    refused a launch (stock-out, quota; never launched in until the mark lapses), each with the
    reason a job that finds no other pool shows."""

    blocked: frozenset[str] = frozenset()
    refused: Mapping[str, str] = field(default_factory=dict)


def blocked_pools(pools: list[Pool], blocklist: Blocklist | None, now: float) -> frozenset[str]:
    """Spot pools in a location the blocklist holds (a reclaim says nothing about on-demand)."""
    if blocklist is None:
        return frozenset()
    return frozenset(p.id for p in pools if p.market is Market.SPOT and any(
        blocklist.is_blocked(k, now) for k in location_keys(p)))


def refused_pools(pools: list[Pool], blocklist: Blocklist | None, now: float) -> dict[str, str]:
    """Pools of either market with a fresh refusal mark, each with what a job held back by it
    is told: the pool, what the cloud lacked, and when the mark lapses."""
    if blocklist is None:
        return {}
    out = {}
    for p in pools:
        if blocklist.is_refused(p.id, now):
            why = blocklist.refusal_why.get(p.id)
            until = time.strftime("%H:%M:%S", time.gmtime(blocklist.refused_until(p.id)))
            out[p.id] = (f"pool {p.id} refused the launch" + (f" ({why})" if why else "")
                         + f"; retrying after {until} UTC")
    return out


def checkpoint_interval_s(spec: JobSpec, batch: int, samples_per_s: float) -> float:
    """Seconds between the job's checkpoints: the spec's time, or its step count at the
    expected step rate (global ``batch`` samples a step)."""
    every, in_steps = spec.checkpoint.every
    return every * batch / samples_per_s if in_steps else every


def lost_work_h(spec: JobSpec, batch: int, samples_per_s: float,
                config: SchedulerConfig) -> float:
    """Hours of work a preemption can lose: none when the agents checkpoint on the notice
    (``config.checkpoint_on_notice``), else up to a checkpoint interval."""
    if config.checkpoint_on_notice:
        return 0.0
    return checkpoint_interval_s(spec, batch, samples_per_s) / 3600


def _location(pool_id: str, pools_by_id: Mapping[str, Pool]) -> tuple[str, str]:
    """(cloud, region) of a pool id (``cloud:region[/zone]:market:accelerator``), also of a
    pool the fleet no longer has."""
    if (pool := pools_by_id.get(pool_id)) is not None:
        return pool.cloud, pool.region
    cloud, region = pool_id.split(":")[:2]
    return cloud, region.split("/")[0]


def _checkpoint_location(job: JobRecord, pools_by_id: Mapping[str, Pool],
                         ) -> tuple[str, str] | tuple[None, None]:
    """Where a restore reads the job's checkpoint: the bucket's ``checkpoint.region`` when the
    spec names it, else the region of its last pool; nowhere before its first run."""
    if not job.pool or job.attempt == 0:
        return None, None
    bucket = _bucket(job.spec)
    return bucket if bucket[0] is not None else _location(job.pool, pools_by_id)


def _bucket(spec: JobSpec) -> tuple[str, str] | tuple[None, None]:
    """(cloud, region) of the bucket the spec names (``checkpoint.region``), else Nones."""
    if spec.checkpoint.region is None:
        return None, None
    cloud, region = spec.checkpoint.region.split(":")
    return cloud, region


def checkpoint_gb(job: JobRecord, config: SchedulerConfig) -> float:
    """The job's checkpoint size in GB (10^9 bytes, as egress is billed): what its agent
    measured for the last checkpoint, else the fleet-wide estimate ``config.checkpoint_gb``."""
    if job.checkpoint_bytes is not None:
        return job.checkpoint_bytes / 1e9
    return config.checkpoint_gb


def placement_request(job: JobRecord, choice: Choice, fallbacks: Sequence[int],
                      marks: Marks, pools_by_id: Mapping[str, Pool],
                      config: SchedulerConfig,
                      accelerator: Accelerator | None = None) -> PlacementRequest:
    """The job as placement sees it: its size and constraints, and what finishing it costs
    where: hours of work left at the chosen size (the scheduler's throughput estimate), the
    relaunch cost, the checkpoint interval, and its checkpoint's size (:func:`checkpoint_gb`),
    location (:func:`_checkpoint_location`; none before its first run) and, when the spec names
    the bucket's ``checkpoint.region``, the bucket every checkpoint is written to."""
    spec = job.spec
    rate = samples_per_sec(job, choice.gpus, choice.batch_size, accelerator)
    left = max(0, spec.work_samples - job.samples_done)
    where = _checkpoint_location(job, pools_by_id)
    bucket = _bucket(spec)
    return PlacementRequest(
        job.id, choice.gpus, fallbacks, job.pool if job.state is JobState.RUNNING else None,
        job.gpus if job.state is JobState.RUNNING else 0, spec.spot, spec.regions.allow,
        spec.regions.deny, marks.blocked, frozenset(marks.refused),
        remaining_h=left / rate / 3600, restart_h=config.restart_s / 3600,
        checkpoint_interval_h=lost_work_h(spec, choice.batch_size, rate, config),
        checkpoint_gb=checkpoint_gb(job, config) if where[0] or bucket[0] else 0.0,
        checkpoint_cloud=where[0], checkpoint_region=where[1],
        bucket_cloud=bucket[0], bucket_region=bucket[1])


def deadline_job(job: JobRecord, choice: Choice, pools_by_id: Mapping[str, Pool],
                 config: SchedulerConfig, now: float,
                 accelerator: Accelerator | None = None) -> DeadlineJob:
    """Where the job stands against its deadline for ``policies.spot.choose_market``.

    Hours of work are counted at ``choice`` (GPUs, batch), the job's requested size
    (:func:`requested_choice`: what it would get if placed, whatever this round allocates), at
    the scheduler's throughput estimate there (the agent's measurement where it has one, else the
    calibrated model): the total is ``work_samples`` at that rate, the progress the samples done
    at that rate (so the fraction done is exact; the hours are as good as the rate estimate).
    One preemption costs ``reaction_s``, ``restart_s`` and the work it loses
    (:func:`lost_work_h`). ``spot: never`` is ``must_not_preempt``."""
    spec = job.spec
    rate = samples_per_sec(job, choice.gpus, choice.batch_size, accelerator)
    total_h = spec.work_samples / rate / 3600
    progress_h = min(job.samples_done, spec.work_samples) / rate / 3600
    pool = pools_by_id.get(job.pool or "") if job.state is JobState.RUNNING else None
    return DeadlineJob(
        total_h=total_h, progress_h=progress_h, elapsed_h=max(0.0, now - job.submitted_at) / 3600,
        deadline_h=None if spec.deadline_s is None else spec.deadline_s / 3600,
        restart_h=preemption_h(config.reaction_s / 3600, config.restart_s / 3600,
                               lost_work_h(spec, choice.batch_size, rate, config),
                               total_h - progress_h),
        switch_h=config.restart_s / 3600, must_not_preempt=must_not_preempt(spec.spot),
        current=None if pool is None else pool.market)


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
    is there; one that finds no pool with room there is asked again (:func:`_second_market`):
    sent to spot, on-demand when behind its pace (:func:`_retry`), else it waits this round
    (holds no GPUs); sent to on-demand, spot (progress beats
    waiting; a running job keeps its spot pool), unless it must not be preempted: that one waits
    for on-demand room and says so. On the round's last try (``below_pace``) on-demand also
    takes the smaller sizes the job accepts: running beats idling behind pace. A job sent to
    on-demand first that finds no room anywhere is ``missed``: it gives its share back. Others
    use any market."""
    first = {r.job_id: paced[r.job_id].market for r in requests if r.job_id in paced}
    placed = place([_on(r, first.get(r.job_id)) for r in requests], pools, dict(used), risk,
                   config.egress, config.move_margin)
    missed = [r for r in requests if r.job_id in first and placed[r.job_id] is None]
    second = {r.job_id: _second_market(first[r.job_id], paced[r.job_id].view) for r in missed}
    retry = [_retry(r, m, paced[r.job_id], below_pace) for r in missed
             if (m := second[r.job_id]) is not None]
    if retry:
        placed.update(place(retry, pools, _held(used, placed), risk, config.egress,
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
    return _on(req, market)


def _second_market(first: Market | None, view: DeadlineJob) -> Market | None:
    """The market a deadline job tries when ``first`` had no room for it (``None``: none)."""
    if first is Market.SPOT:
        return choose_market(view, spot_available=False)
    return None if view.must_not_preempt else Market.SPOT


def _held(used: Mapping[str, int], placed: Mapping[str, PlacementResult | None],
          ) -> dict[str, int]:
    """GPUs held per pool: ``used`` plus the ``placed`` jobs'."""
    held = defaultdict(int, used)
    for got in placed.values():
        if got is not None:
            held[got.pool] += got.gpus
    return held


def _on(req: PlacementRequest, market: Market | None) -> PlacementRequest:
    """The request narrowed to ``market`` (``None``: as it is)."""
    return req if market is None else replace(req, markets=frozenset({market}))


def pool_risk(pools: Sequence[Pool], priors: Mapping[str, float], stats: PoolStats,
              jobs: Sequence[JobRecord], now: float) -> dict[str, PoolRisk]:
    """Each pool's preemption prior and what the broker saw there: the preemptions counted,
    and node-hours of the closed placement intervals plus those of the jobs running now."""
    hours = dict(stats.node_hours)
    for job in jobs:
        if job.state in (JobState.RUNNING, JobState.SUSPENDING) and job.pool and job.launched_at:
            held = max(0.0, now - job.launched_at) / 3600 * max(1, job.nodes)
            hours[job.pool] = hours.get(job.pool, 0.0) + held
    return {p.id: PoolRisk(prior_monthly_rate=priors.get(p.id, 0.0),
                           preemptions_seen=stats.preemptions.get(p.id, 0),
                           node_hours_seen=hours.get(p.id, 0.0)) for p in pools}


def plan_round(snap: Snapshot, fence: int, config: SchedulerConfig,
               now: float | None = None, *, blocklist: Blocklist | None = None,
               priors: Mapping[str, float] | None = None,
               stats: PoolStats | None = None) -> RoundResult:
    """Decide the round's changes from one snapshot; pure apart from reading the clock. Each
    job waiting for GPUs gets one of the accelerator types its spec accepts (:func:`_types`),
    then each type's allocation and placement run on its pools (:func:`_plan_type`). Jobs
    are not placed in spot locations ``blocklist`` holds while other pools have room, nor ever in
    pools it marks refused (they may stay where they run: :class:`Marks`); pools
    are ranked by expected cost with ``priors`` (monthly reclaim rate per pool id; none: 0)
    and the preemptions and node-hours ``stats`` the broker observed."""
    now = time.time() if now is None else now
    res = RoundResult(plan=Plan(wake=False))
    pools_by_id = {p.id: p for p in snap.pools}
    marks = Marks(blocked_pools(snap.pools, blocklist, now),
                  refused_pools(snap.pools, blocklist, now))
    risk = pool_risk(snap.pools, priors or {}, stats or PoolStats(), snap.jobs, now)
    used: dict[str, int] = defaultdict(int)  # GPUs held by jobs this round does not move
    offered: dict[str, list[Accelerator]] = {}
    jobs: list[JobRecord] = []
    usable = _Usable(snap.pools)

    for job in snap.jobs:
        if job.state in (JobState.LAUNCHING, JobState.SUSPENDING):
            if job.pool:
                used[job.pool] += job.gpus
            continue
        if job.cancel_requested:
            if job.state is JobState.RUNNING:
                _stop(res, job, fence, IntentKind.STOP, "cancelled by user")
            continue
        types = _offered(job, usable)
        if not types:
            if job.state is JobState.QUEUED:
                _no_pool(res, job, _no_region(job, snap.pools), config)
            continue
        offered[job.id] = types
        jobs.append(job)

    pools_of: dict[Accelerator, list[Pool]] = defaultdict(list)
    for p in snap.pools:
        pools_of[p.accelerator].append(p)
    room = {p.id: max(0, p.capacity - used.get(p.id, 0)) for p in snap.pools}
    # Running jobs first so the allocator's tie-break favours keeping them.
    jobs.sort(key=lambda j: (j.state is not JobState.RUNNING, -j.spec.priority, j.submitted_at,
                             j.id))
    choices = {(j.id, a): _type_choices(j, a, usable(j.spec), room, config)
               for j in jobs for a in offered[j.id]}
    by_accel: dict[Accelerator, list[JobRecord]] = defaultdict(list)
    types = _types(jobs, offered, choices, pools_of, room)
    for job in jobs:
        by_accel[types.get(job.id, offered[job.id][0])].append(job)
    for accel, group in by_accel.items():
        _plan_type(res, accel, group, {j.id: choices[j.id, accel] for j in group},
                   pools_of[accel], pools_by_id, used, risk, marks, config, fence, now)
    return res


def _type_choices(job: JobRecord, accel: Accelerator, pools: Sequence[Pool],
                  room: Mapping[str, int], config: SchedulerConfig) -> list[Choice]:
    """The job's choices on ``accel``: GPU counts one of ``pools`` (those the job may use) of
    that type can host
    (its room this round, a running job's own GPUs counted free) and launch (a cloud's instance
    sizes: an 8-GPU instance type does not make 2 GPUs launchable), each valued as the speed-up
    over one GPU of the slowest type the job accepts, so values compare across types. Where no
    pool has room for any size, the sizes its pools hold at all (placement then says why the job
    waits)."""
    mine = [p for p in pools if p.accelerator is accel]
    top = max((p.capacity for p in mine), default=0)
    if not top:
        return []
    fixed = config.policy is not Policy.ELASTIC or job.spec.batch_mode.value == "fixed"
    base = min((x for a in job.spec.accelerators if (x := one_gpu_rate(job, a, fixed)) > 0),
               default=None)
    opts = job_choices(job, config.policy, top, accel, base)
    roomy = [c for c in opts
             if any(p.launchable(c.gpus) and room.get(p.id, 0) >= c.gpus for p in mine)]
    # no room anywhere now: sizes a pool holds at all, so placement can say why it waits
    return roomy or [c for c in opts if any(p.launchable(c.gpus) for p in mine)]


def _types(jobs: Sequence[JobRecord], offered: Mapping[str, list[Accelerator]],
           choices: Mapping[tuple[str, Accelerator], list[Choice]],
           pools_of: Mapping[Accelerator, list[Pool]],
           room: Mapping[str, int]) -> dict[str, Accelerator]:
    """One accelerator type per job that accepts several (``policies.choices.assign_types``: a
    Lagrangian split of the types' GPUs, scored exactly with the allocator); a running job stays
    on its type, and a job with one offered type takes it."""
    multi = [j for j in jobs if len(offered[j.id]) > 1]
    if not multi:
        return {}
    capacity = {a: sum(room.get(p.id, 0) for p in ps) for a, ps in pools_of.items()}
    cands = {j.id: {a: JobChoices(j.id, choices[j.id, a]) for a in offered[j.id]}
             for j in jobs}
    return assign_types(cands, {a: c for a, c in capacity.items()
                                if any(a in offered[j.id] for j in jobs)})


def _plan_type(res: RoundResult, accel: Accelerator, jobs: list[JobRecord],
               choices: dict[str, list[Choice]], pools: list[Pool],
               pools_by_id: dict[str, Pool], used: Mapping[str, int],
               risk: Mapping[str, PoolRisk], marks: Marks, config: SchedulerConfig, fence: int,
               now: float) -> None:
    """One accelerator type's allocation, placement and diff against what runs."""
    capacity = max(0, sum(p.capacity - used.get(p.id, 0) for p in pools))
    counts = None if any(p.gpu_counts is None for p in pools) else {
        g for p in pools for g in p.gpu_counts or ()}
    unfit = [j for j in jobs if counts is not None and j.state is JobState.QUEUED
             and not any(j.spec.gpus.min <= n <= j.spec.gpus.max for n in counts)]
    for j in unfit:
        _unlaunchable(res, j, accel, sorted(counts or ()), config)
    never = [j for j in jobs if j.state is JobState.QUEUED and j not in unfit
             and must_not_preempt(j.spec.spot) and not _on_demand_launches(j, pools)]
    for j in never:
        g = j.spec.gpus
        _unlaunchable(res, j, accel, [], config, reason=(
            f"spot: never runs on on-demand only, and no on-demand {accel.value} pool in its "
            f"regions launches {g.min}-{g.max} GPUs; allow spot, or widen gpus or regions"))
    unfit += never
    if config.admission is Admission.DROP:  # dropped now: one change per job and plan
        jobs = [j for j in jobs if j not in unfit]
    placed = _allocate_and_place(res, jobs, choices, capacity, pools, pools_by_id, used,
                                 risk, marks, config, now, accel)
    placed = _repair(res, jobs, choices, placed, pools, pools_by_id, used, risk, marks, config,
                     now, accel)
    # GPUs free right now: running jobs hold theirs until they have checkpointed, so a
    # launch into GPUs a resizing job still holds waits for a later round.
    free_now = {p.id: p.capacity - used.get(p.id, 0) for p in pools}
    for job in jobs:
        if job.state is JobState.RUNNING and job.pool in free_now:
            free_now[job.pool] -= job.gpus
    for job in jobs:
        where = placed.where.get(job.id)
        target = None
        if where is not None:
            batch = next(x.batch_size for x in choices[job.id] if x.gpus == where.gpus)
            target = (where.pool, where.gpus, batch)
            if job.state is not JobState.RUNNING:
                if free_now[where.pool] < where.gpus:
                    continue  # deferred, not dropped: it waits for the GPUs to free up
                free_now[where.pool] -= where.gpus
        if job.id in placed.waits:
            _wait_for_spot(res, job, fence)
            continue
        if target is None and job.state is not JobState.RUNNING and \
                job.id in placed.notes and not _dropped_if_left_out(job, config):
            _note(res, job, "waiting", placed.notes[job.id])
        _diff(res, job, target, fence, config, pools_by_id)


def _repair(res: RoundResult, jobs: list[JobRecord], choices: dict[str, list[Choice]],
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
        held = _held(used, placed.where)
        room = {p.id: max(0, p.capacity - held.get(p.id, 0)) for p in pools}
        hosts = functools.cache(lambda g, room=room: any(
            room[p.id] >= g and p.launchable(g) for p in pools))
        again = {j.id: [c for c in choices[j.id] if hosts(c.gpus)] for j in left}
        if not any(again.values()):
            break
        more = _allocate_and_place(res, left, again, sum(room.values()), pools, pools_by_id,
                                   held, risk, marks, config, now, accel)
        got = {k: v for k, v in more.where.items() if v is not None}
        if not got:
            break
        placed.where.update(got)
        placed.waits |= more.waits
        for k in got:
            placed.notes.pop(k, None)
    return placed


def _allocate_and_place(res: RoundResult, jobs: list[JobRecord],
                        choices: dict[str, list[Choice]], capacity: int, pools: list[Pool],
                        pools_by_id: dict[str, Pool], used: Mapping[str, int],
                        risk: Mapping[str, PoolRisk], marks: Marks,
                        config: SchedulerConfig, now: float,
                        accel: Accelerator | None = None) -> Placed:
    """One accelerator's allocation and placement; the deadline jobs that wait for spot or
    found no room in any market they may use (see :func:`place_by_deadline`) give their share
    back: the others are allocated and placed again without them, and those sent to on-demand
    on a second try that found no room there are allocated on on-demand (:func:`_paced_choices`).
    A deadline job is judged at its requested size (:func:`requested_choice`)."""
    room = {p.id: p.capacity - used.get(p.id, 0) for p in pools}
    paced = {}
    for job in (j for j in jobs if j.spec.deadline_s is not None):
        if (c := requested_choice(job, choices[job.id], pools, marks)) is not None:
            paced[job.id] = Paced.of(c, deadline_job(job, c, pools_by_id, config, now, accel),
                                     on_demand_choices(job, choices[job.id], c, pools, marks,
                                                       room, accel))
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
                                              accel))
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
    (:func:`_second_market`): on-demand when behind its pace (``paced`` is updated), else it
    waits for spot (added to ``waiting``, it holds nothing). Then every other job shares what
    is left, each deadline job at the sizes its market allows (:func:`_paced_choices`).
    Allocated over every pool of the type at once, spot jobs would be sized for GPUs only
    on-demand has, and the overflow would land there."""
    on_spot = [j for j in jobs if (p := paced.get(j.id)) is not None and p.market is Market.SPOT]
    chosen: dict[str, Choice | None] = {}
    if on_spot:
        # the others' running spot jobs keep their GPUs: they are not the spot jobs' to share
        kept = sum(j.gpus for j in jobs if j not in on_spot and j.state is JobState.RUNNING
                   and (p := pools_by_id.get(j.pool or "")) is not None
                   and p.market is Market.SPOT)
        allowed, required = _paced_choices(on_spot, choices, paced, pools_by_id, accel)
        chosen = _allocate(on_spot, allowed, max(0, min(capacity, spot_room - kept)),
                           pools_by_id, config, now, required)
        for job in on_spot:
            if chosen.get(job.id) is not None:
                continue
            market = _second_market(Market.SPOT, paced[job.id].view)
            if market is None:
                waiting.add(job.id)
            else:
                paced[job.id] = replace(paced[job.id], market=market)
    taken = sum(c.gpus for c in chosen.values() if c is not None)
    rest = [j for j in jobs if chosen.get(j.id) is None and j.id not in waiting]
    allowed, required = _paced_choices(rest, choices, paced, pools_by_id, accel)
    chosen.update(_allocate(rest, allowed, max(0, capacity - taken), pools_by_id, config, now,
                            required))
    return chosen


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
                      accelerator: Accelerator | None = None) -> list[Choice]:
    """The sizes a deadline job takes on on-demand, largest first: the smallest that keeps its
    pace (as fast as at ``requested``, the size its pace is judged at) and fits an on-demand
    pool's ``room`` this round (pool id -> GPUs not held by jobs the round does not move): on
    on-demand a job buys its pace and no more, which costs fewer on-demand hours and banks no
    slack that would send it back to spot at once; where none fits, every size from the largest
    one on-demand pool it may use holds (:func:`requested_choice` on that market) down to its
    smallest: running beats idling behind pace."""
    top = requested_choice(job, opts, pools, marks, Market.ON_DEMAND)
    if top is None:
        return []
    sizes = sorted((c for c in opts if c.gpus <= top.gpus), key=lambda c: -c.gpus)
    pace = samples_per_sec(job, requested.gpus, requested.batch_size, accelerator)
    on_pace = [c for c in sizes
               if samples_per_sec(job, c.gpus, c.batch_size, accelerator) >= pace]
    fits = requested_choice(job, on_pace, pools, marks, Market.ON_DEMAND, room)
    return [min(on_pace, key=lambda c: c.gpus)] if fits else sizes


def _paced_choices(jobs: Sequence[JobRecord], choices: Mapping[str, list[Choice]],
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


def _refusal_notes(requests: Sequence[PlacementRequest], placed: Placed, pools: Sequence[Pool],
                   used: Mapping[str, int], risk: Mapping[str, PoolRisk], marks: Marks,
                   config: SchedulerConfig) -> dict[str, str]:
    """Why the jobs left out are: those that the room left would take, were it not for a
    refusal mark, are told which pool refused and until when (job id -> reason)."""
    left = [replace(r, refused=frozenset()) for r in requests
            if placed.where.get(r.job_id) is None and r.job_id not in placed.waits]
    if not left or not marks.refused:
        return {}
    held = _held(used, placed.where)
    would = place(left, pools, held, risk, config.egress, config.move_margin)
    return {k: marks.refused[got.pool] for k, got in would.items()
            if got is not None and got.pool in marks.refused}


def _allocate(jobs: list[JobRecord], choices: dict[str, list[Choice]], capacity: int,
              pools_by_id: dict[str, Pool], config: SchedulerConfig,
              now: float, required: Collection[str] = ()) -> dict[str, Choice | None]:
    """Run the allocator with running jobs' current config favoured (``stickiness``) and, for
    jobs started less than ``min_rescale_interval_s`` ago (or under the static policy) and jobs
    that must not be preempted (``spot: never``: no suspension or rescale to rebalance), pinned;
    so are the ``required`` jobs to one of their choices (:func:`_paced_choices`). Under
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
                bonus = 1.0 + config.stickiness
                opts = [Choice(c.gpus, c.batch_size, c.value * bonus) if c in cur else c
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


def _nodes(pool: Pool | None, gpus: int) -> int:
    """Nodes of a launch of ``gpus`` GPUs in ``pool`` (``Pool.shape``; one where unknown)."""
    shape = pool.shape(gpus) if pool is not None else None
    return shape[0] if shape else 1


def _diff(res: RoundResult, job: JobRecord, target: tuple[str, int, int] | None, fence: int,
          config: SchedulerConfig, pools_by_id: Mapping[str, Pool]) -> None:
    if job.state is JobState.RUNNING:
        if target is None:
            _stop(res, job, fence, IntentKind.SUSPEND, "allocator gave its GPUs to other jobs")
        elif target[0] != job.pool:
            _stop(res, job, fence, IntentKind.MIGRATE, f"moving to {target[0]}", target)
        elif target[1:] != (job.gpus, job.batch_size):
            _stop(res, job, fence, IntentKind.RESIZE,
                  f"resize to {target[1]} GPUs, batch {target[2]}", target)
        return
    if target is None:
        if _dropped_if_left_out(job, config):
            _drop(res, job, "admission control: no room when it arrived")
        return
    pool, gpus, batch = target
    attempt = job.attempt + 1
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=fence, attempt=attempt,
                    gpus=gpus, batch_size=batch, pool=pool)
    relaunch = job.attempt > 0 and job.pool is not None
    moved = relaunch and pool != job.pool
    resized = relaunch and not moved and (gpus, batch) != (job.gpus, job.batch_size)
    res.plan.change(job, JobState.LAUNCHING, event_data={"pool": pool, "gpus": gpus,
                                                         "batch_size": batch},
                    attempt=attempt, launch_key=intent.key, gpus=gpus, batch_size=batch,
                    pool=pool, fence=fence, node_ids=[], exit_code=None, round=0,
                    stand_ins={}, replaced_at=None,
                    # known before any node boots: the rendezvous answers with it at once
                    nodes=_nodes(pools_by_id.get(pool), gpus),
                    migrations=job.migrations + moved, rescales=job.rescales + resized,
                    reason="placed" if not relaunch else "resumed from checkpoint")
    res.plan.add_intent(intent)
    res.launches += 1
    res.migrations += moved
    res.resizes += resized
    res.changed.append(job.id)


def _dropped_if_left_out(job: JobRecord, config: SchedulerConfig) -> bool:
    """Does a job the round gives no GPUs get dropped (admission drop, in the round it
    arrives)? Then it gets no 'waiting' note first: one change per job and plan."""
    return config.admission is Admission.DROP and job.state is JobState.QUEUED


def _stop(res: RoundResult, job: JobRecord, fence: int, kind: IntentKind, reason: str,
          target: tuple[str, int, int] | None = None) -> None:
    pool, gpus, batch = target or (None, 0, None)
    intent = Intent(kind=kind, job_id=job.id, fence=fence, attempt=job.attempt, gpus=gpus,
                    batch_size=batch, pool=pool, reason=reason)
    res.plan.change(job, JobState.SUSPENDING, event=kind.value, event_data={"reason": reason},
                    reason=reason, fence=fence)
    res.plan.add_intent(intent)
    res.changed.append(job.id)
    if kind is IntentKind.STOP:
        res.stops += 1
    else:
        res.suspends += 1


WAIT_FOR_SPOT = ("waiting for spot: ahead of its deadline's pace, so no on-demand yet (it takes "
                 "on-demand once behind that pace)")


def _wait_for_spot(res: RoundResult, job: JobRecord, fence: int) -> None:
    """A deadline job the market rule keeps off GPUs this round: a running one checkpoints and
    waits; a waiting one says why (once) instead of staying queued without a word."""
    if job.state is JobState.RUNNING:
        _stop(res, job, fence, IntentKind.SUSPEND, WAIT_FOR_SPOT)
    else:
        _note(res, job, "waiting-for-spot", WAIT_FOR_SPOT)


def _note(res: RoundResult, job: JobRecord, event: str, reason: str) -> None:
    """Say on a job why it gets no GPUs (an ``event`` with the reason), once: a round that
    finds the same reason changes nothing."""
    if job.reason != reason:
        res.plan.change(job, event=event, event_data={"reason": reason}, reason=reason)
        res.changed.append(job.id)


def _unlaunchable(res: RoundResult, job: JobRecord, accel: Accelerator, sizes: list[int],
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
        _note(res, job, "unlaunchable", reason)


def _no_pool(res: RoundResult, job: JobRecord, region_reason: str | None,
             config: SchedulerConfig) -> None:
    """No pool offers a queued job's accelerators in its regions: with a reason from its region
    filters, say so on the job (once) or drop it under admission drop, as
    :func:`_unlaunchable` does; without one (no pool offers them at all) only admission drop
    acts, as a cloud may add such pools."""
    if config.admission is Admission.DROP:
        _drop(res, job, region_reason or "no pool offers its accelerators")
    elif region_reason is not None:
        _note(res, job, "no-region", region_reason)


def _on_demand_launches(job: JobRecord, pools: Sequence[Pool]) -> bool:
    """Does an on-demand pool in the job's regions launch a GPU count it accepts?"""
    g, r = job.spec.gpus, job.spec.regions
    return any(p.market is Market.ON_DEMAND and region_allowed(p, r.allow, r.deny) and
               any(p.launchable(n) for n in range(g.min, min(g.max, p.capacity) + 1))
               for p in pools)


def _drop(res: RoundResult, job: JobRecord, reason: str) -> None:
    res.plan.change(job, JobState.DROPPED, reason=reason)
    res.dropped += 1
    res.changed.append(job.id)


class Scheduler:
    """Runs rounds against the store under a fencing token. ``priors`` gives each pool's
    monthly reclaim rate (``FleetProvider.interruption_priors``; without it, 0 everywhere)."""

    def __init__(self, store: Store, config: SchedulerConfig | None = None,
                 priors: Callable[[Sequence[Pool]], Mapping[str, float]] | None = None,
                 blocklist_decay_s: float | None = None) -> None:
        self.store = store
        self.config = config or SchedulerConfig()
        self.priors = priors
        self.blocklist_decay_s = blocklist_decay_s  # None: what the stored blocklist says

    def run_round(self, fence: int) -> RoundResult:
        """Snapshot, plan, apply atomically. A conflict (a job changed meanwhile) leaves
        everything as it was; the next round re-plans from fresh state."""
        snap = self.store.snapshot()
        blocklist, _ = self.store.blocklist(self.blocklist_decay_s)
        res = plan_round(snap, fence, self.config, blocklist=blocklist,
                         priors=self.priors(snap.pools) if self.priors else None,
                         stats=self.store.pool_stats())
        if not res.plan.empty():
            self.store.apply(res.plan, fence=fence)
        return res
