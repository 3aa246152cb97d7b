"""End to end: a two-node job trains with real PyTorch (gloo) across two local nodes that meet
at the broker's rendezvous; one node dies, the broker launches a stand-in of its rank in the same
pool, and the survivor's agent re-forms the group with it: the job finishes in its first attempt,
its surviving node never restarted, resuming from its last checkpoint (redis, uvicorn, torch)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.models import JobState
from broker.server import Broker
from broker.spec import parse_spec_text
from broker.store import Store
from providers.base import NodeState
from providers.local.provider import LocalProvider
from tests.live_broker import live_broker
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 10
regions:
  - {cloud: aws, region: us-east-1, market: spot, price_per_gpu_hour: 0.35, gpus: 2, nodes: 2}
"""
# 600 steps: long enough that the lost node goes mid-run even on an idle machine
SPEC = """
name: gang
run: python examples/train_digits.py --steps 600 --batch-size 32 --batch-mode fixed
gpus: 2
batch_size: {min: 32, max: 32}
work: {steps: 600}
checkpoint: {interval: 5steps}
"""


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch) as running:
        yield running


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dies", "reclaimed"])
def test_a_lost_node_is_replaced_and_the_survivor_resumes_with_it(
        broker: Broker, store: Store, loss: str) -> None:
    """``dies``: the machine goes at once; the survivor's worker fails on the broken collective
    and the group resumes from the last periodic checkpoint. ``reclaimed``: a spot notice for
    that node; every rank checkpoints the step it reached and the group resumes from exactly
    that step: no work lost."""
    local = broker.provider.for_cloud("aws")
    assert isinstance(local, LocalProvider)
    job = store.submit(parse_spec_text(SPEC).spec, team="ml")
    deadline = time.monotonic() + 120
    while (store.get_job(job.id).checkpoint_step or 0) < 10:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"no checkpoint: {store.get_job(job.id)}"
        time.sleep(0.2)
    running = store.get_job(job.id)
    assert running is not None and (running.state, running.nodes) == (JobState.RUNNING, 2)
    ranks = {n.rank: n for n in local.nodes() if n.node_id in running.node_ids}
    survivor, doomed = ranks[0], ranks[1]
    # what `fleet chaos node JOB --rank 1 [--kill]` asks the leader to do
    store.request_command("node", job_id=job.id, rank=1,
                          how="kill" if loss == "dies" else "reclaim")
    while (done := store.get_job(job.id)).state is not JobState.COMPLETED:  # type: ignore[union-attr]
        assert done is not None and not done.state.terminal, done
        assert time.monotonic() < deadline + 120, f"not finished: {done}"
        time.sleep(0.3)
    assert (done.attempt, done.round, done.failures) == (running.attempt, 1, 0)
    assert survivor.node_id in done.node_ids and doomed.node_id not in done.node_ids
    kept = {n.node_id: n for n in local.nodes()}.get(survivor.node_id)
    assert kept is None or kept.launched_at == survivor.launched_at  # never relaunched
    types = [e.type for e in store.events(job_id=job.id)]
    assert types.count("nodes-lost") == 1 and types.count("nodes-replaced") == 1
    assert types.count("node-killed" if loss == "dies" else "node-reclaimed") == 1
    assert "preempted" not in types and types.count("running") == 1
    assert done.preemptions == (loss == "reclaimed")
    lines = "\n".join(store.read_logs(job.id, limit=100_000)[0])
    assert "resumed from step" in lines, lines[-3000:]
    # one agent on the survivor across both rounds; rank 1's second agent is the stand-in's
    assert lines.count("node 0/2, 1 workers") == 1 and lines.count("node 1/2, 1 workers") == 2
    assert "round 1: node 0/2" in lines and "round 1: node 1/2" in lines
    if loss == "reclaimed":
        stopped = re.search(r"stop requested at step (\d+)", lines)
        assert stopped and f"resumed from step {stopped[1]} " in lines
    assert all(n.state is NodeState.TERMINATED for n in local.nodes()
               if n.node_id in done.node_ids)
