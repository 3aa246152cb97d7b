"""The reconciler: compares the provider's inventory with Redis and repairs both sides.

Nodes that ended settle their job (exit 0 -> completed, 75 -> suspended to resume from its
checkpoint, else a counted failure; where the provider cannot tell, the exit code the agent
reported), closing the placement interval and adding its node-hours to the pool's count;
preemption notices (the provider's, or the agent's report from the node's metadata service) move
running jobs to suspending, count a preemption in the pool (these counts steer placement through
``policies.region_score``) and block the reclaimed spot location in the Redis-kept SpotHedge
blocklist (a pool that took back two launches soon after they started is under reclaim: it is
backed off, refused for the blocklist's refusal decay), all in the job's one atomic step; a VM
whose agent has exited is terminated, and one whose agent never sent a first heartbeat within the
launch deadline too (its job requeued); nodes no active job claims (stale attempts, jobs lost
with Redis data) are terminated; nodes' output is copied into the job logs.

A multi-node job that loses some of its nodes (gone, or under a preemption notice) while others
live is recovered by ``policies.migration.recover_lost_nodes``: stand-ins of the lost ranks are
launched in its pool (a REPLACE intent) and its survivors re-form the group with them in the next
rendezvous round, keeping their nodes; when that cannot work the whole job checkpoints and moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker import secrets, transitions
from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.protocol import EXIT_FINISHED, EXIT_STOPPED
from broker.recovery import gang_state
from broker.store import AgentReport, Conflict, Plan, Store
from policies.migration import (
    DEFAULT_DECAY_S,
    QUICK_RECLAIM_S,
    Recovery,
    expire,
    location_keys,
    mark_reclaimed,
    recover_lost_nodes,
    refusal_key,
    register,
)
from policies.models import Market
from providers.base import Node, NodeState, Provider, ProviderError, replacement_key

log = logging.getLogger(__name__)

QUICK_RECLAIM_KEY = "pool:early_reclaim"  # plain key per pool id: when its last early reclaim was


@dataclass
class ReconcileResult:
    settled: int = 0
    preempted: int = 0
    orphans: int = 0
    abandoned: int = 0  # launches whose agent never reported
    recovered: int = 0  # multi-node jobs whose lost nodes are being replaced or that move


class Reconciler:
    def __init__(self, store: Store, provider: Provider, *, max_failures: int = 3,
                 blocklist_decay_s: float = DEFAULT_DECAY_S,
                 refusal_decay_s: float | None = None,
                 launch_deadline_s: float | None = None,
                 replace_lost_nodes: bool = False,
                 final_report_wait_s: float | None = None,
                 quick_reclaim_s: float = QUICK_RECLAIM_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.provider = provider
        self.max_failures = max_failures
        self.blocklist_decay_s = blocklist_decay_s
        self.refusal_decay_s = refusal_decay_s  # None: what the stored blocklist says
        self.launch_deadline_s = launch_deadline_s  # None: agents cannot report (no broker URL)
        # whether agents can re-form a group with a stand-in (they reach the rendezvous)
        self.replace_lost_nodes = replace_lost_nodes
        # How long a finished job waits for its agent's final report (None: agents do not
        # report): completion is recorded with the progress that report carries
        self.final_report_wait_s = final_report_wait_s
        self.quick_reclaim_s = quick_reclaim_s  # a reclaim this soon after a launch is early
        self.clock = clock

    def run(self, fence: int) -> ReconcileResult:
        res = ReconcileResult()
        nodes = {n.node_id: n for n in self.provider.nodes()}
        jobs = self.store.list_jobs(states=[JobState.LAUNCHING, JobState.RUNNING,
                                            JobState.SUSPENDING])
        noticed = {n.node_id for n in self.provider.notices()}
        reports = self.store.agent_reports(j for j in jobs if j.state is not JobState.LAUNCHING)
        # (job, round) of stand-ins still to launch: their ranks are not lost again
        replacing = {(i.job_id, i.round) for i in self.store.intents()
                     if i.kind is IntentKind.REPLACE}
        down = self.provider.unreachable()
        claimed: set[str] = set()
        for job in jobs:
            if job.pool and _cloud(job) in down:
                continue  # its nodes are unknown right now, not gone
            mine = [n for n in nodes.values() if _claims(job, n)]
            claimed |= {n.node_id for n in mine}
            if job.state is JobState.LAUNCHING:
                continue  # the actuator owns it until the launch is recorded
            self._copy_logs(job, mine)
            report = reports.get(job.id, AgentReport())
            try:
                preempted = bool(noticed & set(job.node_ids)) or report.notice is not None
                if report.exits:
                    self._release_vms(job, nodes, report)
                if job.nodes > 1 and job.state is JobState.RUNNING and \
                        not job.cancel_requested and (job.id, job.round) not in replacing and \
                        self._recover(job, nodes, noticed, report, fence):
                    res.recovered += 1
                elif self._settle(job, [nodes.get(i) for i in job.node_ids], fence, preempted,
                                  report):
                    res.settled += 1
                elif job.state is JobState.RUNNING and preempted:
                    plan = Plan()
                    transitions.stopping(
                        plan, job, event="preempted", reason="spot capacity reclaimed",
                        data={"notice": report.notice} if report.notice else None, fence=fence,
                        preempted=True)
                    self._preempted(plan, job)
                    self.store.apply(plan, fence=fence)
                    res.preempted += 1
                elif self._never_reported(job, nodes, report):
                    self._abandon(job, nodes, fence)
                    res.abandoned += 1
            except Conflict as exc:
                log.info("reconcile %s: %s", job.id, exc)
            except ProviderError as exc:  # one VM the cloud will not stop must not stall all
                log.warning("reconcile %s: %s; retrying next pass", job.id, exc)
        for node in nodes.values():
            if node.node_id in claimed:
                continue
            try:
                if node.state is NodeState.TERMINATED:
                    self.provider.forget(node.node_id)
                else:
                    log.warning("terminating orphan node %s (job %s)", node.node_id, node.job_id)
                    self.provider.terminate(node.node_id)
                    res.orphans += 1
            except ProviderError as exc:
                log.warning("node %s: %s; retrying next pass", node.node_id, exc)
        return res

    def _release_vms(self, job: JobRecord, nodes: dict[str, Node],
                     report: AgentReport) -> None:
        """Agents reported their exit: the VMs that outlive them are no longer needed. Where a
        launch goes down whole (a SkyPilot cluster), only once every rank reported."""
        mine = [n for i in job.node_ids if (n := nodes.get(i)) is not None]
        if not all(self.provider.for_cloud(_cloud(job)).separable_nodes or
                   (n.rank or 0) in report.exits for n in mine):
            return
        for node in mine:
            if (node.rank or 0) in report.exits and node.state is not NodeState.TERMINATED \
                    and self.provider.outlives_agent(node):
                log.info("job %s: agent exited; terminating %s", job.id, node.node_id)
                self.provider.terminate(node.node_id)

    def _recover(self, job: JobRecord, nodes: dict[str, Node], noticed: set[str],
                 report: AgentReport, fence: int) -> bool:
        """A running multi-node job that lost some nodes (gone, reclaimed, or nodes that never
        came to the rendezvous of their round within the launch deadline) while others live:
        replace the lost ranks in its pool, the survivors staying, or move the whole job
        (``recover_lost_nodes``). A rank whose command failed stops the others: the gang cannot
        go on, and the job settles as that failure once all are gone. False when there is
        nothing to do here (the job ends or settles its usual way)."""
        # since the round's nodes were launched: the gang's, or the last stand-ins'
        since = job.replaced_at if job.round > 0 else job.launched_at
        overdue = since is not None and self.launch_deadline_s is not None and \
            self.clock() - since > self.launch_deadline_s
        checked_in = self.store.checked_in([job]).get(job.id, set()) if overdue else None
        gang = gang_state(job, nodes, noticed, report, checked_in)
        if gang.failed:
            for node in gang.alive:  # idempotent: again each pass until they are gone
                self.provider.terminate(node.node_id)
            return False
        if gang.finishing and job.round > 0 and job.samples_done >= job.spec.work_samples and \
                gang.finished - self.store.checked_in([job]).get(job.id, set()):
            # The work is done, and a rank that finished it never came to the round the others
            # wait in (a stand-in launched for a lost peer): that group cannot form. The ranks
            # still up have nothing left to do, and the job settles once they are gone.
            for node in gang.alive:
                self.provider.terminate(node.node_id)
            return False
        if gang.finishing or not gang.alive or not gang.lost:
            return False
        decision, why = self._decide(job, len(gang.lost))
        plan = Plan()
        preempted = bool(gang.warned or report.notices)
        if preempted:
            self._preempted(plan, job)
        what = f"node(s) of rank {', '.join(map(str, gang.lost))} lost"
        if decision is Recovery.REPLACE:
            round_ = transitions.replacing_nodes(
                plan, job, ranks=gang.lost, alive=[n.node_id for n in gang.alive],
                reason=f"{what}; replacing them in {job.pool}", recovery=decision.value,
                fence=fence, preempted=preempted)
            plan.add_intent(Intent(kind=IntentKind.REPLACE, job_id=job.id, fence=fence,
                                   attempt=job.attempt, gpus=job.gpus,
                                   batch_size=job.batch_size, pool=job.pool, ranks=gang.lost,
                                   round=round_))
            log.info("job %s: %s; replacing them (round %d)", job.id, what, round_)
        else:  # the actuator stops every node of the job (an outbox intent: replayed on crash)
            transitions.stopping(
                plan, job, event="nodes-lost", reason=f"{what}; moving the job{why}",
                data={"ranks": gang.lost, "recovery": decision.value, "replaced": job.round},
                fence=fence, preempted=preempted)
            plan.add_intent(Intent(kind=IntentKind.SUSPEND, job_id=job.id, fence=fence,
                                   attempt=job.attempt, reason="nodes lost"))
        self.store.apply(plan, fence=fence)
        return True

    def _decide(self, job: JobRecord, lost: int) -> tuple[Recovery, str]:
        """``recover_lost_nodes`` for the job's pool now, and why it moves when it does."""
        if job.round >= self.max_failures:  # a gang that keeps losing nodes here goes elsewhere
            return Recovery.MIGRATE, f" (nodes replaced {job.round} times in this attempt)"
        pool = next((p for p in self.store.pools() if p.id == job.pool), None)
        now = time.time()
        blocklist = self.store.blocklist(self.blocklist_decay_s, self.refusal_decay_s)[0]
        decision = recover_lost_nodes(
            job.nodes, lost, elastic=False,
            # agents reach the rendezvous, and the backend can stop or add one node alone
            can_rejoin=self.replace_lost_nodes and
            self.provider.for_cloud(_cloud(job)).separable_nodes,
            replacement_available=pool is not None and pool.capacity > 0
            and not blocklist.is_refused(refusal_key(pool.id), now),
            location_blocked=pool is not None
            and any(blocklist.is_blocked(k, now) for k in location_keys(pool)))
        return decision, ""

    def _preempted(self, plan: Plan, job: JobRecord) -> None:
        """A preemption of ``job``: counted against its pool and its spot location blocked, in
        ``plan`` (the job's own count the caller changes)."""
        _count_preemption(plan, job)
        self._block(plan, job)

    def _never_reported(self, job: JobRecord, nodes: dict[str, Node],
                        report: AgentReport) -> bool:
        """A running job on cloud VMs whose agent sent no heartbeat within the launch deadline:
        the image, the start script or the network is broken, and the VM bills on."""
        return self._silent(job, report) and \
            any(self.provider.outlives_agent(node) for node in _live(job, nodes))

    def _silent(self, job: JobRecord, report: AgentReport) -> bool:
        """A running job whose agent has not reported within the launch deadline."""
        return self.launch_deadline_s is not None and job.state is JobState.RUNNING and \
            report.first_beat is None and job.launched_at is not None and \
            self.clock() - job.launched_at > self.launch_deadline_s

    def _silent_reason(self) -> str:
        return (f"no heartbeat from the agent within {self.launch_deadline_s:g} s of launch; "
                "nodes terminated, job requeued")

    def _abandon(self, job: JobRecord, nodes: dict[str, Node], fence: int) -> None:
        """Terminate the silent nodes, then requeue the job, counting a failure so a launch
        that never comes up is not retried forever. Terminating first: a terminate that fails
        is retried next pass; should the record fail, the next pass finds the nodes gone and
        settles the job as the same failure (:meth:`_settle`)."""
        for node in _live(job, nodes):
            log.warning("job %s: no heartbeat from %s within %g s of launch; terminating it",
                        job.id, node.node_id, self.launch_deadline_s)
            self.provider.terminate(node.node_id)
        plan = Plan()
        transitions.stopping(
            plan, job, event="launch-deadline", reason=self._silent_reason(),
            data={"nodes": job.node_ids, "deadline_s": self.launch_deadline_s}, fence=fence,
            failed=True)
        self.store.apply(plan, fence=fence)

    def _block(self, plan: Plan, job: JobRecord) -> None:
        """Record a spot reclaim in the stored blocklist (``policies.migration.mark_reclaimed``:
        the location marked preempted, a pool under reclaim refused) and the pool's last early
        reclaim, in the same atomic step as the job's change."""
        pools = {p.id: p for p in self.store.pools()}
        pool = pools.get(job.pool or "")
        if pool is None or pool.market is not Market.SPOT:
            return
        now = time.time()
        blocklist, read = self.store.blocklist(self.blocklist_decay_s, self.refusal_decay_s)
        spot = [k for p in pools.values() if p.market is Market.SPOT for k in location_keys(p)]
        blocklist = expire(register(blocklist, spot), now)
        ran = None if job.launched_at is None else now - job.launched_at
        key = f"{QUICK_RECLAIM_KEY}:{pool.id}"
        last = None if ran is None else self.store.r.get(f"{self.store.p}{key}")
        got = mark_reclaimed(blocklist, pool, now, ran, None if last is None else float(last),
                             self.quick_reclaim_s)
        if got.early:
            plan.put(key, repr(now), expect=last)
        plan.set_blocklist(got.blocklist, read=read)
        where = location_keys(pool)[-1]
        # "blocked" is False when SpotHedge's rule reset every mark (fewer than two active)
        plan.event("location-blocked", job.id, {
            "location": where, "blocked": where in got.blocklist.preempted,
            "decay_s": got.blocklist.decay_s, "active": got.blocklist.active(now),
            "backoff_s": got.blocklist.refusal_decay_s if got.backoff else None})

    def _settle(self, job: JobRecord, nodes: list[Node | None], fence: int,
                preempted: bool, report: AgentReport) -> bool:
        """If every node of the job is gone, record how it ended. True when settled."""
        if any(n is not None and n.state is not NodeState.TERMINATED for n in nodes):
            return False
        codes = _exit_codes(job, nodes, report)
        known = max((n.ended_at.timestamp() for n in nodes if n and n.ended_at), default=None)
        ended = time.time() if known is None else known
        unreported = self.final_report_wait_s is not None and 0 not in report.exits
        if _finished(job, codes) and unreported and known is not None and \
                self.clock() - known < self.final_report_wait_s:  # type: ignore[operator]
            return False  # the final report, with the last progress, may still come
        plan = Plan()
        event, preempted_now, failed = None, False, False
        if _finished(job, codes):
            state, reason = JobState.COMPLETED, "finished"
            if unreported:
                log.warning("job %s finished, but its agent's final report never came: its "
                            "progress is the last one reported", job.id)
                reason = "finished (no final report from the agent: progress as last reported)"
        elif job.cancel_requested:
            state, reason = JobState.CANCELLED, "cancelled by user"
        elif preempted and job.state is JobState.RUNNING:  # ended before we saw the notice
            state, reason, event = JobState.SUSPENDED, "spot capacity reclaimed", "preempted"
            preempted_now = True
            self._preempted(plan, job)
        elif job.state is JobState.SUSPENDING and job.failures > self.max_failures:
            state, reason = JobState.FAILED, job.reason or "failed"  # e.g. never reported
        elif (codes and all(c == EXIT_STOPPED for c in codes)) or \
                job.state is JobState.SUSPENDING:
            state, reason = JobState.SUSPENDED, job.reason or "checkpointed"
        elif not codes and self._silent(job, report):
            # its nodes went (``_abandon`` terminated them, its record did not land): a
            # launch that never came up, not a reclaim
            failed = True
            state = JobState.FAILED if job.failures + 1 > self.max_failures else \
                JobState.SUSPENDED
            reason = self._silent_reason()
        elif not codes or (job.nodes > 1 and all(c in (None, EXIT_STOPPED) for c in codes)):
            # no report at all, or a gang whose ranks checkpointed but for those that were lost
            state, reason = JobState.SUSPENDED, "node lost"
            preempted_now = True
            _count_preemption(plan, job)
        else:
            failed = True
            state = JobState.FAILED if job.failures + 1 > self.max_failures else \
                JobState.SUSPENDED
            bad = next((c for c in codes if c not in (EXIT_FINISHED, EXIT_STOPPED)), codes[0])
            reason = f"command exited {bad} (failure {job.failures + 1})"
            cause = self.store.agent_error(job)  # named by the job's runtime, if it could
            if cause:
                reason = secrets.reason(f"{cause}; {reason}")
        transitions.ended(plan, job, state, reason=reason, exit_code=codes[0] if codes else None,
                          fence=fence, event=event, preempted=preempted_now, failed=failed)
        open_ = [p for p in self.store.placements(job.id) if p.end is None]
        if open_:
            closed = open_[-1].model_copy(update={"end": ended})
            plan.close_placement(closed)
            nodes_held = max(1, job.nodes)
            plan.add_node_hours(closed.pool, (ended - closed.start) / 3600 * nodes_held)
        plan.wake = True
        self.store.apply(plan, fence=fence)
        return True

    def _copy_logs(self, job: JobRecord, nodes: list[Node]) -> None:
        for node in nodes:
            key = f"{self.store.p}logoffset:{node.node_id}"
            offset = int(self.store.r.get(key) or 0)
            lines, new = self.provider.read_log(node.node_id, offset)
            if lines:
                self.store.append_log(job.id, lines)
                self.store.r.set(key, new, ex=7 * 86400)


