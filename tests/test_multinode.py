"""Multi-node jobs: gangs of a pool's largest instance, one rank per node, and a lost node
replaced in its pool while the survivors keep running (or the whole job moved when it cannot be).
Real redis-server and the local provider's node processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from broker.actuator import Actuator, ActuatorConfig, launch_request
from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.reconciler import Reconciler
from broker.scheduler import Scheduler, SchedulerConfig
from broker.store import Store
from policies.models import Accelerator, Market, Pool
from providers.base import LaunchRequest, NodeState, launch_key_of, replacement_key
from providers.local.provider import LocalFleet, LocalProvider
from tests import builders

CLOUD = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100, market=Market.SPOT,
             nodes=1, gpus_per_node=32, price_per_gpu_hour=0.34,
             gpu_prices={1: 0.52, 4: 0.4, 8: 0.34})


def test_a_pool_launches_gangs_of_its_largest_instance() -> None:
    assert CLOUD.gpu_counts == (1, 4, 8, 16, 24, 32)
    assert [CLOUD.shape(n) for n in (1, 4, 8, 16, 24)] == [(1, 1), (1, 4), (1, 8), (2, 8), (3, 8)]
    assert CLOUD.shape(12) is None and not CLOUD.launchable(12) and CLOUD.shape(0) is None
    assert CLOUD.price_for(16) == CLOUD.price_for(8) == 0.34 and CLOUD.price_for(1) == 0.52
    smaller = CLOUD.model_copy(update={"gpus_per_node": 8})
    assert smaller.gpu_counts == (1, 4, 8)  # no gang beyond what the pool may hold
    anything = CLOUD.model_copy(update={"gpu_prices": None})
    assert anything.shape(12) == (1, 12) and anything.gpu_counts is None


# A gang of a fixed size that checkpoints (exit 75) when told to stop.
spec = partial(builders.spec, "gang", run="trap 'exit 75' TERM; sleep 60 & wait", batch=8,
               samples=100)


def test_a_gang_launch_gives_each_node_its_rank_and_meets_at_the_rendezvous() -> None:
    job = JobRecord(id="gang-1", spec=spec(gpus=16), team="ml", launch_key="gang-1:3:2")
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=3, attempt=2, gpus=16,
                    batch_size=8, pool=CLOUD.id)
    req = launch_request(job, intent, CLOUD, ActuatorConfig(broker_url="http://b:8",
                                                            launch_deadline_s=3600))
    assert (req.nodes, req.gpus_per_node, req.first_rank) == (2, 8, 0)
    assert req.env["FLEET_RENDEZVOUS_TIMEOUT"] == "4200"  # the broker decides first
    assert (req.env["FLEET_NNODES"], req.env["FLEET_NPROC"], req.env["FLEET_ROUND"]) == (
        "2", "8", "0")
    assert "FLEET_MASTER_ADDR" not in req.env and "FLEET_NODE_RANK" not in req.env
    launched = job.model_copy(update={"gpus": 16, "nodes": 2})
    # the catalog now sells 16-GPU instances too: the stand-in still joins a gang of 2 x 8
    bigger = CLOUD.model_copy(update={"gpu_prices": {**(CLOUD.gpu_prices or {}), 16: 0.3}})
    stand_in = launch_request(launched, intent.model_copy(update={
        "kind": IntentKind.REPLACE, "ranks": [1], "round": 1}), bigger, ActuatorConfig(),
        ranks=(1, 1), zone="us-east-1b")
    assert (stand_in.nodes, stand_in.first_rank, stand_in.env["FLEET_NNODES"]) == (1, 1, "2")
    assert (stand_in.gpus_per_node, stand_in.zone) == (8, "us-east-1b")
    assert stand_in.idempotency_key == replacement_key("gang-1:3:2", 1, 1) == "gang-1:3:2~r1.1"
    assert launch_key_of(stand_in.idempotency_key) == "gang-1:3:2"
    assert stand_in.env["FLEET_LAUNCH_KEY"] == stand_in.idempotency_key
    assert stand_in.env["FLEET_ROUND"] == "1"
    single = launch_request(job, intent.model_copy(update={"gpus": 8}), CLOUD, ActuatorConfig())
    assert single.nodes == 1 and single.env["FLEET_MASTER_ADDR"] == "127.0.0.1"


def test_local_regions_split_into_nodes_evenly() -> None:
    with pytest.raises(ValueError, match="split evenly"):
        LocalFleet.model_validate({"regions": [
            {"region": "a", "price_per_gpu_hour": 1, "gpus": 3, "nodes": 2}]})


FLEET = LocalFleet.model_validate({"grace_period_s": 2.0, "regions": [
    {"cloud": "aws", "region": "east", "market": "spot", "price_per_gpu_hour": 0.3, "gpus": 2,
     "nodes": 2}]})


class Loop:
    """One broker's passes over a real Redis and the local provider (no API: agents unused)."""

    def __init__(self, store: Store, provider: LocalProvider, *, replace: bool,
                 max_failures: int = 3, launch_deadline_s: float | None = None) -> None:
        self.store, self.provider = store, provider
        self.actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
        self.scheduler = Scheduler(store, SchedulerConfig())
        self.reconciler = Reconciler(store, provider, replace_lost_nodes=replace,
                                     max_failures=max_failures,
                                     launch_deadline_s=launch_deadline_s)
        self.fence = store.acquire_lease("me", 60)

    def step(self, schedule: bool = True) -> None:
        self.store.set_pools(self.provider.pools())
        self.reconciler.run(self.fence)
        if schedule:
            self.scheduler.run_round(self.fence)
        self.actuator.run(self.fence)

    def until(self, what: Callable[[], bool], timeout: float = 20,
              schedule: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            self.step(schedule)
            time.sleep(0.1)

    def job(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id)
        assert job is not None
        return job


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[LocalProvider]:
    p = LocalProvider(FLEET, tmp_path / "state", tmp_path)
    yield p
    for node in p.nodes():
        p.lose(node.node_id)


GANG = ("echo rank=$FLEET_NODE_RANK nnodes=$FLEET_NNODES round=$FLEET_ROUND; "
        "trap 'sleep 1; exit 75' TERM; sleep 60 & wait")  # a second to checkpoint


def running_gang(loop: Loop, run: str = GANG) -> tuple[JobRecord, dict[int, str]]:
    job = loop.store.submit(spec(gpus=2, run=run), team="t")
    loop.store.set_pools(loop.provider.pools())
    loop.scheduler.run_round(loop.fence)
    launching = loop.job(job.id)  # the rendezvous knows the gang's size before any node boots
    assert (launching.state, launching.nodes, launching.round) == (JobState.LAUNCHING, 2, 0)
    loop.until(lambda: loop.job(job.id).state is JobState.RUNNING)
    job = loop.job(job.id)
    ranks = {n.rank: n.node_id for n in loop.provider.nodes() if n.node_id in job.node_ids}
    return job, ranks  # type: ignore[return-value]


def test_a_lost_node_is_replaced_in_its_pool_and_the_survivor_stays(
        store: Store, provider: LocalProvider) -> None:
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    assert (job.nodes, job.gpus, job.round, sorted(ranks)) == (2, 2, 0, [0, 1])
    provider.lose(ranks[1])  # the machine dies: no notice, no exit report
    loop.until(lambda: len(loop.job(job.id).node_ids) == 2 and loop.job(job.id).round == 1)
    healed = loop.job(job.id)
    assert healed.state is JobState.RUNNING and healed.attempt == job.attempt
    assert ranks[0] in healed.node_ids  # the survivor was never stopped
    (stand_in,) = [n for n in provider.nodes() if n.node_id in healed.node_ids
                   and n.node_id != ranks[0]]
    assert stand_in.rank == 1 and stand_in.state is not NodeState.TERMINATED
    assert stand_in.idempotency_key == replacement_key(job.launch_key or "", 1, 1)
    loop.until(lambda: bool(provider.read_log(stand_in.node_id)[0]))
    assert provider.read_log(stand_in.node_id)[0] == ["rank=1 nnodes=2 round=1"]
    (lost,) = [e for e in store.events(job_id=job.id) if e.type == "nodes-lost"]
    assert lost.data["ranks"] == [1] and lost.data["recovery"] == "replace-node"
    assert [e.data["ranks"] for e in store.events(job_id=job.id)
            if e.type == "nodes-replaced"] == [[1]]
    loop.step()  # the lost node is no one's now: forgotten
    assert ranks[1] not in {n.node_id for n in provider.nodes()}
    placements = store.placements(job.id)
    assert len(placements) == 1 and placements[0].end is None  # one interval, still open


def test_a_reclaimed_node_is_replaced_once_it_is_gone(
        store: Store, provider: LocalProvider) -> None:
    """A spot notice for one node of the gang: the stand-in is launched only after that node
    checkpointed and went (it holds its GPU until then), so the pool is not refused."""
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    with pytest.raises(ValueError, match="not a spot node"):
        provider.reclaim_node("nonesuch")
    provider.reclaim_node(ranks[1])
    loop.store.set_pools(provider.pools())
    loop.reconciler.run(loop.fence)
    noticed = loop.job(job.id)
    assert (noticed.round, noticed.node_ids, noticed.preemptions) == (1, [ranks[0]], 1)
    going = {n.node_id: n.state for n in provider.nodes()}.get(ranks[1])
    launched = loop.actuator.run(loop.fence)
    if going is not None and going is not NodeState.TERMINATED:
        assert launched == 0  # rank 1 still checkpoints: wait for it
    loop.until(lambda: len(loop.job(job.id).node_ids) == 2)
    healed = loop.job(job.id)
    assert (healed.attempt, healed.round) == (job.attempt, 1) and ranks[0] in healed.node_ids
    types = [e.type for e in store.events(job_id=job.id)]
    assert "pool-refused" not in types and types.count("nodes-replaced") == 1
    assert store.pool_stats().preemptions == {"aws:east:spot:T4": 1}


@pytest.mark.parametrize("why", ["no rendezvous", "launches are one unit"])
def test_when_no_stand_in_can_join_the_whole_job_moves(
        store: Store, provider: LocalProvider, why: str) -> None:
    """Without a broker URL agents cannot re-form a group; a backend whose launch is one unit
    (a SkyPilot cluster goes down whole) cannot lose or add one node alone."""
    if why == "launches are one unit":
        provider.separable_nodes = False
    loop = Loop(store, provider, replace=why != "no rendezvous")
    job, ranks = running_gang(loop)
    provider.lose(ranks[0])
    loop.until(lambda: loop.job(job.id).attempt == job.attempt + 1)
    moved = loop.job(job.id)
    events = [e for e in store.events(job_id=job.id) if e.type == "nodes-lost"]
    assert events[0].data == {"from": "running", "to": "suspending", "ranks": [0],
                              "recovery": "migrate", "replaced": 0}
    assert moved.preemptions == 0 and moved.failures == 0
    assert ranks[1] not in moved.node_ids  # the survivor checkpointed and went


def test_a_rank_whose_command_fails_stops_the_gang_and_nothing_is_replaced(
        store: Store, provider: LocalProvider) -> None:
    loop = Loop(store, provider, replace=True)
    job, _ = running_gang(loop, run='[ "$FLEET_NODE_RANK" = 1 ] && { sleep 1; exit 3; }; '
                              "trap 'exit 75' TERM; sleep 60 & wait")
    loop.until(lambda: loop.job(job.id).failures == 1, schedule=False)
    failed = loop.job(job.id)
    assert failed.round == 0 and failed.reason == "command exited 3 (failure 1)"
    types = [e.type for e in store.events(job_id=job.id)]
    assert "nodes-lost" not in types


def test_a_gang_that_keeps_losing_nodes_moves(store: Store, provider: LocalProvider) -> None:
    loop = Loop(store, provider, replace=True, max_failures=1)
    job, ranks = running_gang(loop)
    provider.lose(ranks[1])
    loop.until(lambda: loop.job(job.id).round == 1 and len(loop.job(job.id).node_ids) == 2)
    stand_in = next(i for i in loop.job(job.id).node_ids if i != ranks[0])
    provider.lose(stand_in)
    loop.until(lambda: loop.job(job.id).attempt == job.attempt + 1)
    (first, second) = [e for e in store.events(job_id=job.id) if e.type == "nodes-lost"]
    assert (first.data["recovery"], second.data["recovery"]) == ("replace-node", "migrate")
    assert second.data["replaced"] == 1  # max_failures replacements in one attempt
    assert loop.job(job.id).round == 0  # the new attempt starts its own rounds


def test_a_stand_in_that_never_comes_to_the_rendezvous_is_replaced_again(
        store: Store, provider: LocalProvider) -> None:
    """The survivor checks in for round 1, the stand-in never does (its VM hangs at boot):
    past the launch deadline it counts as lost too, and a second stand-in is launched."""
    loop = Loop(store, provider, replace=True, launch_deadline_s=1.0)
    job, ranks = running_gang(loop)
    store.rendezvous(job.id, job.attempt, 0, 0, "127.0.0.1:29400",  # rank 0's agent, round 0
                     job.launch_key)
    provider.lose(ranks[1])
    loop.until(lambda: loop.job(job.id).round == 1 and len(loop.job(job.id).node_ids) == 2)
    (hung,) = [i for i in loop.job(job.id).node_ids if i != ranks[0]]
    survivor = loop.job(job.id).launch_key  # rank 0 is the launch's own node
    assert store.rendezvous(job.id, job.attempt, 1, 0, "127.0.0.1:29500", survivor
                            )["master"] is None
    assert store.checked_in([loop.job(job.id)]) == {job.id: {0}}
    loop.until(lambda: loop.job(job.id).round == 2 and len(loop.job(job.id).node_ids) == 2)
    again = loop.job(job.id)
    assert ranks[0] in again.node_ids and hung not in again.node_ids
    assert [e.data["ranks"] for e in store.events(job_id=job.id) if e.type == "nodes-lost"] \
        == [[1], [1]]
    loop.until(lambda: hung not in {n.node_id for n in provider.nodes()
                                    if n.state is not NodeState.TERMINATED})


def test_a_node_of_the_first_launch_that_never_comes_up_is_replaced(
        store: Store, provider: LocalProvider) -> None:
    """Round 0: rank 0 checks in at the rendezvous, rank 1's VM hangs at boot (its process runs,
    its agent never comes): past the launch deadline it counts as lost and is replaced."""
    loop = Loop(store, provider, replace=True, launch_deadline_s=1.0)
    job, ranks = running_gang(loop)
    store.rendezvous(job.id, job.attempt, 0, 0, "127.0.0.1:29400", job.launch_key)
    loop.until(lambda: loop.job(job.id).round == 1 and len(loop.job(job.id).node_ids) == 2)
    mended = loop.job(job.id)
    assert ranks[0] in mended.node_ids and ranks[1] not in mended.node_ids
    assert mended.stand_ins == {1: 1}


def test_a_finished_gang_whose_vms_are_deleted_completes(
        store: Store, provider: LocalProvider) -> None:
    """GCP and Azure delete a VM once its agent reported: the inventory no longer lists the
    gang's nodes, and each rank is judged by its own report."""
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    for rank, node_id in ranks.items():
        store.record_heartbeat(job.id, job.attempt, node_rank=rank, exit_code=0,
                               launch_key=job.launch_key)
        provider.lose(node_id)
    loop.until(lambda: all(n.state is NodeState.TERMINATED for n in provider.nodes()))
    for node_id in ranks.values():
        provider.forget(node_id)
    loop.until(lambda: loop.job(job.id).state.terminal)
    done = loop.job(job.id)
    assert (done.state, done.preemptions, done.failures) == (JobState.COMPLETED, 0, 0)


def test_a_gang_that_finishes_while_a_stand_in_waits_completes(
        store: Store, provider: LocalProvider) -> None:
    """Rank 1 is lost and a stand-in launched; before it joins, rank 0 reports the whole work
    done and exits 0 (a short job outruns the replacement). The stand-in would wait at a
    rendezvous no one comes to: it is stopped and the job completes."""
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    provider.lose(ranks[1])
    loop.until(lambda: loop.job(job.id).round == 1 and len(loop.job(job.id).node_ids) == 2)
    (stand_in,) = [i for i in loop.job(job.id).node_ids if i != ranks[0]]
    store.record_heartbeat(job.id, job.attempt, node_rank=0, round=1, exit_code=0,
                           samples_done=job.spec.work_samples, launch_key=job.launch_key)
    provider.lose(ranks[0])
    provider.forget(ranks[0])  # its exit is known from the report alone, as on a deleted VM
    loop.until(lambda: loop.job(job.id).state.terminal)
    done = loop.job(job.id)
    assert (done.state, done.failures) == (JobState.COMPLETED, 0)
    assert all(n.state is NodeState.TERMINATED for n in provider.nodes()
               if n.node_id == stand_in)


def test_a_reclaimed_node_killed_after_its_grace_is_mended_not_failed(
        store: Store, provider: LocalProvider) -> None:
    """The reclaimed node's command dies with 1 (killed after the grace period): that says
    nothing of the job, which is mended."""
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop, run="trap 'exit 1' TERM; sleep 60 & wait")
    provider.reclaim_node(ranks[1])
    loop.until(lambda: loop.job(job.id).round == 1 and len(loop.job(job.id).node_ids) == 2)
    assert loop.job(job.id).failures == 0


