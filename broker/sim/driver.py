"""A driver of the live broker's scheduling round: the simulator's ``fleet`` policy on spot
clusters, and its ``elastic``, ``fixed-batch`` and ``static`` policies on classic ones (a classic
cluster is plain on-demand pools: ``broker.sim.rounds.classic_pools``).

No scheduling decision is made here. On a virtual clock, with Pollux's rounds (the loop, progress,
cost and evictions of ``broker.sim.rounds.SpotRounds``), each round:

1. running jobs advance on the measured tables (``broker.sim.engine.advance``) and report as
   agents do, through the fields a heartbeat writes (``broker.store.Store.record_heartbeat``);
   a job that reaches its target completes;
2. spot pools whose trace fell below what runs there evict jobs, as the reconciler records a
   preemption: the job is suspended, the preemption counted on it and its pool, the location
   blocked (SpotHedge's blocklist); new arrivals are queued;
3. ``broker.scheduler.plan_round`` plans from a snapshot of the jobs' records and the pools at
   their current availability, with each pool's catalog prior, the blocklist and the pool stats;
4. its plan is carried out in memory as the store, actuator, agents and reconciler would: the
   records are read back from the plan; a launch starts the job in its pool with its GPUs and
   batch (a restart first); a suspend, migrate, resize or stop checkpoints the job (nothing is
   lost: the broker asked) and settles it as suspended. Live, that settle wakes the scheduler,
   whose next round relaunches a moved or resized job; here the round runs again at once.

The round runs with the broker's own settings (``scheduler_config``): the simulation chooses the
live ``Policy`` and ``Admission`` (``--policy``, ``--admission``), nothing else of the allocator.
The physics are the simulation's: restarts, the tables' throughput and efficiency.

The broker counts work in samples; the tables count progress in M0-iterations (iterations at the
job's initial batch M0). The driver gives each job ``ceil(target x M0)`` samples of work, reports
``progress x M0`` samples done and goodput x M0 as its samples/s, so the round's estimates are in
the unit of the job's work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from broker.models import Intent, IntentKind, JobRecord, JobState, carry_out_order
from broker.scheduler import Policy, SchedulerConfig, plan_round
from broker.sim.cluster import fleet_capacity
from broker.sim.engine import Assignment, Baseline, SimConfig, SimulationError, goodput
from broker.sim.rounds import SimPool, SpotConfig, SpotJob, SpotRounds
from broker.sim.workload import WorkloadJob
from broker.store import Plan, PoolStats, Snapshot
from policies.job_model import measurement_key
from policies.migration import (
    Blocklist,
    expire,
    location_keys,
    mark_launched,
    mark_reclaimed,
    mark_refused,
    register,
)
from policies.models import (
    Accelerator,
    BatchMode,
    BatchRange,
    CheckpointSpec,
    GpuRange,
    JobSpec,
    Market,
    Pool,
    SpotPolicy,
)
from policies.type_assignment import placement_for

FENCE = 1  # the driver is the broker's only leader
UNMEASURED = "the measurements cannot run"
TEAM = "sim"
# Rounds at one instant: a plan that stops a job (or whose launch fails) is followed by another, as
# the reconciler's settle wakes the scheduler live; the cap only guards against endless churn.
MAX_PASSES = 8


def scheduler_config(cfg: SimConfig, checkpoint_on_notice: bool = False) -> SchedulerConfig:
    """The live round's settings for a simulation: the product's defaults, but for what the
    simulation fixes itself: its policy and admission; a relaunch costs the simulation's restart
    penalty (per model: the product's default, as the round has one figure for every job), the
    broker reacts to a preemption at the next round, and the simulated agents checkpoint on the
    notice or not."""
    if isinstance(cfg.policy, Baseline):
        raise SimulationError(f"{cfg.policy.value} is a baseline, not the live round's policy")
    config = SchedulerConfig(policy=cfg.policy, admission=cfg.admission, reaction_s=cfg.interval,
                             checkpoint_on_notice=checkpoint_on_notice)
    if cfg.restart_penalty is not None:
        config.restart_s = cfg.restart_penalty
    return config


def job_spec(w: WorkloadJob, work_samples: int, m0: int, max_batch: int,
             accelerators: Sequence[Accelerator], max_gpus: int, checkpoint_s: float) -> JobSpec:
    """A workload row as a user would submit it: ``work_samples`` of work, elastic from one GPU
    to ``max_gpus`` (the largest pool of its types) and from batch M0 to the model's largest,
    asking for the row's GPUs and batch (its deadline's pace is judged there); spot allowed; its
    deadline; the simulation's checkpoint interval. ``model`` names the application (a prior
    may use its measured tables); the run command is a placeholder, never run."""
    default = min(max(w.batch_size, m0), max_batch)
    return JobSpec(
        name=_spec_name(w.name), run=f"# simulated {w.application}: never runs",
        accelerators=list(accelerators),
        gpus=GpuRange(min=1, max=(top := max(1, min(max_gpus, 4096))),
                      default=min(w.num_replicas, top)),
        batch_size=BatchRange(min=m0, max=max_batch, default=default),
        batch_mode=BatchMode.ELASTIC, work_samples=work_samples, spot=SpotPolicy.ALLOWED,
        checkpoint=CheckpointSpec(interval=f"{max(1, int(checkpoint_s))}s"), team=TEAM,
        deadline_s=w.deadline, model=w.application)


def _spec_name(name: str) -> str:
    """A job name the spec accepts (``policies.models.check_name``) from a workload row's."""
    allowed = "abcdefghijklmnopqrstuvwxyz0123456789-_."
    out = "".join(c if c in allowed else "-" for c in name.lower())[:63]
    return out if out[:1].isalnum() else ("j" + out)[:63]


