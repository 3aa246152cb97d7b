"""Multi-region spot simulation: spot and on-demand pools, availability traces, preemptions, cost.

Every round (Pollux's conventions, as ``engine.py``): running jobs advance and pay for the GPUs they
hold; then pools whose trace dropped below what runs there evict jobs (the most recently placed
first); then the market policy picks each job's market, the same elastic allocator
(``policies.schedulers``, each count capped at the largest pool's free GPUs) shares each
(type, market)'s available GPUs, and a placement step puts each job's whole gang in ONE pool (one
region); jobs that fragmentation leaves out are re-allocated over what is left. Running jobs keep
their pool while it holds their new size; the others are placed, largest gang first:

- ``ondemand``: on-demand pools only, cheapest first.
- ``skypilot-failover``: spot only, cheapest first; a preempted job is relaunched in the region it
  was preempted from first, then anywhere, cheapest first (SkyPilot's FAILOVER).
- ``skypilot-eager``: spot only; a preempted job tries the other regions first in price order and
  its own region last (SkyPilot's EAGER_NEXT_REGION). Neither looks at deadlines.
- ``fleet``: per job, Can't Be Late's market rule (``policies.spot.choose_market``), where "spot
  is available" means the allocator found the job spot GPUs this round; its pace is the job's
  work at its requested GPUs and batch, and its safety slack covers what one preemption costs (a
  round, a restart, the work since the last checkpoint). Pools are ranked by
  ``policies.region_score`` (price, observed preemption rate, the move's restart, stickiness)
  without the locations SpotHedge's blocklist (``policies.migration``) marks as recently
  preempted; running jobs move into room left in cheaper pools when the saving beats the
  stickiness margin. The on-demand fallback runs a job at the GPU count its pace refers to. On
  spot, a job close to the safety net (``policies.spot.holds_pace``) gets only configurations at
  least as fast as its pace, and keeps its size while that size still keeps pace: a round below
  pace or a rescale's restart would send it to on-demand for good.

A job checkpoints every ``checkpoint_s`` seconds of progress, and before every move the broker makes
itself (rescale, market switch, suspension, move to a cheaper pool), so only preemptions lose work:
the work since the last checkpoint, or nothing with ``checkpoint_on_notice``. Cost is the GPU time
held (restarts included) times the pool's price; ``ondemand_cost_usd`` prices the same GPU time at
each pool's on-demand reference price (``SimPool.ondemand_price``). A job misses its deadline when
it completes later than ``deadline`` seconds after its submission, or not at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from broker.costs import ondemand_reference
from broker.sim.cluster import (
    ClusterError,
    PoolSpec,
    catalog_price,
    catalog_prior,
    fleet_capacity,
)
from broker.sim.engine import SimConfig, SimJob, SimResult, SimulationError, advance, make_job
from broker.sim.traces import SpotTrace
from broker.sim.workload import WorkloadJob
from policies.choices import ChoiceTables, ConfigTable, TypeCapacity, placement_for
from policies.migration import (
    DEFAULT_DECAY_S,
    Blocklist,
    location_keys,
    mark_launched,
    mark_preempted,
    register,
)
from policies.models import Accelerator, Market, Pool
from policies.region_score import Candidate, JobNeeds, choose
from policies.schedulers import (
    Admission,
    Assignment,
    ElasticPolicy,
    JobState,
    PolicyName,
)
from policies.spot import DeadlineJob, choose_market, holds_pace, preemption_h
from providers.catalog import UNKNOWN_RATE

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
    prior: float = UNKNOWN_RATE  # Spot Advisor monthly reclaim fraction (fleet's hazard prior)

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
    """The spot simulation's own settings (the allocator's are ``SimConfig``)."""

    market: MarketPolicy = MarketPolicy.FLEET
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    # FleetBroker's agent checkpoints when the cloud announces a preemption (AWS 2 min, GCP and
    # Azure 30 s ahead), so a preemption loses no work; SkyPilot finds preemptions by polling
    # (FACTS.md section 4) and loses the work since the last periodic checkpoint.
    checkpoint_on_notice: bool = False
    blocklist_decay_s: float = DEFAULT_DECAY_S

    def __post_init__(self) -> None:
        if not self.checkpoint_s > 0:
            raise ValueError(f"checkpoint interval must be positive, got {self.checkpoint_s}")


@dataclass
class SpotResult:
    """The classic result plus costs (USD), GPU-hours by market and the spot counters."""

    result: SimResult
    cost_usd: float = 0.0
    ondemand_cost_usd: float = 0.0
    deadline_misses: int = 0
    migrations: int = 0  # relaunches in another region than the job last ran in, forced or chosen
    preemptions: int = 0
    lost_work_gpu_h: float = 0.0
    spot_gpu_h: float = 0.0
    ondemand_gpu_h: float = 0.0


@dataclass
class _Job:
    sim: SimJob
    deadline: float | None
    pace: Pace
    pool: SimPool | None = None
    placed_at: float = 0.0
    checkpoint: float = 0.0  # progress at the last checkpoint
    since_checkpoint: float = 0.0  # seconds of progress since then
    preempted_from: str | None = None  # region of the last preemption, until relaunched

    @property
    def state(self) -> JobState:
        return self.sim.state

    @property
    def restart_h(self) -> float:
        return self.state.restart_s / 3600


@dataclass
class Pace:
    """Hours of work at the job's requested configuration, as a function of progress: the yardstick
    of Can't Be Late's pace (the elastic allocator may run the job faster or slower)."""

    bounds: list[float]  # progress at the start of each epoch, and the target
    seconds_per_unit: list[float]  # per epoch, at the requested configuration
    gpus: int  # the requested GPU count (capped at the type's GPUs)

    def hours(self, progress: float) -> float:
        done = 0.0
        for e, s in enumerate(self.seconds_per_unit):
            lo, hi = self.bounds[e], self.bounds[e + 1]
            done += max(0.0, min(progress, hi) - lo) * s
        return done / 3600


def isolated_pace(state: JobState, types: Sequence[TypeCapacity]) -> Pace:
    """The job alone at its requested GPUs and batch on its fastest type of the cluster."""
    eff = state.app.efficiency
    best: Pace | None = None
    for cap in types:
        if cap.accelerator not in state.app.throughput:
            continue
        gpus = min(state.workload_gpus, cap.gpus)
        placement = placement_for(gpus, cap.gpus_per_node)
        per = []
        for e in range(eff.max_epochs):
            rate, _ = state.app.rate(cap.accelerator, placement, state.workload_batch, e)
            per.append(state.slowdown / rate if rate > 0 else math.inf)
        pace = Pace([float(b) for b in eff.boundaries], per, gpus)
        if best is None or pace.hours(eff.target) < best.hours(eff.target):
            best = pace
    if best is None or not math.isfinite(best.hours(eff.target)):
        raise SimulationError(f"job {state.id}: {state.app.name} cannot run at its requested "
                              f"{state.workload_gpus} GPUs and batch {state.workload_batch} on "
                              "this cluster, so it has no pace for its deadline")
    return best


@dataclass(frozen=True)
class _FreeGpus(TypeCapacity):
    """A type's capacity for the allocator: the free GPUs of its pools (not always whole nodes)."""

    free: int = 0

    @property
    def gpus(self) -> int:
        return self.free


