"""GCP provider through the real google-cloud-compute SDK (REST, anonymous credentials).

The HTTP bodies follow Compute Engine's documented v1 JSON (instances, zone operations, regions,
error payloads), served by `responses`; a fetched instance is the one the SDK sent, echoed with
a status.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import responses
from google.auth.credentials import AnonymousCredentials

from policies.models import Accelerator, Market
from providers import bootstrap
from providers.base import (
    CapacityError,
    LaunchRequest,
    Node,
    NodeState,
    NotConfiguredError,
    QuotaError,
    replacement_key,
)
from providers.catalog import load_offers
from providers.gcp.provider import GcpProvider

BASE = "https://compute.googleapis.com/compute/v1/projects/proj"
OFFERS = load_offers(["gcp"], root=Path("/nonexistent"))


@pytest.fixture
def gcp() -> GcpProvider:
    return GcpProvider(
        "proj", ["us-central1"], broker_id="b1", credentials=AnonymousCredentials(), offers=OFFERS
    )


@pytest.fixture
def http() -> Iterator[responses.RequestsMock]:
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def request(key: str = "job-9:3:0", market: Market = Market.SPOT, **kw) -> LaunchRequest:
    fields = {
        "idempotency_key": key, "job_id": "job-9", "region": "us-central1",
        "accelerator": Accelerator.V100, "gpus_per_node": 1, "nodes": 1, "market": market,
        "command": ["python", "train.py"],
    }  # fmt: skip
    return LaunchRequest(**{**fields, **kw})


def operation(name: str, zone: str, status: str = "RUNNING", errors: list | None = None) -> dict:
    op = {
        "kind": "compute#operation",
        "name": name,
        "zone": f"{BASE}/zones/{zone}",
        "operationType": "insert",
        "status": status,
    }
    if errors:
        op["error"] = {"errors": errors}
    return op


def error(code: int, reason: str, message: str) -> dict:
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": reason}],
        }
    }


def serve_instances(http: responses.RequestsMock, zone: str, store: dict[str, dict]) -> None:
    """Inserts record the SDK's JSON in ``store``; gets echo it back with a status."""

    def insert(req):
        body = json.loads(req.body)
        store[body["name"]] = {
            **body,
            "zone": f"{BASE}/zones/{zone}",
            "status": "PROVISIONING",
            "creationTimestamp": "2026-12-02T05:00:00.000-08:00",
        }
        return 200, {}, json.dumps(operation(f"op-{body['name']}", zone))

    def get(req):
        name = urlparse(req.url).path.rsplit("/", 1)[-1]
        if name not in store:
            return 404, {}, json.dumps(error(404, "notFound", f"instance {name} not found"))
        return 200, {}, json.dumps(store[name])

    http.add_callback(responses.POST, f"{BASE}/zones/{zone}/instances", callback=insert)
    http.add_callback(responses.GET, re.compile(rf"{BASE}/zones/{zone}/instances/[\w-]+$"), get)
    http.add(
        responses.POST,
        re.compile(rf"{BASE}/zones/{zone}/operations/[\w-]+/wait$"),
        json=operation("op", zone, status="DONE"),
    )


