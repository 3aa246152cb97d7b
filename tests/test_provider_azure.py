"""Azure provider through the real azure-mgmt-compute SDK with a fake token credential.

ARM's documented JSON (VMs, async operations, usages, error payloads) is served by `responses`;
a VM read back is the one the SDK PUT, echoed with a provisioning state.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import responses
from azure.core.credentials import AccessToken

from policies.models import Accelerator, Market
from providers import bootstrap
from providers.azure.provider import AzureProvider
from providers.base import (
    CapacityError,
    LaunchRequest,
    NodeState,
    NotConfiguredError,
    QuotaError,
    replacement_key,
)
from providers.catalog import instance_sizes, load_offers

ARM = "https://management.azure.com"
RG = f"{ARM}/subscriptions/sub-1/resourceGroups/rg-fleet/providers/Microsoft.Compute"
VM_URL = re.compile(rf"{RG}/virtualMachines/(?P<name>[\w-]+)\?")
OP_URL = f"{ARM}/subscriptions/sub-1/providers/Microsoft.Compute/locations/eastus/operations/op-1"
OFFERS = load_offers(["azure"], root=Path("/nonexistent"))
SUBNET = (
    "/subscriptions/sub-1/resourceGroups/net/providers/Microsoft.Network"
    "/virtualNetworks/v/subnets/s"
)


class FakeCredential:
    """A TokenCredential that hands out a fixed bearer token (no identity service involved)."""

    def get_token(self, *scopes: str, **kwargs) -> AccessToken:
        return AccessToken("fake-token", 4_102_444_800)


def make_azure(**kw: Any) -> AzureProvider:
    return AzureProvider(
        "sub-1", "rg-fleet", SUBNET, ["eastus"], broker_id="b1", credential=FakeCredential(),
        ssh_public_key="ssh-ed25519 AAAA test", offers=OFFERS, polling_interval=0, **kw,
    )  # fmt: skip


@pytest.fixture
def azure() -> AzureProvider:
    return make_azure(agent_install="https://host/fleetbroker.whl")


@pytest.fixture
def http() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def request(key: str = "job-5:2:0", market: Market = Market.SPOT, **kw) -> LaunchRequest:
    fields = {
        "idempotency_key": key, "job_id": "job-5", "region": "eastus",
        "accelerator": Accelerator.V100, "gpus_per_node": 1, "nodes": 1, "market": market,
        "command": ["python", "train.py"],
    }  # fmt: skip
    return LaunchRequest(**{**fields, **kw})


def arm_error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def serve_vms(http: responses.RequestsMock, store: dict[str, dict], op_status: dict) -> None:
    """PUT stores the body and answers 201 + Azure-AsyncOperation; GET echoes it back."""

    def name_of(req) -> str:
        return VM_URL.match(req.url).group("name")

    def put(req):
        body = json.loads(req.body)
        name = name_of(req)
        body["properties"]["provisioningState"] = "Creating"
        body["properties"]["timeCreated"] = "2026-12-02T13:00:00Z"
        store[name] = {
            **body,
            "name": name,
            "id": f"/vm/{name}",
            "type": "Microsoft.Compute/virtualMachines",
        }
        return (
            201,
            {"Azure-AsyncOperation": f"{OP_URL}?api-version=2025-04-01"},
            json.dumps(store[name]),
        )

    def get(req):
        name = name_of(req)
        if name not in store:
            return 404, {}, json.dumps(arm_error("ResourceNotFound", f"VM {name} not found"))
        vm = store[name]
        if op_status.get("status") == "Succeeded":
            vm["properties"]["provisioningState"] = "Succeeded"
        return 200, {}, json.dumps(vm)

    http.add_callback(responses.PUT, VM_URL, callback=put)
    http.add_callback(responses.GET, VM_URL, callback=get)
    http.add_callback(
        responses.GET, re.compile(re.escape(OP_URL)), lambda _: (200, {}, json.dumps(op_status))
    )


def test_spot_vm_with_eviction_policy_and_agent(azure: AzureProvider, http) -> None:
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    nodes = azure.launch(request())
    assert [n.node_id for n in nodes] == azure.vm_names(request())
    assert (nodes[0].market, nodes[0].state, nodes[0].job_id) == (
        Market.SPOT,
        NodeState.RUNNING,
        "job-5",
    )
    put = next(c for c in http.calls if c.request.method == "PUT")
    assert put.request.headers["Authorization"] == "Bearer fake-token"
    props = json.loads(put.request.body)["properties"]
    assert props["priority"] == "Spot" and props["evictionPolicy"] == "Delete"
    assert props["billingProfile"] == {"maxPrice": -1.0}
    assert props["hardwareProfile"]["vmSize"] == azure.vm_size_for(request())
    script = base64.b64decode(props["osProfile"]["customData"]).decode()
    assert "\npython3 -m broker.runtime.agent -- python train.py" in script
    install = "pip install --quiet --disable-pip-version-check https://host/fleetbroker.whl"
    # the option, before the agent
    assert script.index(install) < script.index("\npython3 -m broker.runtime.agent")
    tags = json.loads(put.request.body)["tags"]
    assert tags[bootstrap.BROKER_TAG] == "b1" and tags[bootstrap.KEY_TAG] == "job-5:2:0"


def test_same_key_same_name_no_second_vm(azure: AzureProvider, http) -> None:
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    first = azure.launch(request(nodes=2))
    again = azure.launch(request(nodes=2))
    assert [n.node_id for n in again] == [n.node_id for n in first] and len(store) == 2
    assert sum(c.request.method == "PUT" for c in http.calls) == 2
    other = azure.launch(request(key="job-5:2:1", market=Market.ON_DEMAND))
    assert other[0].market is Market.ON_DEMAND and len(store) == 3


def put_bodies(http) -> list[dict]:
    """The VM bodies the SDK PUT, in order."""
    return [json.loads(c.request.body) for c in http.calls if c.request.method == "PUT"]


def custom_data(body: dict) -> str:
    return base64.b64decode(body["properties"]["osProfile"]["customData"]).decode()


def test_each_vm_of_a_gang_starts_as_its_own_rank(azure: AzureProvider, http) -> None:
    """One VM per node, each with its own custom data (FLEET_NODE_RANK) and rank tag, which the
    inventory reads back; relaunching the gang PUTs nothing and returns the same VMs."""
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    req = request(nodes=2, env={"FLEET_NODE_RANK": "0"})
    nodes = azure.launch(req)
    assert [n.rank for n in nodes] == [0, 1]
    bodies = put_bodies(http)
    assert [b["tags"][bootstrap.RANK_TAG] for b in bodies] == ["0", "1"]
    assert {b["tags"][bootstrap.FIRST_RANK_TAG] for b in bodies} == {"0"}
    for rank, body in zip((0, 1), bodies, strict=True):
        script = custom_data(body)
        assert f"export FLEET_NODE_RANK={rank}\n" in script and "ami-launch-index" not in script
        assert script.count("FLEET_NODE_RANK=") == 1  # the broker's rank is not every node's
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines\?"),
             json={"value": list(store.values())})
    serve_power(http, dict.fromkeys(store, "running"))
    assert {n.node_id: n.rank for n in azure.nodes()} == {n.node_id: n.rank for n in nodes}
    assert azure.launch(req) == nodes and len(put_bodies(http)) == 2


def test_a_replacement_vm_is_one_node_of_the_lost_rank(azure: AzureProvider, http) -> None:
    """A lost node's stand-in under a key with '~' and '.': a valid VM name, the raw key as a
    tag, rank 1; relaunching it finds it."""
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    key = replacement_key("job-5:2:0", 1, 3)
    req = request(key=key, first_rank=1)
    (node,) = azure.launch(req)
    assert (node.rank, node.idempotency_key) == (1, key)
    (body,) = put_bodies(http)
    assert re.fullmatch(r"[a-z0-9-]{1,64}", node.node_id)
    assert body["properties"]["osProfile"]["computerName"] == node.node_id
    assert (body["tags"][bootstrap.KEY_TAG], body["tags"][bootstrap.RANK_TAG]) == (key, "1")
    assert "export FLEET_NODE_RANK=1\n" in custom_data(body)
    assert azure.launch(req) == [node] and len(put_bodies(http)) == 1


def test_allocation_failure_in_the_async_operation(azure: AzureProvider, http) -> None:
    failed = {"status": "Failed", "error": {
        "code": "AllocationFailed",
        "message": "Allocation failed. We do not have sufficient capacity for the requested VM "
                   "size in this region.",
    }}  # fmt: skip
    serve_vms(http, {}, failed)
    with pytest.raises(CapacityError, match="AllocationFailed"):
        azure.launch(request())


@pytest.mark.parametrize(
    ("code", "message", "error"),
    [
        ("OperationNotAllowed", "Operation could not be completed as it results in exceeding "
         "approved LowPriorityCores quota. Location: eastus, Current Limit: 0.", QuotaError),
        ("QuotaExceeded", "Quota exceeded for Standard NCSv3 Family vCPUs.", QuotaError),
        ("SkuNotAvailable", "The requested VM size Standard_NC6s_v3 is currently not available "
         "in location 'eastus'.", CapacityError),
    ],
)  # fmt: skip
def test_put_errors_map(azure: AzureProvider, http, code: str, message: str, error: type) -> None:
    http.add(responses.GET, VM_URL, status=404, json=arm_error("ResourceNotFound", "none"))
    http.add(responses.PUT, VM_URL, status=409, json=arm_error(code, message))
    with pytest.raises(error, match=code):
        azure.launch(request())


def test_list_by_tag_and_delete(azure: AzureProvider, http) -> None:
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    node = azure.launch(request())[0]
    foreign = {**store[node.node_id], "name": "other", "tags": {bootstrap.BROKER_TAG: "b2"}}
    http.add(
        responses.GET,
        re.compile(rf"{RG}/virtualMachines\?"),
        json={"value": [store[node.node_id], foreign]},
    )
    assert [n.node_id for n in azure.nodes()] == [node.node_id]
    http.add(responses.DELETE, VM_URL, status=200)
    azure.terminate(node.node_id)
    http.replace(responses.DELETE, VM_URL, status=404, json=arm_error("ResourceNotFound", "gone"))
    azure.terminate(node.node_id)  # already gone: not an error
    assert [c.request.method for c in http.calls][-2:] == ["DELETE", "DELETE"]


def test_capacity_from_regional_vcpu_quotas(azure: AzureProvider, http) -> None:
    http.add(
        responses.GET,
        re.compile(rf"{ARM}/subscriptions/sub-1/providers/Microsoft.Compute/locations/eastus/usages"),
        json={"value": [
            {"name": {"value": "lowPriorityCores", "localizedValue": "Spot vCPUs"},
             "currentValue": 12, "limit": 100, "unit": "Count"},
            {"name": {"value": "cores", "localizedValue": "Total Regional vCPUs"},
             "currentValue": 10, "limit": 10, "unit": "Count"},
        ]},
    )  # fmt: skip
    cap = azure.capacity()
    spot, on_demand = azure.quotas()
    assert (spot.free, on_demand.free) == (88, 0)
    per_gpu = {
        a: min(o.vcpus / o.accelerator_count for o in OFFERS
               if o.region == "eastus" and o.accelerator is a)
        for a in {o.accelerator for o in OFFERS if o.region == "eastus"}
    }  # fmt: skip
    assert spot.per_gpu == {f"azure:eastus:spot:{a}": v for a, v in per_gpu.items()}
    # One regional budget for every accelerator, dealt in whole instances, biggest first:
    # never the whole 88 vCPUs promised to each (a V100 pool and a T4 pool each counting on all
    # of it would overcommit the region), and every count is one the pool's instances launch.
    sizes = instance_sizes("azure", OFFERS)
    spot_pools = sorted(spot.per_gpu)
    for pool in spot_pools:
        assert cap[pool] == 0 or any(cap[pool] % n == 0 for n in sizes[pool])
    assert cap["azure:eastus:on-demand:V100"] == 0
    # Each instance is charged its own type's vCPUs, not its GPUs times the fewest vCPUs a GPU
    # (12 for A100, from ND96asr_v4's 8): the cheapest 1, 2 and 4 A100 types have 24 a GPU.
    # Charged 12 a GPU, 88 vCPUs were A100 4 (an NC96ads_A100_v4, really 96 vCPUs), H100 2
    # (NC80adis, 80), M60 1 and T4 1: 192 vCPUs of launches against 88.
    a100, h100 = "azure:eastus:spot:A100", "azure:eastus:spot:H100"
    assert spot.per_gpu[a100] == 12
    assert spot.per_instance[a100] == {1: 24, 2: 48, 4: 96, 8: 96}
    assert {p: n for p, n in cap.items() if n and ":spot:" in p} == {a100: 2, h100: 1}
    assert spot.units(a100, 2) + spot.units(h100, 1) == 48 + 40 <= 88


def test_not_configured_names_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AZURE_SUBSCRIPTION_ID", "FLEET_AZURE_RESOURCE_GROUP", "FLEET_AZURE_SUBNET_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        NotConfiguredError, match="azure is not configured: set AZURE_SUBSCRIPTION_ID"
    ):
        AzureProvider()


def serve_power(http: responses.RequestsMock, power: dict[str, str]) -> None:
    """Each VM's instance view, with its power state from ``power`` (VM name -> state)."""

    def instance_view(req):
        name = re.search(r"virtualMachines/([\w-]+)/instanceView", req.url).group(1)
        statuses = [{"code": "ProvisioningState/succeeded", "level": "Info"},
                    {"code": f"PowerState/{power[name]}", "level": "Info"}]  # fmt: skip
        return 200, {}, json.dumps({"statuses": statuses})

    http.add_callback(responses.GET, re.compile(rf"{RG}/virtualMachines/[\w-]+/instanceView"),
                      callback=instance_view)  # fmt: skip