class _CappedPolicy(ElasticPolicy):
    """The elastic allocator, each job's GPU count capped at the largest pool's free GPUs (a gang
    runs in one pool); a job in ``sizes`` gets the smallest allowed count of at least that many."""

    def __init__(self, fleet: Sequence[_FreeGpus], largest: dict[Accelerator, int],
                 sizes: dict[str, int], cfg: SimConfig, tables: ChoiceTables):
        super().__init__(fleet, Admission.QUEUE, cfg.value, tables, cfg.accumulation)
        self.fixed_batch = cfg.policy is PolicyName.FIXED_BATCH
        self.largest = largest
        self.sizes = sizes

    def _table(self, job: JobState, acc: Accelerator) -> ConfigTable:
        cap, top = self.fleet[acc], self.largest[acc]
        whole = TypeCapacity(acc, max(1, math.ceil(top / cap.gpus_per_node)), cap.gpus_per_node)
        fixed = job.workload_batch if self.fixed_batch else None
        table = self.tables.table(job.app, whole, job.epoch, fixed, self.accumulation)
        keep = table.gpus <= top
        want = table.gpus[keep & (table.gpus >= self.sizes.get(job.id, 0))]
        if job.id in self.sizes and len(want):
            keep = table.gpus == want.min()
        return ConfigTable(table.gpus[keep], table.batch[keep], table.rate[keep])


