"""Why a job waits (issue 15, item 5): the round gives every waiting job a reason (no pool
offers its accelerator, more GPUs than its pools hold, waiting for capacity), the API and the
CLI show it with the job's place in its queue, and a job the fleet file can never host is
refused at submission with the field and the fix. Real redis-server, real uvicorn on loopback."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.api import build_app
from broker.models import JobState
from broker.scheduler import Scheduler, SchedulerConfig
from broker.store import Store
from policies.models import Accelerator, JobSpec, Market, Pool
from providers.local.provider import LocalRegion
from tests import builders
from tests.api_server import TOKENS, ApiServer, api_config

EAST = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.T4, market=Market.SPOT,
            nodes=1, gpus_per_node=4, price_per_gpu_hour=0.2)
WEST = Pool(cloud="aws", region="us-west-2", accelerator=Accelerator.T4,
            market=Market.ON_DEMAND, nodes=1, gpus_per_node=2, price_per_gpu_hour=0.9)
L4 = Pool(cloud="gcp", region="us-central1", accelerator=Accelerator.L4,
          market=Market.ON_DEMAND, nodes=1, gpus_per_node=1, price_per_gpu_hour=0.7)
FLEET = [EAST, WEST, L4]


spec = functools.partial(builders.spec, run="true", gpus=(1, 4), batch=(32, 512), samples=1000,
                         team="ml")


@pytest.fixture
def server(store: Store) -> Iterator[ApiServer]:
    srv = ApiServer(build_app(store, api_config(), ceiling=lambda: FLEET)).start()
    try:
        yield srv
    finally:
        srv.stop()


def fleet(srv: ApiServer, *args: str) -> tuple[int, str, str]:
    return builders.fleet({"FLEET_URL": srv.url, "FLEET_TOKEN": TOKENS["ml"],
                           "FLEET_CONFIG": "/nonexistent"}, *args)


def test_every_waiting_job_carries_a_reason_the_api_and_cli_show(
        store: Store, server: ApiServer) -> None:
    store.set_pools([EAST, WEST])  # the L4 pool is gone for now (a reclaim, an outage)
    fence = store.acquire_lease("t", ttl_s=30)
    first = store.submit(spec("first", gpus=(4, 4)), team="ml")
    second = store.submit(spec("second", gpus=(4, 4)), team="ml")
    third = store.submit(spec("third", gpus=(4, 4)), team="ml")
    l4 = store.submit(spec("l4", accelerators=[Accelerator.L4]), team="ml")
    huge = store.submit(spec("huge", gpus=(6, 8)), team="ml")
    fresh = store.submit(spec("fresh"), team="ml")
    Scheduler(store, SchedulerConfig(min_rescale_interval_s=0)).run_round(fence)
    store.submit(spec("late"), team="ml")  # submitted after the round: not yet seen

    got = {j.id: j for j in store.list_jobs()}
    assert got[first.id].state is JobState.LAUNCHING
    assert got[fresh.id].state is JobState.LAUNCHING  # 1-4 GPUs: west's 2
    assert got[second.id].reason == got[third.id].reason == (
        "waiting for capacity: every T4 GPU in its regions is in use or given to a job ahead "
        "of it")
    assert got[l4.id].reason == ("unschedulable: no pool offers L4 now; it waits until one "
                                 "does (or change its accelerators)")
    assert got[huge.id].reason is not None and got[huge.id].reason.startswith(
        "unschedulable: needs at least 6 GPUs in one pool, and the largest T4 pool in its "
        "regions holds 4 now")

    jobs = httpx.get(f"{server.url}/v1/jobs", headers={
        "Authorization": f"Bearer {TOKENS['ml']}"}).json()["jobs"]
    queued = [j for j in jobs if j["state"] == "queued"]
    assert len(queued) == 5 and all(j["reason"] for j in queued)
    by_name = {j["name"]: j for j in jobs}
    assert by_name["late"]["reason"] == "submitted; the next scheduling round considers it"
    # T4 queue: second, third, huge, late (submission order); L4 has its own
    assert by_name["second"]["queue_position"] == {"position": 1, "of": 4}
    assert by_name["third"]["queue_position"] == {"position": 2, "of": 4}
    assert by_name["late"]["queue_position"] == {"position": 4, "of": 4}
    assert by_name["l4"]["queue_position"] == {"position": 1, "of": 1}
    assert by_name["first"]["queue_position"] is None

    code, out, _ = fleet(server, "jobs")
    assert code == 0 and "why waiting:" in out
    assert "waiting for capacity" in out and "(#2 of 4 in queue)" in out
    assert "unschedulable: no pool offers L4" in out
    code, out, _ = fleet(server, "job", third.id)
    assert code == 0 and "state queued (waiting for capacity" in out and "#2 of 4" in out

    # the same round again changes nothing: a reason is written once
    before = store.get_job(second.id)
    Scheduler(store, SchedulerConfig(min_rescale_interval_s=0)).run_round(fence)
    assert store.get_job(second.id).version == before.version  # type: ignore[union-attr]


SKY_TWO_L4 = "name: two-l4\nnum_nodes: 2\nresources: {accelerators: L4:1}\nrun: echo hi\n"


@pytest.mark.parametrize(("body", "field", "fix"), [
    ("name: a\nrun: x\naccelerators: [A100]\nbatch_size: 8\nwork: {samples: 8}",
     "accelerators", "no pool of this fleet offers A100; it has L4, T4"),
    ("name: a\nrun: x\ngpus: 64\nbatch_size: 64\nwork: {samples: 8}",
     "gpus.min", "lower gpus.min to at most 4"),
    ("name: a\nrun: x\nregions: [azure:*]\nbatch_size: 8\nwork: {samples: 8}",
     "regions", "T4 is offered in aws:us-east-1, aws:us-west-2"),
    (SKY_TWO_L4, "resources.accelerators", "lower the GPU count or num_nodes"),
])
def test_a_job_that_can_never_run_is_refused_at_submission(
        store: Store, server: ApiServer, tmp_path: Path, body: str, field: str,
        fix: str) -> None:
    r = httpx.post(f"{server.url}/v1/jobs", content=body, headers={
        "Authorization": f"Bearer {TOKENS['ml']}", "Content-Type": "application/yaml"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["message"] == "the job can never run on this fleet"
    assert [p["field"] for p in err["problems"]] == [field] and fix in err["problems"][0][
        "message"]
    assert store.list_jobs() == []
    path = tmp_path / "job.yaml"
    path.write_text(body)
    code, _, errout = fleet(server, "launch", str(path))
    # the CLI sends the translated spec: a SkyPilot task's fix names both forms
    assert code == 2 and "can never run on this fleet" in errout
    assert (field if field != "resources.accelerators" else "num_nodes") in errout
    assert store.list_jobs() == []


def test_a_job_the_fleet_can_host_is_accepted(store: Store, server: ApiServer) -> None:
    # 2 x 2 T4 fits east's 4 spot GPUs only: on-demand west holds 2
    task = SKY_TWO_L4.replace("L4:1", "T4:2, use_spot: true")
    r = httpx.post(f"{server.url}/v1/jobs", content=task,
                   headers={"Authorization": f"Bearer {TOKENS['ml']}",
                            "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["job"]["reason"] == "submitted; the next scheduling round considers it"


def test_the_fleet_ceiling_is_what_the_fleet_file_declares() -> None:
    """A cloud's pools at their ``max_gpus`` whatever its quota or offers say now, local regions
    unreclaimed: the bound a submission is judged against."""
    from broker.waiting import never_runs
    from providers.fleet import CloudConfig, FleetProvider

    config = CloudConfig(regions=["us-east-1", "us-west-2"], accelerators=[Accelerator.A100],
                         markets=[Market.SPOT], max_gpus=16)
    ceiling = FleetProvider(None, {}, {"aws": config}).ceiling()
    assert sorted((p.id, p.capacity) for p in ceiling) == [
        ("aws:us-east-1:spot:A100", 16), ("aws:us-west-2:spot:A100", 16)]
    fits = spec("fits", gpus=(16, 16), accelerators=[Accelerator.A100])
    assert never_runs(fits, ceiling) == []
    big = spec("big", gpus=(32, 32), accelerators=[Accelerator.A100])
    [problem] = never_runs(big, ceiling)
    assert problem.field == "gpus.min" and "holds 16" in problem.message


# ---- the audit's fleet: spot T4 nodes of 1 GPU each ---------------------------------------------

SPOT_NODES = LocalRegion(region="spot", market=Market.SPOT, price_per_gpu_hour=0.4, gpus=2,
                         nodes=2).pool()
SKY_T4 = "name: t4\nresources: {accelerators: T4:1}\nrun: echo hi\n"
SKY_T4_2 = "name: t4\nresources: {accelerators: T4:2, use_spot: true}\nrun: echo hi\n"
SPOT_NEVER = ("spot: never, and no on-demand T4 pool in its regions: allow spot (use_spot: true "
              "/ spot: allowed) or add on-demand capacity")
ONE_NODE = ("needs 2 GPUs on one node; the largest T4 node in its regions has 1: ask num_nodes "
            "(nodes): 2 of T4:1, or fewer GPUs")


def post(srv: ApiServer, path: str, body: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", content=body, headers={
        "Authorization": f"Bearer {TOKENS['ml']}", "Content-Type": "application/yaml"})


@pytest.fixture
def spot_nodes(store: Store) -> Iterator[ApiServer]:
    store.set_pools([SPOT_NODES])
    srv = ApiServer(build_app(store, api_config(), ceiling=lambda: [SPOT_NODES])).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize(("body", "field", "message"), [
    (SKY_T4, "resources.use_spot", SPOT_NEVER),  # no use_spot: spot never, and all is spot
    (SKY_T4_2, "resources.accelerators", ONE_NODE),  # no num_nodes: one node of 2 GPUs
])
def test_a_task_the_fleet_file_cannot_host_is_refused_with_the_real_cause(
        store: Store, spot_nodes: ApiServer, body: str, field: str, message: str) -> None:
    r = post(spot_nodes, "/v1/jobs", body)
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["problems"]
    assert (problem["field"], problem["message"]) == (field, message)
    assert store.list_jobs() == []
    preview = post(spot_nodes, "/v1/jobs/preview", body).json()
    assert [p["message"] for p in preview["never_runs"]] == [message]
    assert preview["pools"] == []  # no "fits now" on two 1-GPU nodes


def test_the_same_gpus_over_num_nodes_fit_the_one_gpu_nodes(spot_nodes: ApiServer) -> None:
    task = SKY_T4_2.replace("T4:2", "T4:1").replace("name: t4", "name: t4\nnum_nodes: 2")
    preview = post(spot_nodes, "/v1/jobs/preview", task).json()
    assert preview["never_runs"] == []
    assert [(p["pool"], p["nodes"], p["gpus_per_node"], p["fits_now"])
            for p in preview["pools"]] == [(SPOT_NODES.id, 2, 1, True)]
    assert post(spot_nodes, "/v1/jobs", task).status_code == 201


def test_the_preview_keeps_a_fixed_node_count_off_the_pools_split() -> None:
    """2 GPUs asked on one node are not two 1-GPU nodes; 2 nodes of 2 on 2-GPU nodes are 2 x 2,
    not one 4-GPU launch the pool's sizes would make of them."""
    from broker.preview import placement_preview

    one_node = spec("one", gpus=(2, 2), nodes=1)
    assert placement_preview(one_node, [SPOT_NODES], {}) == []
    wide = LocalRegion(region="wide", market=Market.SPOT, price_per_gpu_hour=0.4, gpus=8,
                       nodes=2).pool()  # 2 nodes of 4: sizes 1-4 per node
    [row] = placement_preview(spec("two", gpus=(4, 4), nodes=2), [wide], {})
    assert (row["nodes"], row["gpus_per_node"], row["fits_now"]) == (2, 2, True)


