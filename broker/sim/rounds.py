"""The simulation's rounds on pools: spot and on-demand pools, availability traces, preemptions,
cost; a classic cluster (``t4:16x4``: one on-demand pool per type, no trace, price 0) is one more
case of the same loop.

Every round (Pollux's conventions, physics in ``engine.py``): running jobs advance and pay for the
GPUs they hold; then pools whose trace dropped below what runs there evict jobs (the most recently
placed first); then the policy decides. What every policy shares is :class:`SpotRounds`: the
virtual clock, progress and cost, periodic checkpoints, evictions, starts and stops.

- ``fleet`` is FleetBroker itself: ``broker.sim.driver`` runs the live broker's scheduling round
  (``broker.scheduler.plan_round``) on the virtual clock and carries out its plans as the
  actuator and reconciler do; no scheduling decision is made here. The classic simulation's
  ``elastic``, ``fixed-batch`` and ``static`` policies are the live round's
  (``broker.scheduler.Policy``), run the same way on the classic cluster's pools.

The others are baselines, for comparison only (``broker.sim.baselines``): on spot clusters
``ondemand``, ``skypilot-failover`` and ``skypilot-eager``; on classic clusters Tiresias.

A job checkpoints every ``checkpoint_s`` seconds of progress, and before every move the broker makes
itself (rescale, market switch, suspension, move to another pool), so only preemptions lose work:
the work since the last checkpoint, or nothing with ``checkpoint_on_notice``. Cost is the GPU time
held (restarts included) times the pool's price; ``ondemand_cost_usd`` prices the same GPU time at
each pool's on-demand reference price (``SimPool.ondemand_price``). A job misses its deadline when
it completes later than ``deadline`` seconds after its submission, or not at all. A migration is
a start in another region than the one the job last ran in, whatever moved it.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from broker.costs import ondemand_reference
from broker.scheduler import Admission, Policy
from broker.sim.cluster import ClusterError, PoolSpec, catalog_price, catalog_prior
from broker.sim.engine import (
    Assignment,
    Baseline,
    SimConfig,
    SimJob,
    SimResult,
    SimState,
    SimulationError,
    advance,
    make_job,
)
from broker.sim.traces import SpotTrace
from broker.sim.workload import WorkloadJob
from policies.migration import DEFAULT_DECAY_S
from policies.models import Market, Pool

DEFAULT_CHECKPOINT_S = 100.0  # the job spec's default (policies.models.CheckpointSpec)


class MarketPolicy(StrEnum):
    """How markets and regions are used (``--spot-policy``); see the module docstring."""

    ONDEMAND = "ondemand"
    FAILOVER = "skypilot-failover"
    EAGER = "skypilot-eager"
    FLEET = "fleet"


@dataclass(frozen=True)
class SimPool:
    """A pool with its availability trace and the prices cost is counted at."""

    pool: Pool
    trace: SpotTrace | None = None
    ondemand_price: float = 0.0  # USD per GPU-hour of the same GPUs on on-demand
    # Spot Advisor monthly reclaim fraction, the live round's prior (None: it has none)
    prior: float | None = None

    @property
    def region(self) -> str:
        return f"{self.pool.cloud}:{self.pool.region}"

    def gpus_at(self, t: float) -> int:
        nodes = self.pool.nodes if self.trace is None else min(self.pool.nodes, self.trace.at(t))
        return nodes * self.pool.gpus_per_node


def sim_pools(specs: Sequence[PoolSpec]) -> list[SimPool]:
    """Resolve prices: a pool without ``price_per_gpu_hour`` takes the catalog's; the on-demand
    reference of a pool is the broker's (``broker.costs.ondemand_reference``: the cheapest
    on-demand pool of the accelerator in the cluster, else the catalog's on-demand price)."""
    priced = []
    for s in specs:
        pool = s.pool
        if not s.priced:
            price = catalog_price(pool, pool.market)
            if price is None:
                raise ClusterError(
                    f"{s.where}: no catalog price for {pool.gpus_per_node}x "
                    f"{pool.accelerator.value} on {pool.market.value} in {pool.cloud} "
                    f"{pool.region}; add price_per_gpu_hour to the pool")
            pool = pool.model_copy(update={"price_per_gpu_hour": price})
        priced.append((s, pool))
    pools = [p for _, p in priced]
    out = []
    for s, pool in priced:
        ref = ondemand_reference(pool, pools)
        if ref is None:
            raise ClusterError(
                f"{s.where}: no on-demand reference price for this spot pool (ondemand_cost_usd "
                f"needs one); add an on-demand {pool.accelerator.value} pool to the cluster")
        out.append(SimPool(pool, s.trace, ref, catalog_prior(pool)))
    return out


