"""CPU jobs on CPU pools (issue 15: a task asking only for CPUs was put on a T4): the live round
places a CPU job on a CPU pool only, on exactly its nodes, and a GPU job never on a CPU pool; a
CPU job no CPU pool can host waits with the fix, or is refused at submission when the fleet can
never host it; its launch carries SkyPilot's variables with no GPU, and the agent shows its
process none. Pure planning on snapshots (no Redis)."""

from __future__ import annotations

import pytest

from broker.actuator import ActuatorConfig, launch_request
from broker.models import Intent, IntentKind
from broker.protocol import Env
from broker.runtime.agent import Agent, parse
from broker.spec import SpecError, parse_spec_text
from broker.waiting import CPU_POOL_FIX, never_runs
from policies.models import Accelerator, JobSpec, Pool
from providers.local.provider import LocalFleet, LocalRegion
from tests import builders
from tests.builders import planned, record

LAB = LocalRegion(region="lab", cpu_nodes=3, cpus_per_node=4, memory_gib_per_node=16,
                  price_per_node_hour=0.1).pool()
T4 = LocalRegion(region="gpu", gpus=4, price_per_gpu_hour=1.2).pool()


def cpu_task(nodes: int = 2, resources: str = "{cpus: 2+}") -> JobSpec:
    return parse_spec_text(f"run: echo hi\nnum_nodes: {nodes}\nresources: {resources}").spec


def test_a_cpu_job_takes_exactly_its_nodes_of_a_cpu_pool_and_a_gpu_job_a_gpu() -> None:
    cpu, gpu = record("cpu", cpu_task(2)), record("gpu", builders.spec("gpu", gpus=(1, 4)))
    launches = planned([cpu, gpu], [LAB, T4]).launches
    # 2 of the 3 idle nodes (one unit each), never more; the GPU job never on the CPU pool
    assert launches == {cpu.id: (LAB.id, 2), gpu.id: (T4.id, 4)}
    assert LAB.accelerator is Accelerator.CPU and LAB.gpus_per_node == 1


def test_a_gpu_job_waits_rather_than_run_on_cpu_nodes() -> None:
    gpu = record("gpu", builders.spec("gpu", gpus=(1, 4)))
    got = planned([gpu], [LAB])
    assert got.launches == {}
    assert got.reasons[gpu.id] == ("unschedulable: no pool offers T4 now; it waits until one does "
                                   "(or change its accelerators)")


def test_a_cpu_job_waits_rather_than_run_on_a_gpu() -> None:
    cpu = record("cpu", cpu_task(1))
    got = planned([cpu], [T4])
    assert got.launches == {}
    assert got.reasons[cpu.id] == ("unschedulable: a CPU job, and no CPU pool is offered now; it "
                                   f"waits until one is, or {CPU_POOL_FIX}")


def test_a_cpu_job_too_big_or_too_large_per_node_waits_naming_why() -> None:
    four, big = record("four", cpu_task(4)), record("big", cpu_task(1, "{cpus: 8+}"))
    got = planned([four, big], [LAB, T4])
    assert got.launches == {}
    assert got.reasons[four.id] == ("unschedulable: needs 4 CPU nodes in one pool, and the largest "
                                    "CPU pool in its regions has 3 now; lower nodes, or it waits "
                                    "until a pool grows")
    assert got.reasons[big.id] is not None and "asks cpus 8+ per node" in got.reasons[big.id]
    assert "local:lab:on-demand:CPU (4 vCPUs, 16 GiB)" in got.reasons[big.id]


def test_cpu_jobs_queue_for_the_nodes_in_use() -> None:
    first, second = record("first", cpu_task(2)), record("second", cpu_task(2))
    got = planned([first, second], [LAB])
    assert got.launches == {first.id: (LAB.id, 2)}  # 1 node left: the second waits for 2
    assert got.reasons[second.id] is not None and got.reasons[second.id].startswith("waiting")


@pytest.mark.parametrize(("spec", "pools", "field", "words"), [
    (cpu_task(2), [T4], "resources.accelerators", "this fleet has no CPU pool"),
    (cpu_task(5), [LAB, T4], "num_nodes", "asks for 5 CPU nodes in one region"),
    (cpu_task(1, "{memory: 32+}"), [LAB], "resources.memory", "asks memory 32+ per node"),
])
def test_a_cpu_job_the_fleet_can_never_host_is_refused_with_the_fix(
        spec: JobSpec, pools: list[Pool], field: str, words: str) -> None:
    [found] = never_runs(spec, pools, skypilot=True)
    assert found.field == field and words in found.message, found


def test_a_cpu_job_that_fits_is_not_refused() -> None:
    assert never_runs(cpu_task(3, "{cpus: 4, memory: 16+}"), [LAB, T4], skypilot=True) == []