def test_spot_vm_with_gpu_request_id_and_labels(gcp: GcpProvider, http) -> None:
    req = request()
    zone = gcp.offer_for(req).zone
    store: dict[str, dict] = {}
    serve_instances(http, zone, store)
    nodes = gcp.launch(req)
    assert [n.node_id for n in nodes] == [f"{zone}/{gcp.instance_names(req)[0]}"]
    node = nodes[0]
    assert (node.market, node.accelerator, node.gpus, node.job_id) == (
        Market.SPOT,
        Accelerator.V100,
        1,
        "job-9",
    )
    assert node.state is NodeState.PENDING and node.idempotency_key == "job-9:3:0"
    insert = next(
        c
        for c in http.calls
        if c.request.method == "POST" and c.request.url.split("?")[0].endswith("/instances")
    )
    assert parse_qs(urlparse(insert.request.url).query)["requestId"] == [
        bootstrap.request_uuid("job-9:3:0/0")
    ]
    body = json.loads(insert.request.body)
    assert body["scheduling"]["provisioningModel"] == "SPOT"
    assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert body["guestAccelerators"] == [
        {
            "acceleratorType": f"zones/{zone}/acceleratorTypes/nvidia-tesla-v100",
            "acceleratorCount": 1,
        }
    ]
    assert (
        body["labels"][bootstrap.BROKER_TAG] == "b1"
        and body["labels"][bootstrap.JOB_TAG] == "job-9"
    )
    script = next(i["value"] for i in body["metadata"]["items"] if i["key"] == "startup-script")
    assert "\npython3 -m broker.runtime.agent -- python train.py" in script
    assert any(
        c.request.url.endswith("/wait") for c in http.calls
    )  # the zone operation was awaited


def test_built_in_gpu_types_and_on_demand(gcp: GcpProvider, http) -> None:
    req = request(
        accelerator=Accelerator.A100, gpus_per_node=8, market=Market.ON_DEMAND, key="k-a100"
    )
    offer = gcp.offer_for(req)
    assert offer.instance_type.startswith("a2-")
    serve_instances(http, offer.zone, {})
    gcp.launch(req)
    body = json.loads(http.calls[0].request.body)
    assert body["machineType"].endswith(f"/machineTypes/{offer.instance_type}")
    assert "guestAccelerators" not in body  # A2 machines carry their GPUs
    assert body["scheduling"]["provisioningModel"] == "STANDARD"


def test_relaunch_of_an_existing_name_returns_it(gcp: GcpProvider, http) -> None:
    req = request(nodes=2)
    zone = gcp.offer_for(req).zone
    store: dict[str, dict] = {}
    serve_instances(http, zone, store)
    first = gcp.launch(req)
    http.replace(
        responses.POST,
        f"{BASE}/zones/{zone}/instances",
        status=409,
        json=error(409, "alreadyExists", "The resource already exists"),
    )
    again = gcp.launch(req)
    assert [n.node_id for n in again] == [n.node_id for n in first] and len(store) == 2


def inserted(http) -> list[dict]:
    """The instance bodies the SDK POSTed, in order."""
    return [json.loads(c.request.body) for c in http.calls
            if c.request.method == "POST" and c.request.url.split("?")[0].endswith("/instances")]


def startup_script(body: dict) -> str:
    return next(i["value"] for i in body["metadata"]["items"] if i["key"] == "startup-script")


def serve_listing(http, zone: str, store: dict[str, dict]) -> None:
    """The aggregated list: every stored instance, RUNNING."""
    vms = [{**vm, "status": "RUNNING"} for vm in store.values()]
    http.add(responses.GET, f"{BASE}/aggregated/instances",
             json={"items": {f"zones/{zone}": {"instances": vms}}})


def test_each_vm_of_a_gang_starts_as_its_own_rank(gcp: GcpProvider, http) -> None:
    """One VM per node, each with its own startup script (FLEET_NODE_RANK) and rank label, which
    the inventory reads back; relaunching the gang returns the same VMs."""
    req = request(nodes=2, first_rank=2, env={"FLEET_NODE_RANK": "0"})
    zone = gcp.offer_for(req).zone
    store: dict[str, dict] = {}
    serve_instances(http, zone, store)
    nodes = gcp.launch(req)
    assert [n.rank for n in nodes] == [2, 3]
    bodies = inserted(http)
    assert [b["labels"][bootstrap.RANK_TAG] for b in bodies] == ["2", "3"]
    assert {b["labels"][bootstrap.FIRST_RANK_TAG] for b in bodies} == {"2"}
    for rank, body in zip((2, 3), bodies, strict=True):
        script = startup_script(body)
        assert f"export FLEET_NODE_RANK={rank}\n" in script and "ami-launch-index" not in script
        assert "export FLEET_FIRST_RANK=2\n" in script and "FLEET_NODE_RANK=0" not in script
    serve_listing(http, zone, store)
    assert {n.node_id: n.rank for n in gcp.nodes()} == {n.node_id: n.rank for n in nodes}
    http.replace(responses.POST, f"{BASE}/zones/{zone}/instances", status=409,
                 json=error(409, "alreadyExists", "The resource already exists"))
    assert gcp.launch(req) == nodes and len(store) == 2