def _claims(job: JobRecord, node: Node) -> bool:
    """Whether ``node`` is ``job``'s: one it records, one of its launch not yet recorded, or a
    stand-in for a lost rank launched in its current rendezvous round (``IntentKind.REPLACE``).
    A node it lost and replaced is no longer claimed: the orphan sweep stops or forgets it."""
    if node.node_id in job.node_ids:
        return True
    key, launch = node.idempotency_key, job.launch_key
    if key is None or launch is None:
        return False
    if job.state is JobState.LAUNCHING:
        return key == launch
    return job.round > 0 and key == replacement_key(launch, node.rank or 0, job.round)


def _exit_codes(job: JobRecord, nodes: list[Node | None],
                report: AgentReport) -> list[int | None]:
    """How the job's command ended on each node: the provider's exit code where it knows one,
    else the agent's report (a VM does not tell). A gang is judged rank by rank, the nodes the
    inventory no longer lists (deleted VMs) by the reports of the ranks no listed node holds; a
    rank with no report was lost (None). A single node without a record takes its agent's."""
    if job.nodes == 1:
        agent = report.exit_code
        return [agent if n is None or n.exit_code is None else n.exit_code
                for n in nodes if n is not None or agent is not None]
    by_rank = {n.rank or 0: n for n in nodes if n is not None}
    return [n.exit_code if (n := by_rank.get(r)) is not None and n.exit_code is not None
            else report.exits.get(r) for r in range(job.nodes)]


def _finished(job: JobRecord, codes: list[int | None]) -> bool:
    """The command finished on every node; a gang's when its training loop finished on some
    rank and no rank failed (the others stopped, or were gone, as it ended)."""
    if job.nodes > 1:
        return EXIT_FINISHED in codes and \
            all(c in (None, EXIT_FINISHED, EXIT_STOPPED) for c in codes)
    return bool(codes) and all(c == EXIT_FINISHED for c in codes)


def _cloud(job: JobRecord) -> str:
    return (job.pool or "").split(":", 1)[0]


def _live(job: JobRecord, nodes: dict[str, Node]) -> list[Node]:
    """The job's nodes the inventory has and that have not ended."""
    return [n for i in job.node_ids if (n := nodes.get(i)) is not None
            and n.state is not NodeState.TERMINATED]


def _count_preemption(plan: Plan, job: JobRecord) -> None:
    """The job lost its nodes to a preemption: count it against its pool (risk for placement)."""
    if job.pool:
        plan.count_preemption(job.pool)