class LiveRoundDriver(SpotRounds):
    """Runs a workload under the live round (see the module docstring); ``run`` returns the
    same ``SpotResult`` as the baselines."""

    def __init__(self, workload: Sequence[WorkloadJob], pools: Sequence[SimPool],
                 cfg: SimConfig, spot: SpotConfig, config: SchedulerConfig | None = None):
        ids = [p.pool.id for p in pools]
        if len(set(ids)) < len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})
            raise SimulationError(f"pools {', '.join(twice)} share an id (cloud, region, zone, "
                                  "market, accelerator); the broker tells pools apart by it")
        # the cluster's types in its order: a job's accelerators, the first offered preferred
        self.types = [t.accelerator for t in fleet_capacity([p.pool for p in pools])]
        self.records: dict[str, JobRecord] = {}
        super().__init__(workload, pools, cfg, spot, set(Market))
        self.config = config or scheduler_config(cfg, spot.checkpoint_on_notice)
        self.by_id = {p.pool.id: p for p in self.pools}
        self.priors = {p.pool.id: p.prior for p in self.pools if p.prior is not None}
        spots = [k for p in self.pools if p.pool.market is Market.SPOT
                 for k in location_keys(p.pool)]
        self.blocklist = register(Blocklist(decay_s=spot.blocklist_decay_s), spots)
        self.early_reclaims: dict[str, float] = {}  # pool id -> its last early reclaim
        self.stats = PoolStats()  # its dicts grow in place: the reconciler's counters
        self._views: dict[tuple[str, int], Pool] = {}

    def _job(self, w: WorkloadJob) -> SpotJob:
        job = super()._job(w)
        app = job.state.app
        accels = [a for a in self.types if a in app.throughput]
        if not accels:
            raise SimulationError(f"job {w.name}: {app.name} has no measurements on any type "
                                  "of this cluster")
        m0 = app.init_batch_size
        largest = max(p.pool.capacity for p in self.pools if p.pool.accelerator in accels)
        spec = job_spec(w, math.ceil(app.efficiency.target * m0), m0, app.spec.max_batch_size,
                        accels, largest, self.spot.checkpoint_s)
        if self.cfg.policy is Policy.STATIC:
            # The live static policy runs gpus.min at the initial batch and never rescales: a
            # user of such a broker asks for the row's GPU count (Pollux's static baseline).
            if w.num_replicas > largest:
                raise SimulationError(
                    f"job {w.name} needs {w.num_replicas} GPUs but the largest pool of its types "
                    f"has {largest}; use a bigger cluster or policy elastic")
            spec = spec.model_copy(update={"gpus": GpuRange(min=w.num_replicas,
                                                            max=w.num_replicas)})
        self.records[w.name] = JobRecord(id=w.name, spec=spec, team=TEAM, submitted_at=w.time,
                                         updated_at=w.time)
        return job

    # --- the round ------------------------------------------------------------------------

    def _schedule(self, active: list[SpotJob], now: float) -> None:
        jobs = {j.state.id: j for j in active}
        pools = self._pools_at(now)
        launched: list[SpotJob] = []
        for _ in range(MAX_PASSES):
            snap = Snapshot([r for k in jobs if not (r := self.records[k]).state.terminal],
                            pools, [])
            res = plan_round(snap, FENCE, self.config, now, blocklist=self.blocklist,
                             priors=self.priors, stats=self.stats)
            if not self._carry_out(res.plan, jobs, now, launched):
                break
        for job in launched:
            self._running(job, now)

    def _pools_at(self, now: float) -> list[Pool]:
        """The pools as the broker sees them now: a traced pool holds min(nodes, trace)."""
        out = []
        for p in self.pools:
            nodes = p.gpus_at(now) // p.pool.gpus_per_node
            if nodes == p.pool.nodes:
                out.append(p.pool)
                continue
            view = self._views.get((p.pool.id, nodes))
            if view is None:
                view = self._views[p.pool.id, nodes] = p.pool.model_copy(update={"nodes": nodes})
            out.append(view)
        return out

    def _carry_out(self, plan: Plan, jobs: dict[str, SpotJob], now: float,
                   launched: list[SpotJob]) -> bool:
        """Apply a plan as the store (records), the actuator (intents) and the reconciler (a
        stopped job's settle) would; True when it stopped a job (the settle wakes the
        scheduler, as does a launch whose command fails). Jobs it launches join
        ``launched``."""
        for entry in plan.sets:
            old = self.records[entry["job"]]
            state = JobState(entry.get("state", old.state))
            if state not in (JobState.LAUNCHING, JobState.SUSPENDING, JobState.DROPPED,
                             old.state):
                raise SimulationError(f"job {old.id}: the round moved it to {state.value}, "
                                      "which the simulation does not carry out")
            if state is JobState.DROPPED:  # admission drop: it leaves the simulation
                jobs[old.id].sim.record.dropped = True
            self._put(old, state=state, **plan.updates[old.id])
        stopped = False
        for intent in carry_out_order(Intent.model_validate_json(r["json"])
                                      for r in plan.intents_add):
            job = jobs[intent.job_id]
            if intent.kind is IntentKind.RESIZE_IN_PLACE:
                self._resize_in_place(job, intent)
            elif intent.kind is IntentKind.LAUNCH:
                if self._start(job, intent, now):
                    launched.append(job)
                else:
                    stopped = True
            else:  # suspend, migrate, resize, stop: checkpoint and exit, then settle
                self._settle(job, now)
                stopped = True
        return stopped

    def _start(self, job: SpotJob, intent: Intent, now: float) -> bool:
        """The actuator's launch: the job runs in the intent's pool with its GPUs and batch
        from now (its restart first). It stays ``launching`` for the rest of the instant, as
        the rounds a settle wakes find it live while its nodes boot (they leave it alone).
        A pool without the room refuses it, as a cloud would: the job is suspended and the
        pool marked refused (False)."""
        rec = self.records[job.state.id]
        pool = self.by_id[intent.pool or ""]
        held = sum(j.state.current.gpus for j in self.jobs
                   if j.pool is pool and j.state.current is not None)
        if pool.gpus_at(now) - held < intent.gpus:
            self.blocklist = mark_refused(expire(self.blocklist, now), pool.pool.id, now,
                                          "capacity")
            self._put(rec, state=JobState.SUSPENDED, reason="no capacity")
            return False
        p = pool.pool
        batch = intent.batch_size or rec.spec.batch_size.initial
        a = Assignment(p.accelerator, intent.gpus, batch,
                       placement_for(intent.gpus, p.gpus_per_node))
        if not goodput(job.state, a, job.state.epoch, self.rates) > 0:
            # The tables measured no such configuration (a per-GPU batch below the smallest
            # measured): the command fails as it starts, and the reconciler counts a failure.
            failures = rec.failures + 1
            state = JobState.FAILED if failures > self.config.max_failures else \
                JobState.SUSPENDED
            self._put(rec, state=state, failures=failures, exit_code=1,
                      reason=f"{UNMEASURED} {a.gpus} GPUs, batch {a.batch_size} "
                      f"(failure {failures})")
            return False
        self._launch(job, a, pool, now)
        return True

    def _resize_in_place(self, job: SpotJob, intent: Intent) -> None:
        """The job's workers re-form their group at the intent's size in the same attempt:
        it trains on that many GPUs after the in-place pause, with nothing lost."""
        a, pool = job.state.current, job.pool
        if a is None or pool is None:
            return
        job.state.current = Assignment(a.accelerator, intent.gpus, a.batch_size,
                                       placement_for(intent.gpus, pool.pool.gpus_per_node))
        job.sim.restart_left += self.config.resize_in_place_s

    def _running(self, job: SpotJob, now: float) -> None:
        """The actuator records the launch: the job runs; a spot launch that succeeded in a
        blocked location reopens it (SpotHedge's ``mark_launched``)."""
        rec = self.records[job.state.id]
        self._put(rec, state=JobState.RUNNING, launched_at=now, reason="running",
                  started_at=now if rec.started_at is None else rec.started_at)
        p = self.by_id[rec.pool or ""].pool
        if p.market is Market.SPOT:
            for key in location_keys(p):
                if self.blocklist.is_blocked(key, now):
                    self.blocklist = mark_launched(self.blocklist, key)

    def _settle(self, job: SpotJob, now: float) -> None:
        """The job checkpointed and exited on the broker's request: suspended, nothing lost."""
        rec = self.records[job.state.id]
        self._close(rec, now)
        self._stop(job)
        self._put(rec, state=JobState.SUSPENDED, samples_done=self._samples(job))

    def _evict(self, job: SpotJob, now: float) -> None:
        """A preemption as the reconciler records it: the job suspended with one preemption
        more, counted against its pool, and a spot location blocked."""
        assert job.pool is not None
        p = job.pool.pool
        rec = self.records[job.state.id]
        self._close(rec, now)
        super()._evict(job, now)
        self.stats.preemptions[p.id] = self.stats.preemptions.get(p.id, 0) + 1
        self._put(rec, state=JobState.SUSPENDED, preemptions=rec.preemptions + 1,
                  reason="spot capacity reclaimed", samples_done=self._samples(job))
        if p.market is Market.SPOT:  # the reconciler's rule, storm back-off included
            ran = None if rec.launched_at is None else now - rec.launched_at
            got = mark_reclaimed(expire(self.blocklist, now), p, now, ran,
                                 self.early_reclaims.get(p.id))
            self.blocklist = got.blocklist
            if got.early:
                self.early_reclaims[p.id] = now

    def _advance(self, job: SpotJob, now: float) -> None:
        """One round of the job, then what its agent reports: progress, and the throughput of
        its configuration once it trained in the round; or its completion."""
        if job.pool is None:
            super()._advance(job, now)
            return
        restart0, accel = job.sim.restart_left, job.pool.pool.accelerator
        super()._advance(job, now)
        rec = self.records[job.state.id]
        end = job.sim.record.completed
        if end is not None:
            self._close(rec, end)
            self._put(rec, state=JobState.COMPLETED, samples_done=rec.spec.work_samples,
                      finished_at=end, reason="finished")
            return
        a = job.state.current
        if a is None or self.cfg.interval <= restart0 - job.sim.restart_left:
            return  # all of the round went to the restart: nothing measured yet
        app, m0 = job.state.app, job.state.app.init_batch_size
        rate = goodput(job.state, a, job.state.epoch, self.rates) * m0
        key = measurement_key(accel, a.gpus, a.batch_size)
        # resize_in_place: the simulated jobs run the runtime's own loop (``_resize_in_place``)
        self._put(rec, samples_done=self._samples(job), samples_per_sec=rate,
                  measured_gpus=a.gpus, measured_batch_size=a.batch_size,
                  measured={**rec.measured, key: rate},
                  grad_noise_scale=app.efficiency.noise_scale(a.batch_size, job.state.epoch),
                  resize_in_place=True)

    def _gone(self, job: SpotJob) -> bool:
        return super()._gone(job) or self.records[job.state.id].state.terminal

    # --- records ---------------------------------------------------------------------------

    def _put(self, rec: JobRecord, **fields: object) -> None:
        self.records[rec.id] = rec.model_copy(update=fields)

    @staticmethod
    def _samples(job: SpotJob) -> int:
        return int(job.state.progress * job.state.app.init_batch_size)

    def _close(self, rec: JobRecord, end: float) -> None:
        """A placement interval ends: its node-hours go to the pool's count (the reconciler's
        ``add_node_hours``); the round adds those of running jobs itself."""
        if rec.pool is None or rec.launched_at is None:
            return
        hours = max(0.0, end - rec.launched_at) / 3600 * max(1, rec.nodes)
        self.stats.node_hours[rec.pool] = self.stats.node_hours.get(rec.pool, 0.0) + hours