def test_a_vm_powered_off_from_inside_is_terminated_and_deleted_whatever_its_priority(
        azure: AzureProvider, http) -> None:
    """The start script's exit trap runs ``shutdown -h now``: on Azure that leaves the VM
    ``Stopped``, provisioning state still ``Succeeded``, and billing for compute. An on-demand
    VM and a Spot VM under ``Delete`` powered off so are gone for the broker (not evictions) and
    deleted once it forgets them; a running one is left alone."""
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    regular, running = (azure.launch(request(key=f"job-5:2:{i}", market=Market.ON_DEMAND))[0]
                        .node_id for i in (0, 1))
    spot = azure.launch(request(key="job-5:2:2"))[0].node_id  # evictionPolicy Delete
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines\?"),
             json={"value": [store[n] for n in (regular, running, spot)]})  # fmt: skip
    serve_power(http, {regular: "stopped", running: "running", spot: "stopped"})
    state = {n.node_id: n.state for n in azure.nodes()}
    assert state == {regular: NodeState.TERMINATED, running: NodeState.RUNNING,
                     spot: NodeState.TERMINATED}  # fmt: skip
    assert azure.notices() == []  # shut down from inside, not evicted
    http.add(responses.DELETE, VM_URL, status=200)
    for name in (regular, running, spot):
        azure.forget(name)
    deleted = [c.request.url for c in http.calls if c.request.method == "DELETE"]
    assert [u.split("/virtualMachines/")[1].split("?")[0] for u in deleted] == [regular, spot]


