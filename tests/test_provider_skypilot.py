"""SkyPilot backend: generated tasks pass our schema and SkyPilot's own parser (SkyPilot runs in
its own venv, ``.venv/skypilot``); launch/status/down at the adapter boundary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from policies.models import Accelerator, Market
from providers import bootstrap, registry
from providers.base import (
    CapacityError,
    LaunchRequest,
    NodeState,
    NotConfiguredError,
    ProviderError,
    replacement_key,
)
from providers.catalog import load_offers
from providers.skypilot import (
    RANK_LINE,
    SkyPilotProvider,
    SkySdk,
    task_for,
    task_yaml,
    validate_task,
)
from tests.skypilot_venv import in_skypilot

OFFERS = {c: load_offers([c], root=Path("/nonexistent")) for c in ("aws", "gcp", "azure")}
AGENT = "fleetbroker==0.1.0"


class RecordingSky:
    """An in-memory SkyBackend: a launched cluster is INIT, as ``sky status`` lists it."""

    def __init__(self) -> None:
        self.clusters: dict[str, dict[str, Any]] = {}
        self.launched: list[tuple[str, dict]] = []
        self.fail: Exception | None = None

    def launch(self, task: dict[str, Any], cluster_name: str) -> None:
        if self.fail:
            raise self.fail
        self.launched.append((cluster_name, task))
        self.clusters[cluster_name] = {
            "name": cluster_name,
            "status": "INIT",
            "labels": task["resources"]["labels"],
            "launched_at": 1_764_680_000,
        }

    def status(self) -> list[dict[str, Any]]:
        return list(self.clusters.values())

    def down(self, cluster_name: str) -> None:
        self.clusters.pop(cluster_name, None)


def request(**kw) -> LaunchRequest:
    fields = {
        "idempotency_key": "job-3:4:0", "job_id": "job-3", "region": "us-central1",
        "zone": "us-central1-a", "accelerator": Accelerator.A100, "gpus_per_node": 8, "nodes": 2,
        "market": Market.SPOT, "command": ["torchrun", "train.py", "--epochs", "3"],
    }  # fmt: skip
    return LaunchRequest(**{**fields, **kw})


def test_task_is_pinned_to_cloud_region_and_market() -> None:
    provider = SkyPilotProvider("gcp", backend=RecordingSky(), offers=OFFERS["gcp"])
    offer = provider.offer_for(request())
    task = task_for(request(), offer, "b1", AGENT)
    validate_task(task)
    assert yaml.safe_load(task_yaml(task)) == task
    res = task["resources"]
    assert (res["cloud"], res["region"], res["zone"]) == ("gcp", "us-central1", "us-central1-a")
    assert res["accelerators"] == "A100:8" and res["use_spot"] is True
    assert res["instance_type"] == offer.instance_type and task["num_nodes"] == 2
    assert task["envs"]["FLEET_JOB_ID"] == "job-3" and task["envs"]["FLEET_MARKET"] == "spot"
    assert task["run"] == RANK_LINE + bootstrap.TOKEN_TO_FILE + \
        "exec python3 -m broker.runtime.agent -- torchrun " \
        "train.py --epochs 3\n"
    assert "python3 -m pip install" in task["setup"] and AGENT in task["setup"]
    assert all(v == v.lower() for v in res["labels"].values())  # GCE label rules


def test_on_demand_aws_task_keeps_raw_tags() -> None:
    req = request(region="us-east-1", zone=None, accelerator=Accelerator.V100, gpus_per_node=8,
                  market=Market.ON_DEMAND)  # fmt: skip
    provider = SkyPilotProvider("aws", backend=RecordingSky(), offers=OFFERS["aws"])
    task = task_for(req, provider.offer_for(req), "b1", AGENT)
    validate_task(task)
    assert task["resources"]["use_spot"] is False and "zone" not in task["resources"]
    assert task["resources"]["instance_type"] in {"p3.16xlarge", "p3dn.24xlarge"}
    assert task["resources"]["labels"][bootstrap.KEY_TAG] == "job-3:4:0"
    assert task["envs"]["FLEET_CLOUD"] == "aws"
    assert not [k for k in task["envs"] if k.startswith("FLEET_NOTICE_")]  # on-demand: no notice


@pytest.mark.parametrize(
    ("cloud", "region", "zone", "accelerator", "gpus"),
    [
        ("aws", "us-east-1", None, Accelerator.V100, 1),
        ("gcp", "us-central1", "us-central1-a", Accelerator.A100, 8),
        ("azure", "eastus", None, Accelerator.V100, 1),
    ],
)
def test_spot_task_polls_its_own_clouds_notice_url(cloud, region, zone, accelerator, gpus) -> None:
    sky = RecordingSky()
    provider = SkyPilotProvider(cloud, backend=sky, offers=OFFERS[cloud])
    provider.launch(request(region=region, zone=zone, accelerator=accelerator, gpus_per_node=gpus))
    envs = sky.launched[0][1]["envs"]
    variable, url = registry.get(cloud).notice
    assert (envs["FLEET_CLOUD"], envs[variable]) == (cloud, url)
    assert [k for k in envs if k.startswith("FLEET_NOTICE_")] == [variable]


def test_schema_accepts_the_documented_example() -> None:
    validate_task({
        "name": "my-task", "workdir": "~/my-task-code", "num_nodes": 4,
        "resources": {"cloud": "aws", "region": "us-east-1", "zone": "us-east-1a",
                      "accelerators": "H100:8", "cpus": "4+", "memory": "32+",
                      "instance_type": "p3.8xlarge", "use_spot": False, "disk_size": 256,
                      "disk_tier": "medium", "image_id": "ami-0868a20f5a3bf9702", "ports": 8081,
                      "labels": {"my-label": "my-value"}, "job_recovery": "FAILOVER"},
        "envs": {"MY_BUCKET": "skypilot-temp-gcs-test", "MODEL_SIZE": "13b"},
        "file_mounts": {"/remote/path": "/local/path"},
        "setup": "pip install -r requirements.txt\n", "run": "python train.py\n",
    })  # fmt: skip
    validate_task({"resources": {"infra": "gcp/us-central1", "accelerators": {"A100": 8}}})


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda t: t["resources"].update(use_spots=True), "resources"),
        (lambda t: t["resources"].update(accelerators="A100:x"), "resources/accelerators"),
        (lambda t: t["resources"].update(cloud="gpc"), "resources/cloud"),
        (lambda t: t["resources"].update(infra="gcp/us-central1"), "resources"),
        (lambda t: t.update(num_nodes=0), "num_nodes"),
        (lambda t: t["envs"].update({"BAD-NAME": "x"}), "envs"),
    ],
)
def test_schema_rejects_bad_tasks_naming_the_field(mutate, where: str) -> None:
    task = task_for(request(), None, "b1", AGENT)
    task["resources"]["cloud"] = "gcp"
    mutate(task)
    with pytest.raises(ValueError, match=f"invalid at {where}"):
        validate_task(task)


def test_launch_follow_and_terminate_through_the_adapter() -> None:
    sky = RecordingSky()
    provider = SkyPilotProvider("gcp", backend=sky, broker_id="b1", offers=OFFERS["gcp"])
    nodes = provider.launch(request())
    name = provider.cluster_name(request())
    assert [n.node_id for n in nodes] == [f"{name}#0", f"{name}#1"]
    assert all(n.state is NodeState.PENDING and n.market is Market.SPOT for n in nodes)
    assert nodes[0].accelerator is Accelerator.A100 and nodes[0].region == "us-central1"
    assert provider.launch(request()) == nodes and len(sky.launched) == 1  # idempotent by name
    sky.clusters[name]["status"] = "UP"
    assert {n.state for n in provider.nodes()} == {NodeState.RUNNING}
    provider.terminate(f"{name}#1")
    assert provider.nodes() == []
    provider.terminate(f"{name}#0")  # already down: not an error


def run_on_node(task: dict[str, Any], skypilot_rank: int, tmp_path: Path) -> str:
    """The FLEET_NODE_RANK the agent gets when SkyPilot runs ``task``'s run with its envs on
    its node ``skypilot_rank`` (``python3`` a stub that prints it)."""
    stub = tmp_path / "python3"
    stub.write_text('#!/bin/sh\necho "$FLEET_NODE_RANK"\n')
    stub.chmod(0o755)
    env = {**task["envs"], "PATH": f"{tmp_path}:/usr/bin:/bin",
           "SKYPILOT_NODE_RANK": str(skypilot_rank)}
    out = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_each_node_of_a_cluster_runs_as_its_rank(tmp_path: Path) -> None:
    """SkyPilot runs one task on every node: each adds its SKYPILOT_NODE_RANK to the launch's
    first rank (no rank of the broker's env, which would be every node's); the inventory's
    ``<cluster>#i`` is rank first + i."""
    sky = RecordingSky()
    provider = SkyPilotProvider("gcp", backend=sky, broker_id="b1", offers=OFFERS["gcp"])
    req = request(first_rank=2, env={"FLEET_NODE_RANK": "0"})
    nodes = provider.launch(req)
    assert [n.rank for n in nodes] == [2, 3]
    (_, task), = sky.launched
    assert task["envs"]["FLEET_FIRST_RANK"] == "2" and "FLEET_NODE_RANK" not in task["envs"]
    assert task["resources"]["labels"][bootstrap.FIRST_RANK_TAG] == "2"
    assert [run_on_node(task, i, tmp_path) for i in (0, 1)] == ["2", "3"]
    assert provider.launch(req) == nodes and len(sky.launched) == 1


