"""A preemption storm: two spot regions reclaimed in turn, every 1.5 s, while one job trains
(the leader loop in this process, the local provider's real processes, a real redis-server).
It prints relaunches per useful hour; a region that reclaims a node soon after its launch is
backed off (the pool refused for a while), so the job stops being relaunched into it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.actuator import Actuator, ActuatorConfig
from broker.models import JobState
from broker.reconciler import Reconciler
from broker.scheduler import Scheduler, SchedulerConfig
from broker.server import Broker, BrokerConfig, build_broker
from broker.store import Store
from policies.models import BatchRange, JobSpec, Regions, SpotPolicy
from providers.fleet import build_fleet_provider
from tests.chaos.conftest import Tally, duplicate_launches
from tests.redis_server import RedisServer

STEPS, STEP_S = 100, 0.05  # 5 s of training
PERIOD_S, RECLAIM_S, STORM_S = 1.5, 1.2, 45.0
RECLAIMS = "\n".join(
    f"  - {{region: {('east', 'west')[i % 2]}, at_s: {1.0 + i * PERIOD_S:g}, "
    f"duration_s: {RECLAIM_S:g}}}" for i in range(int(STORM_S / PERIOD_S)))
FLEET = f"""
grace_period_s: 1
regions:
  - {{cloud: aws, region: east, market: spot, price_per_gpu_hour: 0.3, gpus: 1}}
  - {{cloud: gcp, region: west, market: spot, price_per_gpu_hour: 0.4, gpus: 1}}
  - {{cloud: azure, region: south, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}}
reclaims:
{RECLAIMS}
"""
# Restores for RESTORE_S (a real job's boot and checkpoint load), then trains STEPS steps in
# all, keeping its step count as its checkpoint; each start is logged with the step it resumed
# from; SIGTERM (the notice, or a stop) exits 75 after the current step.
RESTORE_S = 1.0
JOB = f"""
d="$FLEET_CHECKPOINT_URI"; mkdir -p "$d"
s=$(cat "$d/step" 2>/dev/null || echo 0)
echo "$FLEET_LAUNCH_KEY $s" >> "$MARKS/starts"
trap 'exit 75' TERM
sleep {RESTORE_S}
while [ "$s" -lt {STEPS} ]; do sleep {STEP_S}; s=$((s+1)); echo "$s" > "$d/step"; done
"""


@pytest.fixture
def broker(redis_server: RedisServer, tmp_path: Path) -> Iterator[Broker]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    config = BrokerConfig(state_dir=tmp_path / "state", fleet=fleet, tick_s=0.1,
                          lease_ttl_s=3, use_agent=False)
    b = build_broker(config, redis_url=redis_server.url).start()
    yield b
    b.stop()
    for n in b.provider.nodes():
        b.provider.terminate(n.node_id)


@pytest.mark.chaos
def test_a_region_under_reclaim_is_backed_off(broker: Broker, tmp_path: Path,
                                              chaos: Tally) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    store = broker.store
    job_id = store.submit(JobSpec(name="storm", run=JOB, envs={"MARKS": str(marks)},
                                  spot=SpotPolicy.PREFERRED,
                                  batch_size=BatchRange(min=8, max=8), work_samples=STEPS),
                          team="t").id
    start = time.monotonic()
    deadline = start + STORM_S + 30
    while time.monotonic() < deadline:
        job = store.get_job(job_id)
        if job is not None and job.state.terminal:
            break
        time.sleep(0.2)
    took = time.monotonic() - start
    job = store.get_job(job_id)
    chaos.record(faults=sum(1.0 + i * PERIOD_S < took for i in range(int(STORM_S / PERIOD_S))),
                 jobs_lost=int(job is None or job.state is not JobState.COMPLETED),
                 duplicate_launches=duplicate_launches(tmp_path / "state"))
    assert job is not None and job.state is JobState.COMPLETED, (job.state, job.reason)
    starts = [int(line.split()[1]) for line in (marks / "starts").read_text().splitlines()]
    trained = [b - a for a, b in zip(starts, [*starts[1:], STEPS], strict=True)]
    relaunches = len(starts) - 1
    idle = sum(1 for t in trained[:-1] if t == 0)  # launches reclaimed before a step
    useful_h = STEPS * STEP_S / 3600
    print(f"\nstorm: {relaunches} relaunches ({idle} reclaimed before training a step), "
          f"{relaunches / useful_h:,.0f} per useful hour ({STEPS * STEP_S:g} s of training), "
          f"completed in {took:.1f} s; steps per launch {trained}")
    assert relaunches <= 4, trained  # two early reclaims in each spot region at most


@pytest.mark.parametrize("quick_s", [300.0, 0.0])
def test_a_second_early_reclaim_refuses_the_pool(
        redis_server: RedisServer, tmp_path: Path, quick_s: float) -> None:
    """The recording side alone, fast: a pool that takes back a launch within
    ``quick_reclaim_s`` of its start a second time is refused (the scheduler launches nothing
    there until the mark lapses, whatever SpotHedge's reset does to the preemption marks); one
    early reclaim, or late ones, only mark the location."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET.split("reclaims:")[0])
    provider, _ = build_fleet_provider(fleet, tmp_path / "state", tmp_path)
    store = Store.from_url(redis_server.url)
    actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
    scheduler, reconciler = Scheduler(store, SchedulerConfig()), \
        Reconciler(store, provider, quick_reclaim_s=quick_s)
    fence = store.acquire_lease("me", 60)
    east = "aws:east:spot:T4"

    def step() -> None:
        store.set_pools(provider.pools())
        reconciler.run(fence)
        scheduler.run_round(fence)
        actuator.run(fence)

    def reclaimed_in_east(name: str) -> list:
        # east only: what is tested is how east's launches are taken back, not where else the
        # jobs would go
        job = store.submit(JobSpec(name=name, run="trap 'exit 75' TERM; sleep 30 & wait",
                                   spot=SpotPolicy.PREFERRED, regions=Regions(allow=["aws:east"]),
                                   batch_size=BatchRange(min=8, max=8), work_samples=8),
                           team="t")
        step()
        assert store.get_job(job.id).pool == east  # type: ignore[union-attr]
        provider.reclaim("east", duration_s=0.3)
        deadline = time.monotonic() + 20
        while store.get_job(job.id).preemptions == 0:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            step()
            time.sleep(0.05)
        time.sleep(0.4)  # east has its GPU back
        return [e for e in store.events(job_id=job.id) if e.type == "location-blocked"]

    try:
        (first,) = reclaimed_in_east("first")
        assert not store.blocklist()[0].refused and first.data["backoff_s"] is None
        # the first job goes, so east's one GPU is the second's
        store.request_cancel(first.job_id)  # type: ignore[arg-type]
        deadline = time.monotonic() + 20
        while not store.get_job(first.job_id).state.terminal:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            step()
            time.sleep(0.05)
        (second,) = reclaimed_in_east("second")
        blocklist, _ = store.blocklist()
        if quick_s:
            assert blocklist.is_refused(east, time.time())
            assert "under reclaim" in blocklist.refusal_why[east]
            assert second.data["backoff_s"] == blocklist.refusal_decay_s
            third = store.submit(JobSpec(name="third", run="sleep 30", spot=SpotPolicy.PREFERRED,
                                         batch_size=BatchRange(min=8, max=8), work_samples=8),
                                 team="t")
            step()
            assert store.get_job(third.id).pool != east  # type: ignore[union-attr]
        else:
            assert not blocklist.refused and second.data["backoff_s"] is None
    finally:
        for node in provider.nodes():
            provider.terminate(node.node_id)