def test_a_replacement_vm_is_one_node_of_the_lost_rank(gcp: GcpProvider, http) -> None:
    """A lost node's stand-in under a key with '~' and '.': a valid GCE name and label values,
    the raw key in its metadata, rank 1; relaunching it returns it."""
    key = replacement_key("job-9:3:0", 1, 4)
    req = request(key=key, nodes=1, first_rank=1)
    zone = gcp.offer_for(req).zone
    store: dict[str, dict] = {}
    serve_instances(http, zone, store)
    (node,) = gcp.launch(req)
    assert (node.rank, node.idempotency_key) == (1, key)
    (body,) = inserted(http)
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])", body["name"])
    assert all(re.fullmatch(r"[a-z0-9_-]{0,63}", v) for v in body["labels"].values())
    assert body["labels"][bootstrap.KEY_TAG] == bootstrap.label_value(key)
    assert (body["labels"][bootstrap.RANK_TAG], body["labels"][bootstrap.FIRST_RANK_TAG]) == \
        ("1", "1")
    assert "export FLEET_NODE_RANK=1\n" in startup_script(body)
    http.replace(responses.POST, f"{BASE}/zones/{zone}/instances", status=409,
                 json=error(409, "alreadyExists", "The resource already exists"))
    assert gcp.launch(req) == [node] and len(store) == 1


def test_stock_out_in_the_zone_operation_is_a_capacity_error(gcp: GcpProvider, http) -> None:
    req = request()
    zone = gcp.offer_for(req).zone
    serve_instances(http, zone, {})
    http.replace(
        responses.POST,
        re.compile(rf"{BASE}/zones/{zone}/operations/[\w-]+/wait$"),
        json=operation("op", zone, "DONE", [{
            "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
            "message": f"The zone 'projects/proj/zones/{zone}' does not have enough resources "
                       "available to fulfill the request.  Try a different zone.",
        }]),
    )  # fmt: skip
    with pytest.raises(CapacityError, match="ZONE_RESOURCE_POOL_EXHAUSTED"):
        gcp.launch(req)


SPOT_V100_QUOTA = (
    "Quota 'PREEMPTIBLE_NVIDIA_V100_GPUS' exceeded.  Limit: 0.0 in region us-central1."
)
ALL_GPUS = "Quota 'GPUS_ALL_REGIONS' exceeded.  Limit: 1.0 globally."


@pytest.mark.parametrize(
    ("status", "payload"),
    [
        (403, error(403, "quotaExceeded", SPOT_V100_QUOTA)),
        (200, operation("op-q", "ZONE", "DONE", [{"code": "QUOTA_EXCEEDED", "message": ALL_GPUS}])),
    ],
)  # fmt: skip
def test_quota_errors_sync_and_async(gcp: GcpProvider, http, status: int, payload: dict) -> None:
    req = request()
    zone = gcp.offer_for(req).zone
    body = json.loads(json.dumps(payload).replace("ZONE", zone))
    http.add(responses.POST, f"{BASE}/zones/{zone}/instances", status=status, json=body)
    with pytest.raises(QuotaError, match="exceeded"):
        gcp.launch(req)