def test_deallocated_spot_vm_is_an_eviction_not_a_running_node(http) -> None:
    """Under ``Deallocate`` an evicted Spot VM stays listed as ``Succeeded``: its instance view's
    power state tells it is gone (preempted), and it is deleted once the broker forgets it."""
    azure = make_azure(eviction_policy="Deallocate")  # evicted VMs stay listed
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    evicted, running = (azure.launch(request(key=f"job-5:2:{i}"))[0].node_id for i in (0, 1))
    stopped = azure.launch(request(key="job-5:2:2"))[0].node_id
    regular = azure.launch(request(key="job-5:2:3", market=Market.ON_DEMAND))[0].node_id
    put = next(c for c in http.calls if c.request.method == "PUT")
    assert json.loads(put.request.body)["properties"]["evictionPolicy"] == "Deallocate"
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines\?"),
             json={"value": [store[n] for n in (evicted, running, stopped, regular)]})  # fmt: skip
    serve_power(http, {evicted: "deallocated", running: "running", stopped: "stopped",
                       regular: "running"})
    state = {n.node_id: n.state for n in azure.nodes()}
    assert state == {evicted: NodeState.TERMINATED, running: NodeState.RUNNING,
                     stopped: NodeState.TERMINATED, regular: NodeState.RUNNING}  # fmt: skip
    viewed = [c.request.url for c in http.calls if "/instanceView" in c.request.url]
    assert len(viewed) == 4  # every VM's power state, on-demand too
    assert [n.node_id for n in azure.notices()] == [evicted]  # stopped from inside: no eviction
    http.add(responses.DELETE, VM_URL, status=200)
    azure.forget(running)  # still running: forget deletes nothing
    azure.forget(evicted)
    deleted = [c.request.url for c in http.calls if c.request.method == "DELETE"]
    assert len(deleted) == 1 and f"/virtualMachines/{evicted}?" in deleted[0]


