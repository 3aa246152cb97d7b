"""What placement weighs for a job: the blocklist's marks on pools, each pool's preemption
risk, and the job's placement request (hours left, restart, checkpoint interval, size and
location)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from broker.models import JobRecord, JobState
from broker.scheduler.choices import samples_per_sec
from broker.scheduler.config import SchedulerConfig
from broker.store import PoolStats
from policies.elastic_dp import Choice
from policies.migration import Blocklist, location_keys
from policies.models import Accelerator, JobSpec, Market, Pool
from policies.placement import PlacementRequest, PlacementResult, PoolRisk
from policies.region_score import PRIOR_WEIGHT_H


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


def restarts_from_scratch(job: JobRecord) -> bool:
    """Is the job a plain script (its agent saw no progress through the runtime or a supported
    framework, and no DCP checkpoint its script committed)? A move, resize or preemption then
    restarts it from the beginning."""
    return job.resumable is False


def commits_own_checkpoints(job: JobRecord) -> bool:
    """Does the job resume from DCP checkpoints its script commits itself (its agent saw them,
    and when, without the runtime's progress)? It takes none at a stop, so a move, resize or
    preemption redoes the work since the newest."""
    return job.resumable is True and job.checkpoint_at is not None


def restart_s(job: JobRecord, config: SchedulerConfig, now: float) -> float:
    """What restarting the job costs, in seconds: a relaunch (``config.restart_s``: node start,
    setup, checkpoint restore) and the progress of its running attempt the restart loses: for
    a plain script (:func:`restarts_from_scratch`) all of it, which starts again from step 0;
    for a script that commits its own checkpoints (:func:`commits_own_checkpoints`) the work
    since the newest (since the attempt's launch when it resumed from one that old); none for
    a job on the runtime, which checkpoints at the stop."""
    if job.state is not JobState.RUNNING or not job.launched_at:
        return config.restart_s
    if restarts_from_scratch(job):
        since = job.launched_at
    elif commits_own_checkpoints(job):
        since = max(job.launched_at, job.checkpoint_at or 0.0)
    else:
        return config.restart_s
    return config.restart_s + max(0.0, now - since)


def lost_work_h(job: JobRecord, batch: int, samples_per_s: float,
                config: SchedulerConfig) -> float:
    """Hours of work a preemption can lose beyond its restart: none when the agents checkpoint
    on the notice (``config.checkpoint_on_notice``), else up to a checkpoint interval; for a
    plain script the work lost is its whole attempt, and for one that commits its own
    checkpoints the work since the newest (the spec's interval is the runtime's, which such a
    script does not follow), both priced in :func:`restart_s`."""
    if config.checkpoint_on_notice or restarts_from_scratch(job) or \
            commits_own_checkpoints(job):
        return 0.0
    return checkpoint_interval_s(job.spec, batch, samples_per_s) / 3600


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
                      accelerator: Accelerator | None = None,
                      now: float | None = None) -> PlacementRequest:
    """The job as placement sees it: its size and constraints, and what finishing it costs
    where: hours of work left at the chosen size (the scheduler's throughput estimate), the
    restart cost at ``now`` (:func:`restart_s`; default: the clock), the checkpoint interval,
    and its checkpoint's size (:func:`checkpoint_gb`),
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
        remaining_h=left / rate / 3600,
        restart_h=restart_s(job, config, time.time() if now is None else now) / 3600,
        checkpoint_interval_h=lost_work_h(job, choice.batch_size, rate, config),
        checkpoint_gb=checkpoint_gb(job, config) if where[0] or bucket[0] else 0.0,
        checkpoint_cloud=where[0], checkpoint_region=where[1],
        bucket_cloud=bucket[0], bucket_region=bucket[1])


def pool_risk(pools: Sequence[Pool], priors: Mapping[str, float] | None, stats: PoolStats,
              jobs: Sequence[JobRecord], now: float, prior_weight_h: float = PRIOR_WEIGHT_H,
              unknown_rate: float = 0.0) -> dict[str, PoolRisk]:
    """Each pool's preemption prior (weighted as ``prior_weight_h`` node-hours; a pool
    ``priors`` has no figure for takes ``unknown_rate``, and without ``priors`` every pool
    0) and what the broker saw there: the preemptions counted, and node-hours of the closed
    placement intervals plus those of the jobs running now."""
    hours = dict(stats.node_hours)
    for job in jobs:
        if job.state in (JobState.RUNNING, JobState.SUSPENDING) and job.pool and job.launched_at:
            held = max(0.0, now - job.launched_at) / 3600 * max(1, job.nodes)
            hours[job.pool] = hours.get(job.pool, 0.0) + held
    return {p.id: PoolRisk(prior_monthly_rate=0.0 if priors is None else
                           priors.get(p.id, unknown_rate),
                           preemptions_seen=stats.preemptions.get(p.id, 0),
                           node_hours_seen=hours.get(p.id, 0.0),
                           prior_weight_h=prior_weight_h) for p in pools}


def held_gpus(used: Mapping[str, int], placed: Mapping[str, PlacementResult | None],
          ) -> dict[str, int]:
    """GPUs held per pool: ``used`` plus the ``placed`` jobs'."""
    held = defaultdict(int, used)
    for got in placed.values():
        if got is not None:
            held[got.pool] += got.gpus
    return held


def on_market(req: PlacementRequest, market: Market | None) -> PlacementRequest:
    """The request narrowed to ``market`` (``None``: as it is)."""
    return req if market is None else replace(req, markets=frozenset({market}))