def test_the_round_names_the_real_cause_where_submission_could_not_know() -> None:
    """Where the fleet file leaves a job possible (it declares on-demand capacity a cloud does
    not list now; a cloud's instance sizes come from its listing), the round marks it
    unschedulable with the cause and the fix, once, instead of blaming its regions."""
    sizes = EAST.model_copy(update={"gpu_prices": {1: 0.2, 4: 0.2}})
    jobs = [builders.record("never", spec("never", gpus=(1, 1), spot="never")),
            builders.record("three", spec("three", gpus=(3, 3), nodes=1)),
            builders.record("eight", spec("eight", gpus=(8, 8), nodes=1))]
    config = SchedulerConfig(min_rescale_interval_s=0)
    first = builders.planned(jobs, [sizes], config)
    assert first.intents == {} and first.states == {}
    assert first.reasons == {
        "never-1": f"unschedulable: {SPOT_NEVER}",
        "three-1": "unschedulable: needs 3 GPUs on each node; T4 nodes in its regions come with "
                   "1, 4: ask one of those per node",
        "eight-1": "unschedulable: needs 8 GPUs on one node; the largest T4 node in its regions "
                   "has 4: ask num_nodes (nodes): 2 of T4:4, or fewer GPUs"}
    assert first.events["never-1"].count("unschedulable") == 1
    again = builders.planned(list(first.jobs.values()), [sizes], config)
    assert "unschedulable" not in again.events.get("never-1", [])  # said once


