"""End to end: SkyPilot task YAMLs run as SkyPilot runs them, through the real broker, API and
agent on local nodes: SkyPilot's distributed-pytorch example (torchrun over the SKYPILOT_*
variables, a tiny gloo all-reduce on CPU) on two nodes, setup and run once per node with the
node's rank; a CPU-only task (no accelerators) through ``fleet launch`` on two nodes of the
fleet's CPU region, never its GPUs, with no GPU in its environment (redis, uvicorn, torch)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.models import JobRecord, JobState
from broker.runtime.agent import free_port
from broker.server import Broker
from broker.spec import parse_spec_text
from broker.store import Store
from tests.builders import fleet
from tests.live_broker import cli_env, launch, live_broker
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 10
regions:
  - {cloud: aws, region: us-east-1, price_per_gpu_hour: 0.5, gpus: 2, nodes: 2}
  - {region: lab, cpu_nodes: 2, cpus_per_node: 2, price_per_node_hour: 0}
"""
CPU_POOL = "local:lab:on-demand:CPU"
# Each of the torchrun's processes adds its global rank + 1: 1 + 2 = 3 on every rank.
ALL_REDUCE = """
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
with open(out, "w") as f:
    f.write('{"world": %d, "sum": %g}' % (dist.get_world_size(), t.item()))
dist.destroy_process_group()
"""
# SkyPilot's examples/distributed-pytorch task, its training script swapped for the all-reduce
# and its fixed master port for a free one.
TASK = """
name: minGPT-ddp
resources:
  accelerators: T4:1
num_nodes: 2
envs:
  OUT: {out}
setup: |
  echo "$SKYPILOT_SETUP_NODE_RANK" >> "$OUT/setup-$SKYPILOT_SETUP_NODE_RANK"
run: |
  echo "$SKYPILOT_NODE_RANK" >> "$OUT/run-$SKYPILOT_NODE_RANK"
  env | grep '^SKYPILOT_' | grep -v NODE_IPS > "$OUT/env-$SKYPILOT_NODE_RANK"
  echo "$SKYPILOT_NODE_IPS" > "$OUT/ips-$SKYPILOT_NODE_RANK"
  MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)
  torchrun \\
    --nnodes=$SKYPILOT_NUM_NODES \\
    --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE \\
    --master_addr=$MASTER_ADDR \\
    --node_rank=${{SKYPILOT_NODE_RANK}} \\
    --master_port={port} \\
    {script} "$OUT"
"""

# A SkyPilot CPU task: no accelerators, so a CPU node's 2 vCPUs or more on each of 2 nodes.
CPU_TASK = """
name: cpu-echo
resources:
  cpus: 2+
num_nodes: 2
run: |
  echo "node $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES," \
    "gpus $SKYPILOT_NUM_GPUS_PER_NODE, cuda [$CUDA_VISIBLE_DEVICES]"
"""


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch) as running:
        yield running


def finished(store: Store, job_id: str, timeout: float = 120) -> JobRecord:
    deadline = time.monotonic() + timeout
    while (job := store.get_job(job_id)) is None or not job.state.terminal:
        assert time.monotonic() < deadline, f"not finished: {job}"
        time.sleep(0.3)
    return job


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.mark.slow
def test_distributed_pytorch_example_runs_once_per_node_with_skypilot_env(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    parsed = parse_spec_text(TASK.format(out=out, port=free_port(), script=script))
    assert (parsed.spec.nodes, parsed.spec.run_per_node) == (2, True)
    job = store.submit(parsed.spec, team="ml")
    done = finished(store, job.id)
    logs = "\n".join(store.read_logs(job.id, limit=100_000)[0])
    assert done.state is JobState.COMPLETED, logs[-3000:]
    assert done.nodes == 2
    # setup and run once per node, each with its own rank
    for rank in (0, 1):
        assert (out / f"setup-{rank}").read_text() == f"{rank}\n"
        assert (out / f"run-{rank}").read_text() == f"{rank}\n"
        env = env_file(out / f"env-{rank}")
        assert env["SKYPILOT_NUM_NODES"] == "2" and env["SKYPILOT_NUM_GPUS_PER_NODE"] == "1"
        assert env["SKYPILOT_NODE_RANK"] == str(rank)
        assert env["SKYPILOT_TASK_ID"].endswith(f"_fleet-{job.id}_1")
        info = json.loads(env["SKYPILOT_CLUSTER_INFO"])
        assert (info["cloud"], info["region"]) == ("aws", "us-east-1")
        ips = (out / f"ips-{rank}").read_text().splitlines()
        assert len(ips) == 2 and all(ips)
    assert sorted(p.name for p in out.glob("setup-*")) == ["setup-0", "setup-1"]
    # one torchrun per node, one process per GPU: a world of two that all-reduced together
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"world": 2, "sum": 3.0}] * 2


@pytest.mark.slow
def test_a_cpu_only_task_runs_on_the_cpu_nodes_through_fleet_launch(
        broker: Broker, store: Store, tmp_path: Path) -> None:
    task = tmp_path / "cpu.yaml"
    task.write_text(CPU_TASK)
    env = cli_env(broker, tmp_path)
    code, out, err = fleet(env, "launch", "--dryrun", str(task))
    said = " ".join(out.split())
    assert code == 0, err
    assert "CPU nodes (no GPU) cpus 2+" in said and "nodes 2 (setup and run once per node)" in said
    assert CPU_POOL in said and "T4" not in said  # the preview offers the CPU nodes only
    job_id, said = launch(env, task)
    assert "2 CPU nodes, no GPU" in said, said
    done = finished(store, job_id)
    logs = store.read_logs(job_id, limit=100_000)[0]
    assert done.state is JobState.COMPLETED, logs[-50:]
    assert (done.pool, done.nodes, done.gpus) == (CPU_POOL, 2, 2)
    for rank in (0, 1):
        assert f"[rank {rank}] node {rank} of 2, gpus 0, cuda []" in logs, logs[-50:]
