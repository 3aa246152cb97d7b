"""What became of a running multi-node job's nodes: which ranks are lost (gone, reclaimed, or a
stand-in that never came up), which live on, and whether a rank's command failed.

The reconciler reads this each pass and decides with ``policies.migration.recover_lost_nodes``:
stand-ins for the lost ranks while the survivors stay, or the whole job moves.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from broker.models import JobRecord
from broker.protocol import EXIT_FINISHED, EXIT_STOPPED
from broker.store import AgentReport
from providers.base import Node, NodeState


@dataclass(frozen=True)
class GangState:
    """``lost``: ranks to stand in for; ``alive``: the nodes that live on; ``warned``: the job's
    nodes under a preemption notice (reclaimed rather than lost); ``failed``: a rank's command
    ended with a failure (the job cannot go on, nothing is replaced); ``finished``: the ranks
    whose command ended successfully (the job is ending)."""

    lost: list[int]
    alive: list[Node]
    warned: frozenset[str]
    failed: bool
    finished: frozenset[int]

    @property
    def finishing(self) -> bool:
        return bool(self.finished)


def gang_state(job: JobRecord, nodes: Mapping[str, Node], noticed: Collection[str],
               report: AgentReport, checked_in: Collection[int] | None) -> GangState:
    """The job's nodes as the inventory and the agents (their exits and notices of this round)
    tell. ``checked_in``: when the job's stand-ins are overdue (their launch deadline passed),
    the ranks that came to the rendezvous this round; any other rank counts as lost."""
    mine = [n for i in job.node_ids if (n := nodes.get(i)) is not None]
    # A notice counts after its node is gone too: the node was reclaimed, not lost. A node
    # already stopping (PREEMPTING) is no survivor either.
    warned = frozenset(n.node_id for n in mine if n.node_id in noticed
                       or n.state is NodeState.PREEMPTING or (n.rank or 0) in report.notices)
    # How a reclaimed node's command ended says nothing of the job (killed after its grace).
    spared = {n.rank or 0 for n in mine if n.node_id in warned} | set(report.notices)
    ended = [*((n.rank or 0, n.exit_code) for n in mine
               if n.state is NodeState.TERMINATED and n.node_id not in warned),
             *((r, c) for r, c in report.exits.items() if r not in spared)]
    failed = any(c not in (None, EXIT_FINISHED, EXIT_STOPPED) for _, c in ended)
    finished = frozenset(r for r, c in ended if c == EXIT_FINISHED)
    alive = [n for n in mine if n.state is not NodeState.TERMINATED and n.node_id not in warned
             and (checked_in is None or (n.rank or 0) in checked_in)]
    known = {n.rank for n in alive if n.rank is not None}
    lost = sorted(set(range(job.nodes)) - known) if len(known) == len(alive) else []
    return GangState(lost, alive, warned, failed, finished)