def has_spot(specs: Sequence[PoolSpec]) -> bool:
    """Does the cluster have a spot or trace pool (``--spot-policy auto`` then runs fleet)?"""
    return any(s.pool.market is Market.SPOT or s.trace is not None for s in specs)


@dataclass(frozen=True)
class SpotConfig:
    """The rounds' settings beside ``SimConfig``: the market policy (``fleet`` is the live round),
    checkpoints, the blocklist's decay."""

    market: MarketPolicy = MarketPolicy.FLEET
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    # FleetBroker's agent checkpoints when the cloud announces a preemption (AWS 2 min, GCP and
    # Azure 30 s ahead), so a preemption loses no work; SkyPilot's managed-jobs controller finds
    # preemptions by polling (every 15 s) and loses the work since the last periodic checkpoint.
    checkpoint_on_notice: bool = False
    blocklist_decay_s: float = DEFAULT_DECAY_S

    def __post_init__(self) -> None:
        if not self.checkpoint_s > 0:
            raise SimulationError(f"checkpoint interval must be positive, got "
                                  f"{self.checkpoint_s}")


@dataclass
class SpotResult:
    """The per-job result plus costs (USD), GPU-hours by market and the spot counters."""

    result: SimResult
    cost_usd: float = 0.0
    ondemand_cost_usd: float = 0.0
    deadline_misses: int = 0
    missed: tuple[str, ...] = ()  # names of the jobs that missed their deadline
    migrations: int = 0  # relaunches in another region than the job last ran in, forced or chosen
    preemptions: int = 0
    lost_work_gpu_h: float = 0.0
    spot_gpu_h: float = 0.0
    ondemand_gpu_h: float = 0.0


@dataclass
class SpotJob:
    """One job of a simulation: its physics, restart countdown and record (``SimJob``), its
    deadline, the pool it runs in, and its last checkpoint."""

    sim: SimJob
    deadline: float | None
    pool: SimPool | None = None
    placed_at: float = 0.0
    checkpoint: float = 0.0  # progress at the last checkpoint
    since_checkpoint: float = 0.0  # seconds of progress since then
    last_region: str | None = None  # region of its last run (a start elsewhere is a migration)
    preempted_from: str | None = None  # region of the last preemption, until relaunched

    @property
    def state(self) -> SimState:
        return self.sim.state


