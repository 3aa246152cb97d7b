"""A job is never recorded completed from stale progress: within one attempt and round progress
only moves forward and stops at the agent's final report (a late heartbeat delivered after it,
by another replica or a retry, is dropped), and a job whose command finished waits for that final
report, which carries its last progress, before it is recorded completed. Real redis-server,
real local-provider processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.actuator import Actuator, ActuatorConfig
from broker.models import JobState
from broker.reconciler import Reconciler
from broker.scheduler import Scheduler, SchedulerConfig
from broker.store import Store
from policies.models import BatchRange, JobSpec
from providers.fleet import build_fleet_provider
from tests.runtime.test_agent_rendezvous import running_job

FLEET = """
grace_period_s: 1
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 2}
"""


def test_progress_never_goes_back_within_an_attempt(store: Store) -> None:
    job = running_job(store, nodes=1)
    beat = {"world_size": 1, "global_batch_size": 128, "samples_per_sec": 900.0}
    store.record_heartbeat(job.id, job.attempt, samples_done=128_384, checkpoint_step=1000, **beat)
    store.record_heartbeat(job.id, job.attempt, samples_done=256_000, checkpoint_step=2000,
                           exit_code=0, **beat)  # the final report
    # a heartbeat sent before it, delivered late (a slow replica, a retry)
    store.record_heartbeat(job.id, job.attempt, samples_done=200_000, checkpoint_step=1500, **beat)
    got = store.get_job(job.id)
    assert got is not None and (got.samples_done, got.checkpoint_step) == (256_000, 2000)
    # before any final report, an older report does not wind progress back either
    other = running_job(store, nodes=1)
    store.record_heartbeat(other.id, other.attempt, samples_done=5000, checkpoint_step=30, **beat)
    store.record_heartbeat(other.id, other.attempt, samples_done=4000, checkpoint_step=20, **beat)
    got = store.get_job(other.id)
    assert got is not None and (got.samples_done, got.checkpoint_step) == (5000, 30)


def test_a_new_attempt_resumes_from_its_checkpoint_below_the_last_progress(
        store: Store) -> None:
    job = running_job(store, nodes=1)
    store.record_heartbeat(job.id, job.attempt, samples_done=5000, checkpoint_step=30)
    # relaunched: the next attempt restarts from checkpoint 30, fewer samples than reported
    store.r.hset(f"fb:job:{job.id}", "attempt", job.attempt + 1)
    store.record_heartbeat(job.id, job.attempt + 1, samples_done=3840, checkpoint_step=30)
    got = store.get_job(job.id)
    assert got is not None and got.samples_done == 3840


@pytest.fixture
def loop(store: Store, tmp_path: Path) -> Iterator[tuple[Store, Reconciler, Callable[..., None]]]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    provider, _ = build_fleet_provider(fleet, tmp_path / "state", tmp_path)
    later = [0.0]
    reconciler = Reconciler(store, provider, final_report_wait_s=30,
                            clock=lambda: time.time() + later[0])
    actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
    scheduler = Scheduler(store, SchedulerConfig())
    fence = store.acquire_lease("me", 600)

    def step(skip_s: float = 0.0) -> None:
        later[0] = skip_s
        store.set_pools(provider.pools())
        reconciler.run(fence)
        scheduler.run_round(fence)
        actuator.run(fence)

    try:
        yield store, reconciler, step
    finally:
        for node in provider.nodes():
            provider.terminate(node.node_id)


def ended(store: Store, reconciler: Reconciler, job_id: str) -> bool:
    job = store.get_job(job_id)
    return job is not None and job.state is JobState.RUNNING and all(
        n.state.value == "terminated" for n in reconciler.provider.nodes()
        if n.node_id in job.node_ids)


def test_completion_waits_for_the_final_report_and_takes_its_progress(loop) -> None:
    store, reconciler, step = loop
    job = store.submit(JobSpec(name="quick", run="true", batch_size=BatchRange(min=8, max=8),
                               work_samples=256_000), team="t")
    deadline = time.monotonic() + 20
    while not ended(store, reconciler, job.id) and time.monotonic() < deadline:
        step()
        time.sleep(0.1)
    running = store.get_job(job.id)
    assert running is not None and running.state is JobState.RUNNING  # the command ended
    key = running.launch_key  # the node's: the broker takes reports only from it
    store.record_heartbeat(job.id, running.attempt, samples_done=128_384, checkpoint_step=1000,
                           launch_key=key)
    step()
    step()
    waiting = store.get_job(job.id)
    assert waiting is not None and waiting.state is JobState.RUNNING, waiting.reason
    store.record_heartbeat(job.id, running.attempt, samples_done=256_000, checkpoint_step=2000,
                           exit_code=0, launch_key=key)  # the final report lands at a replica
    step()
    done = store.get_job(job.id)
    assert done is not None and done.state is JobState.COMPLETED and done.reason == "finished"
    assert (done.samples_done, done.checkpoint_step) == (256_000, 2000)


def test_without_a_final_report_completion_says_so_after_the_wait(loop) -> None:
    store, reconciler, step = loop
    job = store.submit(JobSpec(name="silent", run="true", batch_size=BatchRange(min=8, max=8),
                               work_samples=100), team="t")
    deadline = time.monotonic() + 20
    while not ended(store, reconciler, job.id) and time.monotonic() < deadline:
        step()
        time.sleep(0.1)
    step()
    assert store.get_job(job.id).state is JobState.RUNNING  # type: ignore[union-attr]
    step(skip_s=31)  # past final_report_wait_s
    done = store.get_job(job.id)
    assert done is not None and done.state is JobState.COMPLETED
    assert done.reason is not None and "no final report" in done.reason