def _restarts(job: _Job, a: Assignment) -> bool:
    """Does running ``job`` with ``a`` (re)start it: it is not running, or its type, GPU count
    or placement changes (a batch change alone needs no restart)?"""
    c = job.state.current
    return c is None or (c.accelerator, c.gpus, c.placement) != (a.accelerator, a.gpus,
                                                                  a.placement)


def simulate_spot(workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                  cfg: SimConfig = SimConfig(), spot: SpotConfig = SpotConfig(),
                  tables: ChoiceTables | None = None) -> SpotResult:
    """Run one workload on spot/on-demand pools under ``spot.market``; deterministic."""
    if cfg.policy not in (PolicyName.ELASTIC, PolicyName.FIXED_BATCH):
        raise SimulationError(f"the spot simulation runs the elastic allocators (elastic, "
                              f"fixed-batch), not {cfg.policy.value}")
    if cfg.admission is not Admission.QUEUE:
        raise SimulationError("the spot simulation queues jobs (admission queue): preempted "
                              "jobs must be able to wait for capacity")
    return _SpotSim(workload, pools, cfg, spot, tables or ChoiceTables()).run()


class _SpotSim:
    def __init__(self, workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                 cfg: SimConfig, spot: SpotConfig, tables: ChoiceTables):
        self.cfg, self.spot = cfg, spot
        markets = {MarketPolicy.ONDEMAND: {Market.ON_DEMAND},
                   MarketPolicy.FLEET: {Market.SPOT, Market.ON_DEMAND}}.get(
                       spot.market, {Market.SPOT})
        self.pools = sorted((p for p in pools if p.pool.market in markets),
                            key=lambda p: (p.pool.price_per_gpu_hour, p.pool.id))
        if not self.pools:
            need = " or ".join(sorted(m.value for m in markets))
            raise SimulationError(f"--spot-policy {spot.market.value} needs {need} pools; the "
                                  "cluster has none")
        self.types = fleet_capacity([p.pool for p in pools])
        # a gang runs in one pool, so a job's pace refers to the largest pool of its type
        self.gang_types = [
            TypeCapacity(t.accelerator, max(p.pool.nodes for p in pools
                                            if p.pool.accelerator is t.accelerator),
                         t.gpus_per_node) for t in self.types]
        self.tables = tables
        self.jobs = [self._job(w) for w in sorted(workload, key=lambda w: (w.time, w.name))]
        self.out = SpotResult(SimResult([j.sim.record for j in self.jobs], 0.0, 0))
        spots = [p.pool for p in self.pools if p.pool.market is Market.SPOT]
        self.blocklist = register(Blocklist(decay_s=spot.blocklist_decay_s),
                                  [k for p in spots for k in location_keys(p)])
        self.preempted: dict[str, int] = {}  # pool id -> preemptions seen (fleet's hazard)
        self.node_hours: dict[str, float] = {}

    def _job(self, w: WorkloadJob) -> _Job:
        sim = make_job(w, self.cfg)
        return _Job(sim, w.deadline, isolated_pace(sim.state, self.gang_types))

    def run(self) -> SpotResult:
        cfg, jobs, cache = self.cfg, self.jobs, {}
        now, rounds, nxt = 0.0, 0, 0
        active: list[_Job] = []
        while (nxt < len(jobs) or active) and now < cfg.max_hours * 3600:
            for job in active:
                self._advance(job, now, cache)
            now += cfg.interval
            rounds += 1
            active = [j for j in active if j.sim.record.completed is None]
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
        res = self.out
        res.result.end_time, res.result.rounds = now, rounds
        res.result.unfinished = sum(j.sim.record.completed is None for j in jobs)
        res.deadline_misses = sum(
            int(j.deadline is not None and (j.sim.record.jct is None
                                            or j.sim.record.jct > j.deadline)) for j in jobs)
        return res

    # --- one round ---------------------------------------------------------------------------

    def _advance(self, job: _Job, now: float, cache: dict) -> None:
        a, pool = job.state.current, job.pool
        if a is None or pool is None:
            return
        held0, restart0 = job.sim.record.gpu_seconds, job.sim.restart_left
        advance(job.sim, now, self.cfg.interval, cache)
        gpu_h = (job.sim.record.gpu_seconds - held0) / 3600
        self.out.cost_usd += gpu_h * pool.pool.price_per_gpu_hour
        self.out.ondemand_cost_usd += gpu_h * pool.ondemand_price
        if pool.pool.market is Market.SPOT:
            self.out.spot_gpu_h += gpu_h
            self.node_hours[pool.pool.id] = (self.node_hours.get(pool.pool.id, 0.0)
                                             + gpu_h / pool.pool.gpus_per_node)
        else:
            self.out.ondemand_gpu_h += gpu_h
        if job.sim.record.completed is not None:
            job.pool = None
            return
        job.since_checkpoint += self.cfg.interval - (restart0 - job.sim.restart_left)
        if job.since_checkpoint >= self.spot.checkpoint_s:
            job.checkpoint, job.since_checkpoint = job.state.progress, 0.0

    def _preempt(self, active: list[_Job], now: float) -> None:
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

    def _evict(self, job: _Job, now: float) -> None:
        a, pool = job.state.current, job.pool
        assert a is not None and pool is not None
        self.out.preemptions += 1
        if not self.spot.checkpoint_on_notice:
            self.out.lost_work_gpu_h += a.gpus * job.since_checkpoint / 3600
            job.state.progress = job.checkpoint
        job.checkpoint, job.since_checkpoint = job.state.progress, 0.0
        job.state.current, job.pool, job.sim.restart_left = None, None, 0.0
        job.preempted_from = pool.region
        self.preempted[pool.pool.id] = self.preempted.get(pool.pool.id, 0) + 1
        for key in location_keys(pool.pool):
            self.blocklist = mark_preempted(self.blocklist, key, now)

    def _stop(self, job: _Job) -> None:
        """A move the broker makes itself: checkpoint first, so nothing is lost."""
        job.checkpoint, job.since_checkpoint = job.state.progress, 0.0
        job.state.current, job.pool, job.sim.restart_left = None, None, 0.0

    def _schedule(self, active: list[_Job], now: float) -> None:
        plan: dict[str, tuple[Assignment, SimPool] | None] = {j.state.id: None for j in active}
        if self.spot.market is MarketPolicy.ONDEMAND:
            plan.update(self._allocate(active, Market.ON_DEMAND, now))
        elif self.spot.market is not MarketPolicy.FLEET:
            plan.update(self._allocate(active, Market.SPOT, now))
        else:
            plan.update(self._fleet(active, now))
        for job in active:
            self._apply(job, plan[job.state.id], now)
            job.state.new = False

    def _fleet(self, active: list[_Job], now: float) -> dict[str, tuple[Assignment, SimPool]]:
        """Can't Be Late per job, where "spot is available" means the allocator found the job
        spot GPUs this round; the on-demand fallback runs a job at its pace's GPU count."""
        views = {j.state.id: self._view(j, now) for j in active}
        first = {k: choose_market(v, spot_available=True) for k, v in views.items()}
        on_spot = [j for j in active if first[j.state.id] is Market.SPOT]
        # near the safety net: no rescale while the current configuration keeps pace (a
        # rescale's restart costs the slack too). Shrinking such a job below pace is left to
        # the allocator: the safety net sends it to on-demand if it falls behind, and pinning
        # every such job to its pace cost the others more JCT than it saved.
        steady = {j.state.id: j.state.current.gpus for j in on_spot
                  if holds_pace(views[j.state.id]) and j.pool is not None
                  and j.pool.pool.market is Market.SPOT and self._rate(j) >= self._pace_rate(j)}
        plan = self._allocate(on_spot, Market.SPOT, now, steady)
        market = {k: m if m is not Market.SPOT or k in plan else
                  choose_market(views[k], spot_available=False) for k, m in first.items()}
        fallback = [j for j in active if market[j.state.id] is Market.ON_DEMAND]
        plan.update(self._allocate(fallback, Market.ON_DEMAND, now,
                                   {j.state.id: j.pace.gpus for j in fallback}))
        return plan

    @staticmethod
    def _pace_rate(job: _Job) -> float:
        """The goodput (as the allocator's tables count it) of the job's pace at its epoch."""
        per = job.pace.seconds_per_unit
        return job.state.slowdown / per[min(job.state.epoch, len(per) - 1)]

    @staticmethod
    def _hours_left(job: _Job, a: Assignment) -> float:
        """Hours to finish at the assignment's goodput (at the job's current epoch): what the
        job will hold the pool's GPUs for, the basis of a pool's expected cost."""
        s = job.state
        rate = s.app.rate(a.accelerator, a.placement, a.batch_size, s.epoch)[0]
        return (s.app.efficiency.target - s.progress) * s.slowdown / rate / 3600

    @staticmethod
    def _rate(job: _Job) -> float:
        """The goodput of the job's current configuration at its epoch."""
        a = job.state.current
        assert a is not None
        return job.state.app.rate(a.accelerator, a.placement, a.batch_size, job.state.epoch)[0]

    def _view(self, job: _Job, now: float) -> DeadlineJob:
        """Where the job stands against its deadline, in hours of work at its requested size."""
        pool = job.pool
        total = job.pace.hours(job.state.app.efficiency.target)
        progress = job.pace.hours(job.state.progress)
        return DeadlineJob(
            total_h=total, progress_h=progress, elapsed_h=(now - job.state.submitted) / 3600,
            deadline_h=None if job.deadline is None else job.deadline / 3600,
            # the round until the broker reacts, the restart, and the work since the last
            # checkpoint (none with a checkpoint on notice)
            restart_h=preemption_h(self.cfg.interval / 3600, job.restart_h,
                                   0.0 if self.spot.checkpoint_on_notice
                                   else self.spot.checkpoint_s / 3600, total - progress),
            switch_h=job.restart_h, current=None if pool is None else pool.pool.market)

    def _allocate(self, group: list[_Job], market: Market, now: float,
                  sizes: dict[str, int] | None = None) -> dict[str, tuple[Assignment, SimPool]]:
        """The elastic allocator over the market's available GPUs, then one pool per gang; jobs
        the placement cannot fit are re-allocated over what is left (fragmentation repair).
        ``sizes`` pins jobs to (the smallest allowed count of at least) that many GPUs."""
        pools = [p for p in self.pools if p.pool.market is market]
        free = {p.pool.id: p.gpus_at(now) for p in pools}
        out: dict[str, tuple[Assignment, SimPool]] = {}
        todo = sorted(group, key=lambda j: (j.state.submitted, j.state.id))
        for _ in range(4):
            assigned = self._dp(todo, pools, free, sizes or {})
            if not assigned:
                break
            placed = self._place(todo, assigned, pools, free, now)
            out.update(placed)
            todo = [j for j in todo if j.state.id not in placed]
            if not todo or not placed:
                break
        return out

    def _dp(self, jobs: list[_Job], pools: list[SimPool], free: dict[str, int],
            sizes: dict[str, int]) -> dict[str, Assignment]:
        caps, largest = [], {}
        for cap in self.types:
            mine = [free[p.pool.id] for p in pools if p.pool.accelerator is cap.accelerator]
            if sum(mine) >= 1:
                caps.append(_FreeGpus(cap.accelerator, cap.nodes, cap.gpus_per_node, sum(mine)))
                largest[cap.accelerator] = max(mine)
        # a job running on a type with nothing free left waits for the next round
        states = [j.state for j in jobs
                  if j.state.current is None or j.state.current.accelerator in largest]
        if not caps or not states:
            return {}
        plan = _CappedPolicy(caps, largest, sizes, self.cfg,
                             self.tables).schedule(states, 0.0)
        return {k: v for k, v in plan.items() if v is not None}

    def _place(self, jobs: list[_Job], assigned: dict[str, Assignment], pools: list[SimPool],
               free: dict[str, int], now: float) -> dict[str, tuple[Assignment, SimPool]]:
        """One pool per gang. A running job holds its GPUs where it runs until it is placed
        anew (one whose new size fits nowhere gets them back for the next allocation, not
        someone else). Running jobs keep their pool while it holds their new size, those that
        keep their configuration first (a rescale must not push a job that would not restart
        out of its pool); the others go, largest gang first, where the spot policy says; then
        fleet moves running jobs into the room left elsewhere when that beats region_score's
        stickiness margin (no job is displaced)."""
        out: dict[str, tuple[Assignment, SimPool]] = {}
        todo = sorted((j for j in jobs if j.state.id in assigned),
                      key=lambda j: (-assigned[j.state.id].gpus, j.state.submitted, j.state.id))
        held: dict[str, int] = {}
        for j in todo:
            if j.state.current is not None and j.pool is not None and j.pool.pool.id in free:
                held[j.state.id] = j.state.current.gpus
                free[j.pool.pool.id] -= j.state.current.gpus
        for j in sorted(todo, key=lambda j: _restarts(j, assigned[j.state.id])):
            a = assigned[j.state.id]
            if j.state.id in held and j.pool is not None and \
                    j.pool.pool.accelerator is a.accelerator and \
                    free[j.pool.pool.id] + held[j.state.id] >= a.gpus:
                free[j.pool.pool.id] += held.pop(j.state.id) - a.gpus
                out[j.state.id] = (a, j.pool)
        for j in todo:
            a = assigned[j.state.id]
            if j.state.id in out:
                if self.spot.market is not MarketPolicy.FLEET:
                    continue
                free[j.pool.pool.id] += a.gpus  # its own GPUs count as room where it is
            elif j.state.id in held:
                free[j.pool.pool.id] += held[j.state.id]
            fits = [p for p in pools if p.pool.accelerator is a.accelerator
                    and free[p.pool.id] >= a.gpus]
            pool = self._pick(j, a, fits, now)
            if pool is not None:
                free[pool.pool.id] -= a.gpus
                out[j.state.id] = (a, pool)
                held.pop(j.state.id, None)
            elif j.state.id in held:
                free[j.pool.pool.id] -= held[j.state.id]  # still holds them this pass
        for jid, gpus in held.items():  # back to the next allocation, its own seat included
            free[next(j for j in todo if j.state.id == jid).pool.pool.id] += gpus
        return out

    def _pick(self, job: _Job, a: Assignment, fits: list[SimPool], now: float) -> SimPool | None:
        """The pool for a job among those with room (``fits``, cheapest first)."""
        if not fits:
            return None
        policy, origin = self.spot.market, job.preempted_from
        if policy is not MarketPolicy.FLEET:
            if job.pool in fits:
                return job.pool  # SkyPilot and on-demand never move a running job
            if policy is MarketPolicy.FAILOVER and origin:
                return min(fits, key=lambda p: p.region != origin)  # cheapest of its region
            if policy is MarketPolicy.EAGER and origin:
                return min(fits, key=lambda p: p.region == origin)  # its own region last
            return fits[0]
        # fleet: expected cost (price, observed preemption rate, the move's restart) with a
        # stickiness margin for a running job, among the locations SpotHedge has not blocked
        open_ = [p for p in fits if p is job.pool or not any(
            self.blocklist.is_blocked(k, now) for k in location_keys(p.pool))] or fits
        # a job that restarts anyway (start, rescale) pays no extra restart to move, so only a
        # job that keeps its configuration is held by the stickiness margin
        stays = job.pool is not None and not _restarts(job, a)
        needs = JobNeeds(
            gpus=a.gpus, remaining_h=self._hours_left(job, a), restart_h=job.restart_h,
            checkpoint_interval_h=0.0 if self.spot.checkpoint_on_notice
            else self.spot.checkpoint_s / 3600,
            current_pool=job.pool.pool.id if stays and job.pool is not None else None)
        candidates = [Candidate(pool=p.pool, prior_monthly_rate=p.prior,
                                preemptions_seen=self.preempted.get(p.pool.id, 0),
                                node_hours_seen=self.node_hours.get(p.pool.id, 0.0))
                      for p in open_]
        best = choose(needs, candidates, now=now)
        return None if best is None else next(p for p in open_ if p.pool.id == best.pool_id)

    def _apply(self, job: _Job, new: tuple[Assignment, SimPool] | None, now: float) -> None:
        s, rec = job.state, job.sim.record
        if new is None:
            if s.current is not None:
                self._stop(job)  # suspended by the allocator
            return
        a, pool = new
        old = s.current
        if old is not None and job.pool is pool and not _restarts(job, a):
            s.current = a  # a batch change alone needs no restart
            return
        # a change of region costs a restart elsewhere, whether a preemption forced it or fleet
        # chose it for a cheaper pool (the broker counts every MIGRATE alike)
        came_from = job.pool.region if job.pool is not None else job.preempted_from
        if came_from is not None and pool.region != came_from:
            self.out.migrations += 1
        if old is not None:
            self._stop(job)  # rescale or move: checkpoint first
        job.preempted_from = None
        job.sim.restart_left = s.restart_s
        if job.sim.started:
            rec.restarts += 1
        job.sim.started = True
        s.current, job.pool, job.placed_at = a, pool, now
        if pool.pool.market is Market.SPOT:
            for key in location_keys(pool.pool):
                if self.blocklist.is_blocked(key, now):
                    self.blocklist = mark_launched(self.blocklist, key)

