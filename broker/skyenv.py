"""SkyPilot's task environment for a job written as a SkyPilot task (``JobSpec.run_per_node``).

SkyPilot runs a task's ``setup`` and ``run`` once per node with ``SKYPILOT_*`` variables that
name the node's rank, every node's IP, the node and GPU counts, a task id and the cluster (see
SkyPilot's "Environment variables and secrets" docs). What the broker knows at launch is set
here; each node's rank and the nodes' IPs are only known on the nodes, so the agent adds those
(``broker.runtime.agent``, FLEET_PER_NODE).
"""

from __future__ import annotations

import json
import time

from broker.models import JobRecord
from broker.protocol import Env
from policies.models import Pool

# The agent's switch: one worker process per node, with the node's SKYPILOT_* rank and IPs.
PER_NODE_ENV = Env.PER_NODE


def task_id(job: JobRecord) -> str:
    """SkyPilot's ``sky-<launch time>_<cluster>_<job number>``, the same for every attempt of the
    job (a script keys its experiment tracking on it, so a resumed job continues the same run)."""
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime(job.submitted_at))
    micros = int((job.submitted_at % 1) * 1_000_000)
    return f"sky-{stamp}-{micros:06d}_{cluster_name(job)}_1"


def cluster_name(job: JobRecord) -> str:
    return f"fleet-{job.id}"


def task_env(job: JobRecord, pool: Pool, *, nodes: int, gpus_per_node: int,
             zone: str | None) -> dict[str, str]:
    """The launch-wide SKYPILOT_* variables (and the agent's per-node switch)."""
    info = {"cluster_name": cluster_name(job), "cloud": pool.cloud, "region": pool.region,
            "zone": zone}
    return {
        PER_NODE_ENV: "1",
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node),
        "SKYPILOT_TASK_ID": task_id(job),
        "SKYPILOT_CLUSTER_INFO": json.dumps(info),
    }
