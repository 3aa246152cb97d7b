"""End to end: a running job that runs the runtime is shrunk on its node without a restart: the
broker resizes it in place for a newcomer, its agent hears ``resize`` in a heartbeat reply, and
the workers re-form the group at the new size in the same attempt (redis, uvicorn, torch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.models import JobState
from broker.scheduler import SchedulerConfig
from broker.server import Broker
from broker.spec import parse_spec_text
from broker.store import Store
from tests.live_broker import live_broker
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 10
regions:
  - {region: home, price_per_gpu_hour: 0.5, gpus: 2}
"""
LONG = """
name: long
run: python examples/train_digits.py --steps 100000 --batch-size 24 --batch-mode fixed
gpus: {min: 1, max: 2}
batch_size: {min: 24, max: 24}
work: {steps: 100000}
"""
NEWCOMER = """
name: newcomer
run: sleep 600
gpus: 1
batch_size: 32
work: {steps: 1000}
priority: 100
"""
RESCALE_AFTER_S = 45


@pytest.fixture
def broker(redis_server: RedisServer, store: Store, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    # a loaded machine can measure two CPU workers no faster than one, and the round would then
    # shrink the job on its own before the newcomer arrives: the interval keeps it at 2 until then
    config = SchedulerConfig(min_rescale_interval_s=RESCALE_AFTER_S)
    with live_broker(redis_server.url, store, tmp_path, FLEET, monkeypatch, config) as running:
        yield running


def wait(what: str, check, timeout: float = 180, broker: Broker | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}\n{story(broker)}"
        time.sleep(0.2)


def story(broker: Broker | None) -> str:
    """The jobs, their events and their nodes' output: what a timed-out wait saw."""
    if broker is None:
        return ""
    out = []
    for job in broker.store.list_jobs():
        out.append(f"{job.id}: {job.state.value} gpus={job.gpus} attempt={job.attempt} "
                   f"samples={job.samples_done} reason={job.reason}")
        out += [f"  {e.type} {e.data}" for e in broker.store.events(job_id=job.id)]
    for node in broker.provider.nodes():
        lines, _ = broker.provider.read_log(node.node_id)
        out.append(f"node {node.node_id} {node.state.value}:")
        out += [f"  | {line}" for line in lines[-30:]]
    return "\n".join(out)


@pytest.mark.slow
def test_a_job_is_shrunk_in_place_for_a_newcomer(broker: Broker, store: Store) -> None:
    job = store.submit(parse_spec_text(LONG).spec, team="ml")
    newcomer = None
    try:
        wait("the job never trained on 2 GPUs", lambda: (
            (j := store.get_job(job.id)) is not None and j.state is JobState.RUNNING
            and j.gpus == 2 and j.samples_done > 0), broker=broker)
        attempt = store.get_job(job.id).attempt  # type: ignore[union-attr]
        newcomer = store.submit(parse_spec_text(NEWCOMER).spec, team="ml")
        wait("the job was not resized in place", lambda: "resize-in-place" in [
            e.type for e in store.events(job_id=job.id)], broker=broker)
        shrunk = store.get_job(job.id)
        assert shrunk is not None and shrunk.gpus == 1 and shrunk.attempt == attempt
        assert shrunk.state is JobState.RUNNING
        # the GPU it gave up is free in the backend at once: the newcomer runs on it
        wait("the newcomer never ran", lambda: (
            (j := store.get_job(newcomer.id)) is not None
            and j.state is JobState.RUNNING), 60, broker)
        before = shrunk.samples_done
        # rank 0 reports world size 1 once the workers re-formed the group; training goes on
        wait("the workers did not re-form the group at 1", lambda: (
            (j := store.get_job(job.id)) is not None and j.samples_done > before
            and j.measured_gpus == 1), 120, broker)
        final = store.get_job(job.id)
        assert final is not None and final.attempt == attempt
        assert final.state is JobState.RUNNING
    finally:
        # the jobs end here, through the broker, so no job process outlives the test
        for one in filter(None, (job, newcomer)):
            store.request_cancel(one.id)
        for one in filter(None, (job, newcomer)):
            wait("a job did not end after its cancel", lambda one=one: (
                (j := store.get_job(one.id)) is not None and j.state.terminal), 120, broker)