class SpotRounds(abc.ABC):
    """The loop every simulation shares, classic or spot, live round or baseline: the virtual
    clock, running jobs advanced and paid for, periodic checkpoints, evictions where a trace
    drops, starts and stops. A subclass decides, once per round, in :meth:`_schedule`, using only
    ``markets``' pools."""

    def __init__(self, workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                 cfg: SimConfig, spot: SpotConfig, markets: Collection[Market]):
        self.cfg, self.spot = cfg, spot
        self.pools = sorted((p for p in pools if p.pool.market in markets),
                            key=lambda p: (p.pool.price_per_gpu_hour, p.pool.id))
        if not self.pools:
            need = " or ".join(sorted(m.value for m in markets))
            raise SimulationError(f"--spot-policy {spot.market.value} needs {need} pools; the "
                                  "cluster has none")
        self.rates: dict[tuple, float] = {}  # engine.advance's cache of the tables' answers
        self.jobs = [self._job(w) for w in sorted(workload, key=lambda w: (w.time, w.name))]
        self.out = SpotResult(SimResult([j.sim.record for j in self.jobs], 0.0, 0))

    def _job(self, w: WorkloadJob) -> SpotJob:
        return SpotJob(make_job(w, self.cfg), w.deadline)

    @abc.abstractmethod
    def _schedule(self, active: list[SpotJob], now: float) -> None:
        """One round's decisions for the jobs submitted and not completed by ``now``."""

    def run(self, on_round: Callable[[float, int], None] | None = None) -> SpotResult:
        """Run to the end (or ``cfg.max_hours``); ``on_round(now, jobs done or dropped)`` after
        every round."""
        cfg, jobs = self.cfg, self.jobs
        now, rounds, nxt = 0.0, 0, 0
        active: list[SpotJob] = []
        while (nxt < len(jobs) or active) and now < cfg.max_hours * 3600:
            for job in active:
                self._advance(job, now)
            now += cfg.interval
            rounds += 1
            active = [j for j in active if not self._gone(j)]
            if not active and nxt < len(jobs) and jobs[nxt].sim.record.submitted > now:
                now = math.ceil(jobs[nxt].sim.record.submitted / cfg.interval) * cfg.interval
            while nxt < len(jobs) and jobs[nxt].sim.record.submitted <= now:
                active.append(jobs[nxt])
                nxt += 1
            self._preempt(active, now)
            if active:
                t0 = time.perf_counter()
                self._schedule(active, now)
                self.out.result.solve_seconds.append(time.perf_counter() - t0)
            if on_round:
                on_round(now, sum(j.sim.record.completed is not None or j.sim.record.dropped
                                  for j in jobs))
        res = self.out
        res.result.end_time, res.result.rounds = now, rounds
        res.result.unfinished = sum(j.sim.record.completed is None and not j.sim.record.dropped
                                    for j in jobs)
        res.missed = tuple(j.sim.record.name for j in jobs if j.deadline is not None and (
            j.sim.record.jct is None or j.sim.record.jct > j.deadline))
        res.deadline_misses = len(res.missed)
        return res

    def _gone(self, job: SpotJob) -> bool:
        """Has the job left the simulation (completed or dropped)?"""
        return job.sim.record.completed is not None or job.sim.record.dropped

    def _advance(self, job: SpotJob, now: float) -> None:
        """Run the job for one round from ``now`` where it runs (restart first) and pay for the
        GPUs it holds; a checkpoint at the round's end once ``checkpoint_s`` of progress went
        by since the last."""
        a, pool = job.state.current, job.pool
        if a is None or pool is None:
            return
        held0, restart0 = job.sim.record.gpu_seconds, job.sim.restart_left
        advance(job.sim, now, self.cfg.interval, self.rates)
        gpu_h = (job.sim.record.gpu_seconds - held0) / 3600
        self.out.cost_usd += gpu_h * pool.pool.price_per_gpu_hour
        self.out.ondemand_cost_usd += gpu_h * pool.ondemand_price
        if pool.pool.market is Market.SPOT:
            self.out.spot_gpu_h += gpu_h
        else:
            self.out.ondemand_gpu_h += gpu_h
        if job.sim.record.completed is not None:
            job.pool = None
            return
        job.since_checkpoint += self.cfg.interval - (restart0 - job.sim.restart_left)
        if job.since_checkpoint >= self.spot.checkpoint_s:
            job.checkpoint, job.since_checkpoint = job.state.progress, 0.0

    def _preempt(self, active: list[SpotJob], now: float) -> None:
        """Evict jobs from pools whose availability fell below what runs there."""
        for p in self.pools:
            here = [j for j in active if j.pool is p]
            used = sum(j.state.current.gpus for j in here if j.state.current)
            cap = p.gpus_at(now)
            for j in sorted(here, key=lambda j: (j.placed_at, j.state.id), reverse=True):
                if used <= cap:
                    break
                used -= j.state.current.gpus if j.state.current else 0
                self._evict(j, now)

    def _evict(self, job: SpotJob, now: float) -> None:
        """The cloud took the job's GPUs: the work since its last checkpoint is lost (none with
        a checkpoint on the notice)."""
        a, pool = job.state.current, job.pool
        assert a is not None and pool is not None
        self.out.preemptions += 1
        if not self.spot.checkpoint_on_notice:
            self.out.lost_work_gpu_h += a.gpus * job.since_checkpoint / 3600
            job.state.progress = job.checkpoint
        job.checkpoint, job.since_checkpoint = job.state.progress, 0.0
        job.state.current, job.pool, job.sim.restart_left = None, None, 0.0
        job.last_region = job.preempted_from = pool.region

    def _stop(self, job: SpotJob) -> None:
        """A stop the broker asks for (rescale, move, suspension): checkpoint first, so nothing
        is lost."""
        assert job.pool is not None
        job.checkpoint, job.since_checkpoint = job.state.progress, 0.0
        job.last_region = job.pool.region
        job.state.current, job.pool, job.sim.restart_left = None, None, 0.0

    def _launch(self, job: SpotJob, a: Assignment, pool: SimPool, now: float) -> None:
        """Start the (stopped) job with ``a`` in ``pool``: it pays a restart before it makes
        progress; a start in another region than its last run is a migration."""
        if job.last_region is not None and pool.region != job.last_region:
            self.out.migrations += 1
        job.preempted_from = None
        job.sim.restart_left = job.state.restart_s
        if job.sim.started:
            job.sim.record.restarts += 1
        job.sim.started = True
        job.state.current, job.pool, job.placed_at = a, pool, now


