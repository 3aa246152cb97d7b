"""The leader loop end to end on the local provider with tiny shell jobs and a real
redis-server: jobs run and finish with priced placement intervals, a reclaimed spot region's
job checkpoints (exit 75) and resumes in another region, a cancel stops a running job."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from broker.models import JobState
from broker.server import Broker, BrokerConfig, build_broker
from broker.store import Store
from policies.models import SpotPolicy
from tests import builders
from tests.redis_server import RedisServer

FLEET = """
grace_period_s: 2
regions:
  - {cloud: aws, region: east, market: spot, price_per_gpu_hour: 0.3, gpus: 2}
  - {cloud: gcp, region: west, market: spot, price_per_gpu_hour: 0.4, gpus: 2}
  - {cloud: azure, region: south, market: on-demand, price_per_gpu_hour: 1.0, gpus: 2}
"""
# Exits 75 on SIGTERM, like the runtime agent after a checkpoint.
LOOP = "trap 'exit 75' TERM; echo ready; i=0; while [ $i -lt {n} ]; do sleep 0.1; i=$((i+1)); done"


# Small jobs: a global batch of 8-64 and 100 samples of work.
spec = partial(builders.spec, batch=(8, 64), samples=100)


@pytest.fixture
def broker(redis_server: RedisServer, tmp_path: Path) -> Iterator[Broker]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    config = BrokerConfig(state_dir=tmp_path / "state", fleet=fleet, tick_s=0.2,
                          lease_ttl_s=3, use_agent=False)
    b = build_broker(config, redis_url=redis_server.url).start()
    yield b
    b.stop()
    for n in b.provider.nodes():
        b.provider.terminate(n.node_id)


def wait_for(cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def states(store: Store) -> dict[str, JobState]:
    return {j.id: j.state for j in store.list_jobs()}


def test_jobs_run_to_completion_with_priced_placements(broker: Broker) -> None:
    store = broker.store
    ids = [store.submit(spec(f"j{i}", run="echo started $FLEET_JOB_ID; sleep 0.5"), team="t").id
           for i in range(4)]
    wait_for(lambda: all(s is JobState.COMPLETED for s in states(store).values()))
    for job_id in ids:
        (pl,) = store.placements(job_id)
        assert pl.end is not None and pl.end > pl.start and pl.price_per_gpu_hour > 0
        assert store.read_logs(job_id)[0] == [f"started {job_id}"]
    # the cheapest pools fill first: two jobs in the 0.3 pool, two in the 0.4 pool
    regions = sorted(store.placements(j)[0].region for j in ids)
    assert regions == ["east", "east", "west", "west"]
    assert broker.provider.nodes() == [] or all(
        n.state.value == "terminated" for n in broker.provider.nodes())


def test_reclaimed_spot_region_job_resumes_elsewhere(broker: Broker) -> None:
    store = broker.store
    job = store.submit(spec("mover", run=LOOP.format(n=40), spot=SpotPolicy.PREFERRED), team="t")
    wait_for(lambda: "ready" in store.read_logs(job.id)[0])
    first = store.get_job(job.id)
    assert first is not None and first.pool is not None
    store.request_preempt(first.pool.split(":")[1], duration_s=60)
    wait_for(lambda: store.get_job(job.id).attempt == 2)  # type: ignore[union-attr]
    wait_for(lambda: store.get_job(job.id).state is JobState.COMPLETED)  # type: ignore[union-attr]
    done = store.get_job(job.id)
    assert done is not None and done.pool != first.pool
    assert done.preemptions == 1 and done.migrations == 1
    first_pl, second_pl = store.placements(job.id)
    assert first_pl.end is not None and first_pl.end <= second_pl.start + 0.5
    assert first_pl.region != second_pl.region
    types = [e.type for e in store.events(job_id=job.id, limit=1000)]
    assert "preempted" in types and types[-1] == "completed"


def test_cancel_stops_a_running_job(broker: Broker) -> None:
    store = broker.store
    job = store.submit(spec("long", run=LOOP.format(n=300)), team="t")
    wait_for(lambda: "ready" in store.read_logs(job.id)[0])  # its SIGTERM trap is set
    store.request_cancel(job.id)
    wait_for(lambda: store.get_job(job.id).state is JobState.CANCELLED)  # type: ignore[union-attr]
    assert store.get_job(job.id).exit_code == 75  # type: ignore[union-attr]