def test_the_launch_of_a_cpu_job_is_its_nodes_with_skypilots_env_and_no_gpu() -> None:
    job = record("cpu", cpu_task(2))
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=1, attempt=1, gpus=2,
                    batch_size=2, pool=LAB.id)
    req = launch_request(job, intent, LAB, ActuatorConfig())
    assert (req.nodes, req.gpus_per_node, req.accelerator) == (2, 1, Accelerator.CPU)
    env = req.env
    assert (env["SKYPILOT_NUM_NODES"], env["SKYPILOT_NUM_GPUS_PER_NODE"]) == ("2", "0")
    assert (env[Env.CPU_ONLY], env[Env.NNODES], env[Env.NPROC]) == ("1", "2", "1")
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    gpu = record("gpu", parse_spec_text("run: x\nresources: {accelerators: T4:2}").spec)
    gpu_env = launch_request(gpu, intent.model_copy(update={"job_id": gpu.id, "pool": T4.id}),
                             T4, ActuatorConfig()).env
    assert Env.CPU_ONLY not in gpu_env and gpu_env["SKYPILOT_NUM_GPUS_PER_NODE"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in gpu_env


@pytest.mark.parametrize("per_node", [True, False])
def test_the_agent_shows_a_cpu_jobs_process_no_gpu(per_node: bool) -> None:
    env = {Env.CPU_ONLY: "1", Env.NNODES: "2", Env.MASTER_ADDR: "127.0.0.1",
           Env.MASTER_PORT: "29500", "CUDA_VISIBLE_DEVICES": "0,1",
           **({Env.PER_NODE: "1"} if per_node else {})}
    config, command = parse(["--", "true"], env)
    worker = Agent(config, command, env).worker_env(0)
    assert worker["CUDA_VISIBLE_DEVICES"] == ""
    if per_node:
        assert (worker["SKYPILOT_NUM_GPUS_PER_NODE"], worker["SKYPILOT_NUM_NODES"]) == ("0", "2")
    gpu_env = {k: v for k, v in env.items() if k != Env.CPU_ONLY}
    config, command = parse(["--", "true"], gpu_env)
    assert Agent(config, command, gpu_env).worker_env(0)["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_fleet_file_cpu_region_is_a_pool_of_whole_nodes() -> None:
    fleet = LocalFleet.model_validate({"regions": [
        {"region": "lab", "cpu_nodes": 3, "cpus_per_node": 4, "memory_gib_per_node": 16,
         "price_per_node_hour": 0.1}]})
    [pool] = [r.pool() for r in fleet.regions]
    assert pool == LAB and pool.capacity == 3 and pool.gpu_counts == (1, 2, 3)
    assert pool.shape(2) == (2, 1) and pool.price_for(2) == 0.1
    with pytest.raises(ValueError, match=r"a CPU region \(cpu_nodes\) has no GPUs"):
        LocalFleet.model_validate({"regions": [
            {"region": "x", "cpu_nodes": 2, "cpus_per_node": 4, "price_per_node_hour": 0,
             "gpus": 2}]})


OWN = "name: c\nrun: echo hi\n"  # a CPU job needs no batch_size or work


@pytest.mark.parametrize(("extra", "nodes", "cpus", "memory"), [
    ("cpus: 4+\n", 1, "4+", None), ("accelerators: [CPU]\nnodes: 3\n", 3, None, None),
    ("cpus: 4\nmemory: 16+\nnodes: 2\n", 2, "4", "16+")])
def test_an_own_format_job_with_a_node_size_or_cpu_is_a_cpu_job_of_its_nodes(
        extra: str, nodes: int, cpus: str | None, memory: str | None) -> None:
    spec = parse_spec_text(OWN + extra).spec
    assert spec.accelerators == [Accelerator.CPU] and not spec.run_per_node
    assert (spec.nodes, spec.gpus.min, spec.gpus.max, spec.cpus, spec.memory) == (
        nodes, nodes, nodes, cpus, memory)
    job = record("own", spec)
    assert planned([job], [LAB, T4]).launches == {job.id: (LAB.id, nodes)}


@pytest.mark.parametrize(("extra", "field", "words"), [
    ("accelerators: [CPU, T4]\n", "accelerators", "cannot be listed with GPU types"),
    ("accelerators: [CPU]\nnodes: 2\ngpus: 3\n", "gpus", "takes whole nodes"),
    ("accelerators: [T4]\ncpus: 4\n", "cpus", "a GPU job is sized by its accelerator"),
    ("accelerators: [T4]\nmemory: 16+\n", "memory", "a GPU job is sized by its accelerator")])
def test_an_own_format_job_mixing_cpu_and_gpu_is_refused_at_the_field_to_fix(
        extra: str, field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec_text(OWN + "batch_size: 4\nwork: {samples: 8}\n" + extra)
    assert [(p.field, words in p.message) for p in info.value.problems] == [(field, True)], \
        info.value.problems