def classic_pools(specs: Sequence[PoolSpec]) -> list[SimPool]:
    """A classic cluster's pools (no spot, no trace: ``has_spot`` is False): on-demand, at the
    price the cluster file gives, else 0 (the classic simulation reports no costs). Items that
    share a pool id (``t4:2x4,t4:3x4``: cloud and region ``sim``) are one pool of their nodes
    together, as one type's capacity."""
    pools: list[Pool] = []
    for s in specs:
        i = next((i for i, p in enumerate(pools) if p.id == s.pool.id
                  and p.gpus_per_node == s.pool.gpus_per_node), None)
        if i is None:
            pools.append(s.pool)
        else:
            pools[i] = pools[i].model_copy(update={"nodes": pools[i].nodes + s.pool.nodes})
    return [SimPool(p) for p in pools]


def simulate(workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
             cfg: SimConfig = SimConfig(),
             on_round: Callable[[float, int], None] | None = None) -> SimResult:
    """The classic simulation of one workload on ``pools`` (``classic_pools``); deterministic.
    ``elastic``, ``fixed-batch`` and ``static`` run the live round (``broker.sim.driver``, as
    ``fleet`` on spot clusters); ``tiresias`` is a baseline (``broker.sim.baselines``)."""
    # both modules build on this one
    from broker.sim.baselines import TiresiasRounds
    from broker.sim.driver import LiveRoundDriver

    rounds: SpotRounds
    if cfg.policy is Baseline.TIRESIAS:
        rounds = TiresiasRounds(workload, pools, cfg, SpotConfig(MarketPolicy.ONDEMAND))
    else:
        rounds = LiveRoundDriver(workload, pools, cfg, SpotConfig(MarketPolicy.FLEET))
    return rounds.run(on_round).result


def simulate_spot(workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                  cfg: SimConfig = SimConfig(), spot: SpotConfig = SpotConfig()) -> SpotResult:
    """Run one workload on spot/on-demand pools under ``spot.market``; deterministic. ``fleet``
    runs the live broker's round (``broker.sim.driver``) under any of its policies and
    admissions; the baselines (``broker.sim.baselines``) run the elastic allocators with jobs
    queued."""
    from broker.sim.baselines import MarketBaseline  # both modules build on this one
    from broker.sim.driver import LiveRoundDriver

    if spot.market is MarketPolicy.FLEET:
        if cfg.policy is Baseline.TIRESIAS:
            raise SimulationError("the spot simulation runs the live round's policies (elastic, "
                                  "fixed-batch, static) or its baselines, not tiresias")
        return LiveRoundDriver(workload, pools, cfg, spot).run()
    if cfg.policy not in (Policy.ELASTIC, Policy.FIXED_BATCH):
        raise SimulationError(f"the spot baselines run the elastic allocators (elastic, "
                              f"fixed-batch), not {cfg.policy.value}")
    if cfg.admission is not Admission.QUEUE:
        raise SimulationError("the spot baselines queue jobs (admission queue): preempted jobs "
                              "must be able to wait for capacity")
    return MarketBaseline(workload, pools, cfg, spot).run()