def test_a_replacement_cluster_is_one_node_of_the_lost_rank(tmp_path: Path) -> None:
    sky = RecordingSky()
    provider = SkyPilotProvider("aws", backend=sky, broker_id="b1", offers=OFFERS["aws"])
    key = replacement_key("job-3:4:0", 1, 2)
    req = request(idempotency_key=key, region="us-east-1", zone=None,
                  accelerator=Accelerator.V100, gpus_per_node=1, nodes=1, first_rank=1)
    (node,) = provider.launch(req)
    assert (node.rank, node.idempotency_key) == (1, key)
    (_, task), = sky.launched
    assert task["envs"]["FLEET_NODE_RANK"] == "1" and not task["run"].startswith(RANK_LINE)
    assert task["resources"]["labels"][bootstrap.KEY_TAG] == key  # an AWS tag takes '~' and '.'
    assert run_on_node(task, 0, tmp_path) == "1"
    assert provider.launch(req) == [node] and len(sky.launched) == 1


def test_errors_at_the_boundary() -> None:
    sky = RecordingSky()
    provider = SkyPilotProvider("gcp", backend=sky, offers=OFFERS["gcp"])
    sky.fail = CapacityError("no A100 in us-central1-a")
    with pytest.raises(CapacityError):
        provider.launch(request())
    sky.fail = RuntimeError("controller unreachable")
    with pytest.raises(ProviderError, match="controller unreachable"):
        provider.launch(request())
    with pytest.raises(CapacityError, match="3x A100"):
        provider.launch(request(gpus_per_node=3))


