"""FleetBroker's job-side runtime: the elastic PyTorch library and the node agent.

Importing this package needs neither torch nor the control plane (fastapi, redis, typer); the
torch-based names below load on first use.

Library (two lines in a plain DDP script)::

    import broker.runtime as fleet
    loader = fleet.elastic(model, optimizer, dataset, batch_size=B, steps=S, scheduler=sched)
    for x, y in loader:                      # the loop body stays as it was
        ...

It runs under the agent, under ``torchrun --standalone --nproc-per-node K`` (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) and as a single process. Arguments win over the environment.
``model`` is a DDP model, a model sharded with FSDP2's ``fully_shard``, or a plain module.

Contract between the broker and the agent
-----------------------------------------
``python -m broker.runtime.agent [options] -- CMD ARGS...`` runs FLEET_NPROC copies of CMD on this
node. Environment it reads (an option of the same name in lower-case, e.g. ``--nproc``, wins):

=========================  ====================================================================
FLEET_JOB_ID               job id (default ``local``)
FLEET_ATTEMPT              attempt number, int (default 0)
FLEET_NPROC                worker processes on this node (= GPUs or virtual GPUs), default 1
FLEET_NNODES               nodes in the job (default 1)
FLEET_NODE_RANK            this node's rank (default 0)
FLEET_MASTER_ADDR          rendezvous address (default 127.0.0.1; with NNODES > 1 and unset, the
                           master comes from the broker's rendezvous, below)
FLEET_MASTER_PORT          rendezvous port (default: a free port; required with MASTER_ADDR when
                           NNODES > 1; in rendezvous mode rank 0 picks a free one each round)
FLEET_ROUND                the rendezvous round this node starts in (default 0; a node launched
                           to replace a lost one starts in the round the broker bumped to)
FLEET_NODE_ADDR            the address rank 0 registers at the rendezvous (default: this
                           machine's address on the route to FLEET_BROKER_URL's host)
FLEET_RENDEZVOUS_POLL      seconds between rendezvous polls (default 1)
FLEET_RENDEZVOUS_TIMEOUT   seconds a node waits for a round's group to form (default 1800, above
                           the broker's launch deadline: the broker decides that a stand-in is
                           not coming and replaces it), then fails; anew for each round
FLEET_LAUNCH_KEY           the node's idempotency key (the launch's, or a stand-in's
                           ``<launch key>~r<rank>.<round>``), sent as ``launch_key`` with every
                           heartbeat and rendezvous visit
FLEET_REJOIN_TIMEOUT       seconds a node whose workers ended by themselves (a lost peer?) waits
                           for the broker's next round before it exits (default 120)
FLEET_GLOBAL_BATCH_SIZE    the global batch the allocator chose
FLEET_BATCH_MODE           ``fixed`` (gradient accumulation keeps the job's batch) or ``elastic``
FLEET_CHECKPOINT_URI       local dir, ``file://``, ``s3://bucket/prefix`` or another fsspec URI
FLEET_BROKER_URL           optional; heartbeats go to ``POST {url}/v1/agent/heartbeat``,
                           rendezvous visits to ``POST {url}/v1/agent/rendezvous``; several
                           URLs, comma-separated (every broker replica's, as a launch lists
                           them): a report goes to the one that last took one, else the next
FLEET_REPORT_TIMEOUT       seconds the final report is tried (default 1800)
FLEET_REPORT_MAX_WAIT      most seconds between two tries of it (default 15; backoff from 0.5)
FLEET_AGENT_TOKEN_FILE     a 0600 file holding the attempt token (read, then deleted, at start;
                           never passed on): ``Authorization: Bearer {token}`` on heartbeats
                           and rendezvous visits. FLEET_AGENT_TOKEN_FD: a pipe holding it (the
                           local provider's). FLEET_AGENT_TOKEN: the token itself (by hand)
FLEET_SECRET_ENVS          the job's secret names, comma-separated, whose values the launch
                           does not carry (a cloud's start script, which the cloud keeps in
                           clear): before any of the job's code runs the agent fetches them with
                           ``POST {url}/v1/agent/secrets`` and its token, tried as the final
                           report is, into its workers' environment; failing that, the launch
                           fails with ``could not fetch the job's secrets from the broker: ...``
FLEET_HEARTBEAT_INTERVAL   seconds between heartbeats (default 5)
FLEET_GRACE_PERIOD         seconds the workers get to checkpoint and exit after a stop (default 25)
FLEET_NOTICE_AWS_URL       full URL polled for the AWS notice, e.g.
                           ``http://169.254.169.254/latest/meta-data/spot/instance-action``
                           (404 = none; 200 with JSON = notice)
FLEET_NOTICE_GCP_URL       e.g. ``http://metadata.google.internal/computeMetadata/v1/instance/preempted``
                           (header ``Metadata-Flavor: Google``; body ``TRUE`` = notice)
FLEET_NOTICE_AZURE_URL     e.g. ``http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01``
                           (header ``Metadata: true``; ``Events[].EventType == "Preempt"`` = notice)
FLEET_NOTICE_INTERVAL      seconds between notice polls (default 5)
=========================  ====================================================================

Optional knobs the library reads: FLEET_CHECKPOINT_EVERY_STEPS, FLEET_CHECKPOINT_EVERY_SECONDS,
FLEET_CHECKPOINT_KEEP (default 3), FLEET_PROGRESS_INTERVAL (seconds, default 1),
FLEET_CHECKPOINT_CACHE (local staging folder for remote stores).

Each worker gets torchrun's variables (RANK = NODE_RANK * NPROC + LOCAL_RANK, WORLD_SIZE = NNODES *
NPROC, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the FLEET_* variables (FLEET_ROUND
included), and FLEET_PROGRESS_FILE (a file in the agent's temp folder unless the agent's env
already names one). Rank 0 writes there, as JSON, ``{step, samples_done, samples_per_sec,
global_batch_size, world_size, checkpoint_step, checkpoint_bytes, checkpoint_seconds}``
(checkpoint_bytes: the size of that checkpoint, every rank's files and the manifest; null when
unknown; checkpoint_seconds: how long writing and committing it took, null for one loaded). Every
FLEET_HEARTBEAT_INTERVAL the agent sends ``{job_id, attempt, node_rank, round, state, launch_key}``
(round: the round the node is in, joined or still forming) and the progress file's ``step,
samples_done, samples_per_sec, world_size, global_batch_size, checkpoint_step, checkpoint_bytes,
checkpoint_seconds`` that it has (none before the file exists: the broker keeps what it had),
and ``resumable``: true once the file exists (false in it: checkpoints are off), false once the
workers ran FLEET_PROGRESS_GRACE seconds (default 120) or ended without writing it (a plain
script, which a move restarts from the beginning; the scheduler prices that), absent before,
where state is ``running``, ``stopping`` or ``rejoining``. A last heartbeat says ``finished``,
``stopped`` or ``failed`` and carries ``exit_code`` (a cloud VM does not tell the broker how the
command ended), the last progress and, after a failure, ``error``: what a worker's runtime wrote
to FLEET_ERROR_FILE (its cause, e.g. ``checkpoint write failed: no space left on device (ENOSPC)``;
``broker.runtime.failure``); it is tried at every broker URL with exponential backoff until one
takes it, for up to FLEET_REPORT_TIMEOUT (no answer, a 5xx or a 429 is tried again; any other
answer, such as a 404 for a job that is gone, ends the tries). The broker takes progress from node
rank 0 of the job's current round only (its rank-0 worker writes it), never less than it already
took from that attempt and round and none after that node's final report; a node's exit code or
notice only for a round the job reached and a rank it has.
Without the file, a script that commits its own DCP checkpoints under FLEET_CHECKPOINT_URI (a
folder whose name ends in its step and holds ``.metadata``; ``broker.runtime.plain_checkpoints``)
is reported from node rank 0 with the newest one's ``checkpoint_step``, ``checkpoint_bytes``,
``checkpoint_age_seconds`` (since the agent first saw it committed) and ``resumable: true``; the
broker keeps its commit time (``JobRecord.checkpoint_at``) and prices a restart as the work since
then, as the script takes no checkpoint at a stop.
Once the node has a preemption notice every heartbeat carries it as ``notice``
(the first is sent at once), so the broker blocks the location. A response
``{"action": "checkpoint-exit"}`` stops the job; its ``round`` is the job's rendezvous round.
``{"action": "resize", "nproc": N}`` runs N workers on the node from now on: in place where the
workers run this library (new workers join the running group, leaving ones exit 75; the order
goes to FLEET_RESIZE_FILE, new workers get FLEET_RESIZE_JOIN and FLEET_RESIZE_READY), else, or
when that fails or takes over FLEET_RESIZE_TIMEOUT (default 60 s), by restarting the workers from
a checkpoint (docs/runtime.md, "Resizing in place").

Rendezvous (FLEET_NNODES > 1, no FLEET_MASTER_ADDR, a FLEET_BROKER_URL): nobody knows the master at
launch, so each round every agent checks in with ``POST /v1/agent/rendezvous {job_id, attempt,
round, node_rank, addr, launch_key}``, rank 0 with ``host:port`` (FLEET_NODE_ADDR or its address
toward the broker, a free port), and polls that endpoint (FLEET_RENDEZVOUS_POLL) until the reply
``{round, nnodes, master, action}`` names the master of its round. The broker names it only once
every node of the round checked in, a barrier: no worker starts torch's init (whose own timeout is
short) while a node of the group, such as a lost node's stand-in, is still booting, and the master
it names never changes. A node counts only with its rank's current key: one the broker replaced (a
stand-in that came too late, a partitioned node) is told ``checkpoint-exit`` by the rendezvous and
by heartbeats, which record nothing from it; so is an agent without a key. A reply with a
higher round moves the agent there first; no group within FLEET_RENDEZVOUS_TIMEOUT: exit 1;
``checkpoint-exit``: exit 75.
A multi-node job survives a lost node: the broker launches a replacement of the same rank and
bumps the round. A heartbeat reply whose ``round`` is above the agent's stops its workers (as a
stop does, without stopping the agent) and the agent re-forms the group in the new round with new
workers on the same node (they resume from the latest checkpoint). Workers that end by themselves
without finishing (a peer went away) make the agent send a ``rejoining`` heartbeat and wait up to
FLEET_REJOIN_TIMEOUT for a newer round; without one it exits with the workers' code (so a genuine
crash of the script ends after that wait), and a ``checkpoint-exit`` meanwhile ends it too.

A stop (SIGTERM or SIGINT to the agent, a preemption notice, or the broker's ``checkpoint-exit``)
sends SIGTERM to every worker; the library checkpoints at a step boundary (in a group, the one after
the next) and exits with 75.
SIGUSR1 to the agent asks for a checkpoint without stopping. Workers still running after the grace
period are killed. Agent exit codes: 0 = job finished; 75 = stopped cleanly after a checkpoint
(resume later, with any world size); 2 = bad options; anything else = failure. Worker output is
streamed to the agent's stdout/stderr, each line prefixed with ``[rank N]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.protocol import EXIT_FINISHED, EXIT_STOPPED, Env
from broker.runtime.assignment import Assignment
from broker.runtime.checkpoint_stores import open_store

if TYPE_CHECKING:
    from broker.runtime.trainer import Trainer, elastic, from_args

__all__ = [
    "EXIT_FINISHED", "EXIT_STOPPED", "Assignment", "Trainer", "elastic", "from_args", "open_store",
]


# A worker the agent starts to join a running group (an in-place grow) says, once its imports are
# done, that the others may stop to re-form the group: they then wait for its last set-up only.
# Its imports include the trainer's and torch._dynamo, which DDP's constructor imports on first
# use: seconds each on a busy node, paid here while the others still train.
if _ready := os.environ.get(Env.RESIZE_READY):
    import torch._dynamo  # noqa: F401

    import broker.runtime.trainer  # noqa: F401

    Path(_ready).touch()


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "elastic", "from_args"):
        from broker.runtime import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'broker.runtime' has no attribute {name!r}")