def launched(gcp: GcpProvider, http, status: str) -> tuple[Node, str, dict]:
    """One VM launched on the served API, then in ``status``: (node, zone, its instance JSON)."""
    req = request()
    zone = gcp.offer_for(req).zone
    store: dict[str, dict] = {}
    serve_instances(http, zone, store)
    node = gcp.launch(req)[0]
    store[node.node_id.split("/")[1]]["status"] = status
    return node, zone, store[node.node_id.split("/")[1]]


def test_nodes_by_label_terminate_and_notices(gcp: GcpProvider, http) -> None:
    node, zone, vm = launched(gcp, http, "RUNNING")
    name = vm["name"]
    http.add(
        responses.GET,
        f"{BASE}/aggregated/instances",
        json={"items": {
            f"zones/{zone}": {"instances": [vm]},
            "zones/europe-west4-a": {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}},
        }},
    )  # fmt: skip
    listed = gcp.nodes()
    assert [(n.node_id, n.state) for n in listed] == [(node.node_id, NodeState.RUNNING)]
    agg = next(c for c in http.calls if "/aggregated/instances" in c.request.url)
    assert parse_qs(urlparse(agg.request.url).query)["filter"] == ["labels.fleet-broker = b1"]

    http.add(
        responses.GET,
        f"{BASE}/zones/{zone}/operations",
        json={"items": [{
            "name": "systemevent-1", "operationType": "compute.instances.preempted",
            "targetLink": f"{BASE}/zones/{zone}/instances/{name}", "status": "DONE",
            "insertTime": "2026-12-02T05:10:00.000-08:00",
        }]},
    )  # fmt: skip
    notice = gcp.notices()[0]
    assert (
        notice.node_id == node.node_id
        and notice.deadline.isoformat() == "2026-12-02T05:10:30-08:00"
    )

    http.add(
        responses.DELETE, f"{BASE}/zones/{zone}/instances/{name}", json=operation("op-d", zone)
    )
    gcp.terminate(node.node_id)
    http.replace(
        responses.DELETE,
        f"{BASE}/zones/{zone}/instances/{name}",
        status=404,
        json=error(404, "notFound", "gone"),
    )
    gcp.terminate(node.node_id)  # already gone: not an error


def test_a_vm_powered_off_from_inside_is_deleted_once_forgotten(gcp: GcpProvider, http) -> None:
    """The start script powers the VM off when its agent exits: GCE keeps it TERMINATED, disk
    and all, until the broker deletes it."""
    node, zone, vm = launched(gcp, http, "TERMINATED")
    name = vm["name"]
    http.add(responses.GET, f"{BASE}/aggregated/instances",
             json={"items": {f"zones/{zone}": {"instances": [vm]}}})
    assert [n.state for n in gcp.nodes()] == [NodeState.TERMINATED]
    http.add(responses.DELETE, f"{BASE}/zones/{zone}/instances/{name}",
             json=operation("op-d", zone))
    gcp.forget(node.node_id)
    assert [c.request.method for c in http.calls if name in c.request.url][-1] == "DELETE"


def test_capacity_from_region_gpu_quotas(gcp: GcpProvider, http) -> None:
    http.add(
        responses.GET,
        f"{BASE}/regions/us-central1",
        json={"name": "us-central1", "quotas": [
            {"metric": "NVIDIA_V100_GPUS", "limit": 8, "usage": 2},
            {"metric": "PREEMPTIBLE_NVIDIA_V100_GPUS", "limit": 16, "usage": 0},
            {"metric": "NVIDIA_A100_80GB_GPUS", "limit": 4, "usage": 0},
            {"metric": "CPUS", "limit": 24, "usage": 0},
        ]},
    )  # fmt: skip
    assert gcp.capacity() == {
        "gcp:us-central1:on-demand:V100": 6,
        "gcp:us-central1:spot:V100": 16,
        "gcp:us-central1:on-demand:A100": 4,
    }


def test_missing_credentials_name_the_cloud(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    with pytest.raises(NotConfiguredError, match="gcp is not configured"):
        GcpProvider()