def test_missing_skypilot_is_a_clear_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sky", None)  # import sky -> ImportError
    with pytest.raises(NotConfiguredError, match="pip install 'skypilot"):
        SkySdk()


def test_the_adapter_against_a_real_skypilot_api_server(tmp_path: Path) -> None:
    """SkyPilot's own API server on loopback (offline): listing and a down of a missing
    cluster go through its request API; a launch it cannot carry out (no cloud reachable here)
    comes back as a ProviderError naming the cluster, which the actuator counts as a failed
    launch, never as an exception out of the broker loop."""
    req = request(region="us-east-1", zone=None, accelerator=Accelerator.V100, gpus_per_node=1)
    got = in_skypilot("server", [req.model_dump(mode="json")], tmp_path)
    assert got["nodes"] == [] and got["after"] == []
    assert got["launch"] is not None and got["launch"].startswith("ProviderError: skypilot launch")


def test_skypilot_itself_parses_every_generated_task(tmp_path: Path) -> None:
    cases = [
        ("aws", request(region="us-east-1", zone=None, accelerator=Accelerator.V100,
                        gpus_per_node=1, nodes=1)),
        ("aws", request(region="us-east-1", zone=None, accelerator=Accelerator.V100,
                        gpus_per_node=8, market=Market.ON_DEMAND)),
        ("gcp", request()),
        ("gcp", request(accelerator=Accelerator.T4, gpus_per_node=4, market=Market.ON_DEMAND)),
        ("azure", request(region="eastus", zone=None, accelerator=Accelerator.V100,
                          gpus_per_node=1)),
        # a lost node's stand-in: its key ('~', '.') in the labels, its rank in the envs
        ("aws", request(idempotency_key=replacement_key("job-3:4:0", 1, 2), region="us-east-1",
                        zone=None, accelerator=Accelerator.V100, gpus_per_node=1, nodes=1,
                        first_rank=1)),
        ("gcp", request(idempotency_key=replacement_key("job-3:4:0", 1, 2), nodes=1,
                        first_rank=1)),
        # a job with secrets: in the task's secrets, never its envs
        ("aws", request(region="us-east-1", zone=None, accelerator=Accelerator.V100,
                        gpus_per_node=1, nodes=1, env={"HF_TOKEN": "hf_x", "MODEL": "gpt2"},
                        secret_names=frozenset({"HF_TOKEN"}))),
    ]  # fmt: skip
    tasks = []
    for cloud, req in cases:
        sky = RecordingSky()
        SkyPilotProvider(cloud, backend=sky, offers=OFFERS[cloud]).launch(req)
        tasks.append(sky.launched[0][1])
    parsed = in_skypilot("parse", tasks, tmp_path)
    for (cloud, req), task, got in zip(cases, tasks, parsed, strict=True):
        assert "error" not in got, got
        res = task["resources"]
        assert (got["cloud"], got["region"], got["zone"]) == (cloud, req.region, req.zone)
        assert got["accelerators"] == {req.accelerator.value: req.gpus_per_node}
        assert got["use_spot"] is (req.market is Market.SPOT)
        assert (got["instance_type"], got["num_nodes"]) == (res["instance_type"], req.nodes)
        assert got["labels"] == res["labels"] and got["envs"] == task["envs"]
        assert (got["run"], got["setup"]) == (task["run"], task["setup"])
        assert got["secrets"] == sorted(req.secret_names)
        assert not req.secret_names & set(got["envs"])


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda t: t["resources"].update(use_spott=True), "use_spott"),
        (lambda t: t.update(num_nodes="two"), "num_nodes"),
        (lambda t: t["resources"].update(cloud="ibmm"), "ibmm"),
    ],
)
def test_skypilot_itself_rejects_a_broken_task(mutate, says: str, tmp_path: Path) -> None:
    sky = RecordingSky()
    SkyPilotProvider("gcp", backend=sky, offers=OFFERS["gcp"]).launch(request())
    task = sky.launched[0][1]
    mutate(task)
    (got,) = in_skypilot("parse", [task], tmp_path)
    assert says in got.get("error", "")