NO_DOCKER = "install Docker on the local fleet's machine, or run on a cloud pool"


def test_a_container_job_waits_off_pools_that_cannot_run_containers() -> None:
    """A job with a container image never lands where its nodes have no usable Docker (it
    would run on the host without the image's software): the round marks it with the fix, and
    the submission check and the preview, sharing ``Needs``, say the same."""
    from broker.preview import placement_preview
    from broker.waiting import Needs, Unmet, never_runs

    local = LocalRegion(region="here", price_per_gpu_hour=0.1, gpus=2).pool(containers=False)
    job = JobSpec.model_validate({**spec("boxed", gpus=(1, 1)).model_dump(),
                                  "container_image": "repo/img:1", "run_per_node": True,
                                  "nodes": 1, "regions": {"allow": ["local:*"], "deny": []}})
    assert Needs.of(job).unmet(local) is Unmet.CONTAINER
    assert Needs.of(job).unmet(local.model_copy(update={"containers": True})) is None
    refused = never_runs(job, [local], skypilot=True)
    assert [p.field for p in refused] == ["resources.image_id"] and NO_DOCKER in \
        refused[0].message
    assert placement_preview(job, [local], {}) == []
    got = builders.planned([builders.record("boxed", job)], [local],
                           SchedulerConfig(min_rescale_interval_s=0))
    assert got.intents == {} and got.states == {}
    reason = got.reasons["boxed-1"] or ""
    assert reason.startswith("unschedulable: runs in a container image") and NO_DOCKER in reason