def test_listing_skips_a_vm_deleted_meanwhile_and_keeps_one_whose_view_failed(
        http, caplog: pytest.LogCaptureFixture) -> None:
    """Between the list and a VM's instance view the VM may be deleted (404: it is gone) or the
    view may fail (that VM stays listed, power state unknown, a log line without the reply's
    text); neither fails the whole listing."""
    azure = make_azure(eviction_policy="Deallocate")  # evicted VMs stay listed
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    deleted, flaky, evicted = (azure.launch(request(key=f"job-5:2:{i}"))[0].node_id
                               for i in range(3))
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines\?"),
             json={"value": [store[n] for n in (deleted, flaky, evicted)]})  # fmt: skip
    leak = "https://x.blob.core.windows.net/d?sig=SECRET-SAS"
    replies = {
        deleted: (404, arm_error("ResourceNotFound", f"The VM {deleted} was not found.")),
        flaky: (409, arm_error("OperationNotAllowed", f"busy, see {leak}")),  # not retried
        evicted: (200, {"statuses": [{"code": "PowerState/deallocated", "level": "Info"}]}),
    }

    def instance_view(req):
        name = re.search(r"virtualMachines/([\w-]+)/instanceView", req.url).group(1)
        status, body = replies[name]
        return status, {}, json.dumps(body)

    http.add_callback(responses.GET, re.compile(rf"{RG}/virtualMachines/[\w-]+/instanceView"),
                      callback=instance_view)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="providers.azure.provider"):
        state = {n.node_id: n.state for n in azure.nodes()}
    assert state == {flaky: NodeState.RUNNING, evicted: NodeState.TERMINATED}
    assert [n.node_id for n in azure.notices()] == [evicted]
    (line,) = [r.getMessage() for r in caplog.records]
    assert flaky in line and "HTTP 409 OperationNotAllowed" in line and "SECRET" not in line


@pytest.mark.parametrize(("ttl", "views"), [(30.0, 1), (0.0, 2)])
def test_power_states_are_read_once_per_ttl_not_every_pass(http, ttl: float, views: int) -> None:
    """Each owned VM's instance view is one ARM read; the broker lists every pass, so a power
    state is reused for ``power_ttl_s`` (ARM allows about 12,000 reads an hour)."""
    azure = make_azure(power_ttl_s=ttl)
    store: dict[str, dict] = {}
    serve_vms(http, store, {"status": "Succeeded"})
    vm = azure.launch(request())[0].node_id
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines\?"), json={"value": [store[vm]]})
    http.add(responses.GET, re.compile(rf"{RG}/virtualMachines/[\w-]+/instanceView"),
             json={"statuses": [{"code": "PowerState/running", "level": "Info"}]})
    for _ in range(2):
        assert [n.state for n in azure.nodes()] == [NodeState.RUNNING]
    assert len([c for c in http.calls if "/instanceView" in c.request.url]) == views