def test_a_cancelled_gang_is_not_mended(store: Store, provider: LocalProvider) -> None:
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    store.request_cancel(job.id)
    provider.lose(ranks[1])
    loop.until(lambda: loop.job(job.id).state is JobState.CANCELLED)
    assert "nodes-lost" not in [e.type for e in store.events(job_id=job.id)]


def test_a_gang_on_a_cloud_needs_the_broker_url(store: Store, provider: LocalProvider) -> None:
    provider.starts_agent = True  # as a cloud's start script: its agents need the rendezvous
    loop = Loop(store, provider, replace=True)
    job = store.submit(spec(gpus=2), team="t")
    loop.until(lambda: loop.job(job.id).failures == 1)
    assert "meets at the broker's rendezvous" in (loop.job(job.id).reason or "")
    assert provider.nodes() == []


def test_a_launch_that_goes_down_whole_is_released_once_every_rank_reported(
        store: Store, provider: LocalProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a SkyPilot cluster: stopping one node stops them all, so the VMs are released only
    when the last rank has reported its exit (rank 0 may still be writing its checkpoint)."""
    provider.separable_nodes = False
    monkeypatch.setattr(provider, "outlives_agent", lambda node: True)  # as VMs do
    loop = Loop(store, provider, replace=True)
    job, _ = running_gang(loop)
    store.record_heartbeat(job.id, job.attempt, node_rank=1, exit_code=0,
                           launch_key=job.launch_key)
    loop.reconciler.run(loop.fence)
    assert {n.state for n in provider.nodes()} == {NodeState.RUNNING}
    store.record_heartbeat(job.id, job.attempt, node_rank=0, exit_code=0,
                           launch_key=job.launch_key)
    loop.reconciler.run(loop.fence)
    assert NodeState.RUNNING not in {n.state for n in provider.nodes()}


def test_a_refused_stand_in_moves_the_whole_job(store: Store, provider: LocalProvider) -> None:
    loop = Loop(store, provider, replace=True)
    job, ranks = running_gang(loop)
    provider.lose(ranks[1])
    while not any(n.node_id == ranks[1] and n.state is NodeState.TERMINATED
                  for n in provider.nodes()):
        time.sleep(0.05)
    loop.store.set_pools(provider.pools())
    loop.reconciler.run(loop.fence)  # decides to replace rank 1 ...
    provider.launch(LaunchRequest(  # ... but someone else takes the freed GPU first
        idempotency_key="other:1:1", job_id="other", region="east",
        accelerator=Accelerator.T4, gpus_per_node=1, market=Market.SPOT,
        command=["sleep", "30"]))
    loop.actuator.run(loop.fence)
    moving = loop.job(job.id)
    assert moving.state is JobState.SUSPENDING and "no stand-in" in (moving.reason or "")
    blocklist, _ = store.blocklist()
    assert blocklist.is_refused("aws:east:spot:T4", time.time())
    assert [e.type for e in store.events(job_id=job.id)][-2:] == ["pool-refused",
                                                                 "replace-failed"]