def test_the_local_provider_tells_whether_its_machine_runs_containers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from providers.local.provider import LocalFleet, LocalProvider

    fleet_file = LocalFleet(regions=[LocalRegion(region="here", price_per_gpu_hour=0.1, gpus=1)])
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker on PATH
    provider = LocalProvider(fleet_file, tmp_path / "state")
    assert [p.containers for p in provider.pools()] == [False]


CPU_LAB = LocalRegion(region="lab", cpu_nodes=3, cpus_per_node=4, memory_gib_per_node=16,
                      price_per_node_hour=0.1).pool()
NO_CPU_POOL = "a CPU-only task, and this fleet has no CPU pool; add a CPU pool to the fleet file"


@pytest.mark.parametrize(("ceiling", "body", "field", "words"), [
    ([EAST], "name: c\nrun: x\nresources: {cpus: 4+}\n", "resources.accelerators", NO_CPU_POOL),
    ([EAST], "name: c\nrun: x\ncpus: 4+\nnodes: 2\n", "accelerators", NO_CPU_POOL),
    ([EAST, CPU_LAB], "name: c\nrun: x\nresources: {cpus: 8+}\n", "resources.cpus",
     "asks cpus 8+ per node; the CPU nodes in its regions have local:lab:on-demand:CPU (4 vCPUs"),
    ([EAST, CPU_LAB], "name: c\nrun: x\nnum_nodes: 5\nresources: {cpus: 4}\n", "num_nodes",
     "asks for 5 CPU nodes in one region, more than this fleet will ever have there"),
])
def test_a_cpu_task_the_fleet_cannot_host_is_refused_at_submission_never_given_a_gpu(
        store: Store, ceiling: list[Pool], body: str, field: str, words: str) -> None:
    """Through the real API: no CPU pool, nodes smaller than asked, more nodes than a CPU pool
    holds; each is a 422 naming the field and the fix, and nothing is queued."""
    srv = ApiServer(build_app(store, api_config(), ceiling=lambda: ceiling)).start()
    try:
        r = post(srv, "/v1/jobs", body)
        assert r.status_code == 422, r.text
        [problem] = r.json()["error"]["problems"]
        assert problem["field"] == field and words in problem["message"], problem
        assert store.list_jobs() == []
        # the same task that fits: accepted, as a CPU job, and queued
        fits = post(srv, "/v1/jobs", "name: c\nrun: x\nnum_nodes: 2\nresources: {cpus: 4}\n")
        if CPU_LAB in ceiling:
            assert fits.status_code == 201, fits.text
            [job] = store.list_jobs()
            assert (job.spec.accelerators, job.spec.nodes) == ([Accelerator.CPU], 2)
        else:
            assert fits.status_code == 422 and store.list_jobs() == []
    finally:
        srv.stop()
