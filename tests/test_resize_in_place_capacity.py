"""A node shrunk in place gives its GPUs back to the backend in the same pass: the round's launch
of the newcomer that takes them is not refused for want of room, and a grow in place is counted
against the region so nothing is overcommitted. Real redis-server, real local-provider processes
(the jobs' commands sleep; the progress a runtime would report is recorded as its heartbeat)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.actuator import Actuator, ActuatorConfig
from broker.models import JobState
from broker.reconciler import Reconciler
from broker.scheduler import Scheduler, SchedulerConfig
from broker.store import Store
from providers.local.provider import LocalFleet, LocalProvider
from tests import builders

FLEET = LocalFleet.model_validate({"grace_period_s": 1.0, "regions": [
    {"cloud": "local", "region": "home", "market": "on-demand", "price_per_gpu_hour": 0.5,
     "gpus": 4}]})
POOL = "local:home:on-demand:T4"


class Loop:
    def __init__(self, store: Store, provider: LocalProvider) -> None:
        self.store, self.provider = store, provider
        self.reconciler = Reconciler(store, provider)
        self.actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
        self.scheduler = Scheduler(store, SchedulerConfig(min_rescale_interval_s=0))
        self.fence = store.acquire_lease("me", 600)

    def step(self) -> None:
        self.store.set_pools(self.provider.pools())
        self.reconciler.run(self.fence)
        self.scheduler.run_round(self.fence)
        self.actuator.run(self.fence)

    def until(self, what: str, check, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, what
            self.step()
            time.sleep(0.1)

    def running(self, job_id: str, gpus: int | None = None) -> bool:
        job = self.store.get_job(job_id)
        return job is not None and job.state is JobState.RUNNING and \
            (gpus is None or job.gpus == gpus)


@pytest.fixture
def loop(store: Store, tmp_path: Path) -> Iterator[Loop]:
    provider = LocalProvider(FLEET, tmp_path / "state", tmp_path)
    try:
        yield Loop(store, provider)
    finally:
        for node in provider.nodes():
            provider.terminate(node.node_id)


def report_progress(store: Store, job_id: str) -> None:
    """What the runtime's agent reports once the job trains: progress at its world size."""
    job = store.get_job(job_id)
    assert job is not None
    store.record_heartbeat(job.id, job.attempt, launch_key=job.launch_key, samples_done=640,
                           world_size=job.gpus, global_batch_size=job.batch_size)


def test_a_newcomer_launches_into_the_gpus_a_shrink_in_place_freed(loop: Loop) -> None:
    store = loop.store
    first = store.submit(builders.spec("first", run="sleep 60", gpus=(1, 4), batch=128,
                                       samples=10**9), team="t")
    loop.until("the first job never ran on all 4 GPUs", lambda: loop.running(first.id, 4))
    report_progress(store, first.id)
    newcomer = store.submit(builders.spec("newcomer", run="sleep 60", gpus=1, batch=32,
                                          samples=10**9, priority=100), team="t")
    loop.until("the newcomer never ran", lambda: loop.running(newcomer.id))
    shrunk = store.get_job(first.id)
    assert shrunk is not None and shrunk.state is JobState.RUNNING and shrunk.attempt == 1
    assert shrunk.gpus < 4 and shrunk.resized_to == shrunk.gpus
    events = [e.type for e in store.events()]
    assert "resize-in-place" in events and "pool-refused" not in events, events
    assert not store.intents()
    node_gpus = {n.job_id: n.gpus for n in loop.provider.nodes()}
    assert node_gpus == {first.id: shrunk.gpus, newcomer.id: 1}
    assert loop.provider.capacity()[POOL] == 4 - shrunk.gpus - 1
    store.request_cancel(newcomer.id)
    loop.until("the first job never grew back to 4 GPUs", lambda: loop.running(first.id, 4))
    grown = store.get_job(first.id)
    assert grown is not None and grown.attempt == 1 and grown.resized_to == 4
    live = [n for n in loop.provider.nodes() if n.state.value != "terminated"]
    assert [(n.job_id, n.gpus) for n in live] == [(first.id, 4)]
    assert loop.provider.capacity()[POOL] == 0