def test_the_sdk_adapter_calls_skypilots_real_functions(tmp_path: Path) -> None:
    sky = RecordingSky()
    SkyPilotProvider("gcp", backend=sky, offers=OFFERS["gcp"]).launch(request())
    task = sky.launched[0][1]
    got = in_skypilot("sdk", [task], tmp_path)
    assert got["calls"] == [
        ["launch", ["cluster_name", "down", "retry_until_up"]], ["stream_and_get", []],
        ["status", ["refresh"]], ["get", []], ["down", []], ["get", []], ["down", []],
        ["get", []], ["launch", ["cluster_name", "down", "retry_until_up"]],
        ["stream_and_get", []],
    ]  # fmt: skip
    assert got["status"] == [{"name": "c1", "status": "UP", "launched_at": 1_764_680_000,
                              "labels": task["resources"]["labels"]}]
    assert got["refused"].startswith("skypilot c2: ") and "no A100 in zone" in got["refused"]


SKY_FLEET = """
regions:
  - {cloud: local, region: lab, market: spot, accelerator: A100, price_per_gpu_hour: 9.0, gpus: 1}
clouds:
  gcp: {launcher: skypilot, regions: [us-central1], accelerators: [A100], markets: [spot],
        max_gpus: 8, options: {broker_id: unit}}
"""


def test_a_fleet_cloud_may_launch_through_skypilot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from providers.fleet import build_fleet_provider

    sky = RecordingSky()
    monkeypatch.setattr("providers.skypilot.SkySdk", lambda: sky)
    (tmp_path / "fleet.yaml").write_text(SKY_FLEET)
    fleet, skipped = build_fleet_provider(tmp_path / "fleet.yaml", tmp_path / "state", tmp_path)
    assert not skipped and isinstance(fleet.for_cloud("gcp"), SkyPilotProvider)
    pool = next(p for p in fleet.pools() if p.cloud == "gcp")
    assert (pool.region, pool.market, pool.capacity) == ("us-central1", Market.SPOT, 8)
    (node,) = fleet.launch(request(cloud="gcp", nodes=1))
    cluster, task = sky.launched[0]
    assert task["resources"]["cloud"] == "gcp" and task["resources"]["region"] == "us-central1"
    assert (node.provider, node.region, node.job_id) == ("skypilot", "us-central1", "job-3")
    assert [n.node_id for n in fleet.nodes() if n.provider == "skypilot"] == [node.node_id]
    down = sky.down
    sky.down = lambda name: (_ for _ in ()).throw(OSError("api server unreachable"))
    # an SDK's own exception reaches the broker as a ProviderError, which its passes retry
    with pytest.raises(ProviderError, match=r"skypilot terminate .*api server unreachable"):
        fleet.terminate(node.node_id)
    sky.down = down
    fleet.terminate(node.node_id)  # routed to the backend that listed it: `sky down`
    assert cluster not in sky.clusters


def test_skypilot_clouds_list_their_own_clusters_and_an_outage_names_the_cloud(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clouds through one SkyPilot: each lists only its own clusters, and a failing
    `sky status` reports those clouds unreachable (their jobs wait), not "skypilot"."""
    from providers.fleet import build_fleet_provider

    sky = RecordingSky()
    monkeypatch.setattr("providers.skypilot.SkySdk", lambda: sky)
    (tmp_path / "fleet.yaml").write_text(SKY_FLEET + """
  aws: {launcher: skypilot, regions: [us-east-1], accelerators: [V100], markets: [spot],
        max_gpus: 8, options: {broker_id: unit}}
""")
    fleet, _ = build_fleet_provider(tmp_path / "fleet.yaml", tmp_path / "state", tmp_path)
    (on_gcp,) = fleet.launch(request(cloud="gcp", nodes=1))
    (on_aws,) = fleet.launch(request(idempotency_key="job-4:1:0", job_id="job-4", cloud="aws",
                                     region="us-east-1", zone=None,
                                     accelerator=Accelerator.V100, gpus_per_node=1, nodes=1))
    assert [n.node_id for n in fleet.clouds["gcp"].nodes()] == [on_gcp.node_id]
    assert [n.node_id for n in fleet.clouds["aws"].nodes()] == [on_aws.node_id]
    assert sorted(n.node_id for n in fleet.nodes()) == sorted([on_gcp.node_id, on_aws.node_id])
    monkeypatch.setattr(sky, "status", lambda: (_ for _ in ()).throw(OSError("api down")))
    fleet.nodes()
    assert fleet.unreachable() == {"gcp", "aws"}


def test_a_skypilot_cloud_without_skypilot_is_skipped_naming_the_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from providers.fleet import build_fleet_provider

    monkeypatch.setitem(sys.modules, "sky", None)  # `import sky` fails as if not installed
    (tmp_path / "fleet.yaml").write_text(SKY_FLEET)
    fleet, skipped = build_fleet_provider(tmp_path / "fleet.yaml", tmp_path / "state", tmp_path)
    assert list(skipped) == ["gcp"] and "pip install 'skypilot[aws,gcp,azure]'" in skipped["gcp"]
    assert [p.cloud for p in fleet.pools()] == ["local"]
