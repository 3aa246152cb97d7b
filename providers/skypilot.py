"""SkyPilot as a launch backend: a LaunchRequest becomes a task pinned to one cloud, region, market.

The broker decides placement and recovery itself, so each launch is a plain SkyPilot cluster
(``sky launch``; not a managed job) named after the idempotency key: relaunching the same name
reuses the cluster. SkyPilot sits behind a small adapter (``SkyBackend``) imported lazily, because
the package pulls ~98 dependencies and is not a requirement of FleetBroker.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

from broker.protocol import shell
from policies.models import Accelerator, Market, Offer
from providers import bootstrap, registry
from providers.base import (
    CapacityError,
    LaunchRequest,
    Node,
    NodeState,
    NotConfiguredError,
    Provider,
    ProviderError,
    QuotaError,
)
from providers.catalog import CatalogOffer, load_offers

SCHEMA_PATH = Path(__file__).parent / "data" / "skypilot" / "task.schema.json"
NOT_INSTALLED = (
    "skypilot is not configured: the `sky` package is not installed. Install it with "
    "`pip install 'skypilot[aws,gcp,azure]'` and run `sky check`."
)
REGION_LABEL = "fleet-region"
NODES_LABEL = "fleet-nodes"
CLOUD_LABEL = "fleet-cloud"  # one SkyPilot provider per cloud lists only its own clusters
STATE = {"INIT": NodeState.PENDING, "UP": NodeState.RUNNING, "STOPPED": NodeState.TERMINATED}
# A node of a multi-node cluster: its rank in the job is the launch's first plus SkyPilot's
# own node rank (0 on the head node), which SkyPilot exports to every node's run.
RANK_LINE = shell("export @NODE_RANK=$((@FIRST_RANK + "
                  "${SKYPILOT_NODE_RANK:?SkyPilot sets it on every node}))\n")


class SkyBackend(Protocol):
    """The three SkyPilot calls the provider needs."""

    def launch(self, task: dict[str, Any], cluster_name: str) -> None: ...

    def status(self) -> list[dict[str, Any]]:
        """Clusters as ``{"name", "status", "labels", "launched_at"}`` records."""
        ...

    def down(self, cluster_name: str) -> None: ...


class SkySdk:
    """The SkyPilot Python SDK (0.9+ request API: each call returns a request id to ``sky.get``)."""

    def __init__(self) -> None:
        try:
            import sky
        except ImportError as exc:
            raise NotConfiguredError(NOT_INSTALLED) from exc
        self._sky = sky

    def launch(self, task: dict[str, Any], cluster_name: str) -> None:
        sky = self._sky
        request = sky.launch(
            sky.Task.from_yaml_config(task),
            cluster_name=cluster_name,
            down=True,
            retry_until_up=False,
        )
        try:
            sky.stream_and_get(request)
        except sky.exceptions.ResourcesUnavailableError as exc:
            raise CapacityError(f"skypilot {cluster_name}: {exc}") from exc

    def status(self) -> list[dict[str, Any]]:
        records = self._sky.get(self._sky.status(refresh=self._sky.StatusRefreshMode.AUTO))
        out = []
        for r in records:
            handle = r.get("handle")
            resources = getattr(handle, "launched_resources", None)
            out.append(
                {
                    "name": r["name"],
                    "status": getattr(r["status"], "value", str(r["status"])),
                    "labels": dict(getattr(resources, "labels", None) or {}),
                    "launched_at": r.get("launched_at"),
                }
            )
        return out

    def down(self, cluster_name: str) -> None:
        try:
            self._sky.get(self._sky.down(cluster_name))
        except self._sky.exceptions.ClusterDoesNotExist:
            return


def task_for(
    request: LaunchRequest, offer: CatalogOffer | None, broker_id: str, agent_install: str
) -> dict[str, Any]:
    """The SkyPilot task (as the dict its YAML holds) for one launch, pinned where we chose; its
    setup installs the agent from ``agent_install`` where the image lacks it. The job's secrets
    go in the task's ``secrets`` (SkyPilot redacts those), not its ``envs``."""
    accelerator = offer.accelerator_name if offer else request.accelerator.value
    cloud = offer.cloud if offer else None
    labels = {
        **bootstrap.tags(request, broker_id),
        REGION_LABEL: request.region,
        NODES_LABEL: str(request.nodes),
        **({CLOUD_LABEL: cloud} if cloud else {}),
    }
    if cloud:  # each cloud's rules for label values (GCE's: a-z 0-9 _ -)
        labels = {k: registry.get(cloud).tag_value(v) for k, v in labels.items()}
    resources: dict[str, Any] = {
        "cloud": cloud,
        "region": request.region,
        "accelerators": f"{accelerator}:{request.gpus_per_node}",
        "use_spot": request.market is Market.SPOT,
        "labels": labels,
    }
    if request.zone:
        resources["zone"] = request.zone
    if request.instance_type or offer:
        resources["instance_type"] = request.instance_type or offer.instance_type
    # The VM's own cloud: its agent polls that cloud's metadata for the spot notice.
    envs = bootstrap.agent_env(request, cloud or "skypilot")
    secrets = {k: envs.pop(k) for k in sorted(request.secret_names) if k in envs}
    return {
        "name": f"fleet-{bootstrap.label_value(request.job_id)}",
        "num_nodes": request.nodes,
        "resources": {k: v for k, v in resources.items() if v is not None},
        "envs": envs,
        **({"secrets": secrets} if secrets else {}),
        "setup": "set -euo pipefail\n" + bootstrap.install_step(agent_install),
        "run": (RANK_LINE if request.nodes > 1 else "") + bootstrap.agent_command(request),
    }


def task_yaml(task: dict[str, Any]) -> str:
    return yaml.safe_dump(task, sort_keys=False)


def validate_task(task: dict[str, Any]) -> None:
    """Check a task against our JSON schema of SkyPilot's task format; the error names the field."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(task), key=lambda e: e.path)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top)"
        raise ValueError(f"SkyPilot task invalid at {where}: {errors[0].message}")


class SkyPilotProvider(Provider):
    """Launch through SkyPilot on one of its clouds; nodes are ``<cluster>#<i>``, the i-th node
    of the cluster (SKYPILOT_NODE_RANK), of rank first rank + i in the job."""

    name = "skypilot"
    starts_agent = True  # the user data / startup script runs the agent
    keeps_secrets = True  # the task's ``secrets``, which SkyPilot redacts
    separable_nodes = False  # ``terminate`` takes the whole cluster down

    def __init__(
        self,
        cloud: str,
        *,
        regions: Sequence[str] | None = None,
        backend: SkyBackend | None = None,
        broker_id: str = "fleetbroker",
        offers: list[CatalogOffer] | None = None,
        agent_install: str | None = None,
    ) -> None:
        self.cloud = cloud
        self.agent_install = bootstrap.agent_install_spec(agent_install)
        self.broker_id = broker_id
        offers = offers if offers is not None else load_offers([cloud])
        self._offers = [o for o in offers if regions is None or o.region in regions]
        self._backend = backend if backend is not None else SkySdk()

    def offers(self) -> list[Offer]:
        return list(self._offers)

    def capacity(self) -> dict[str, int]:
        return {}  # SkyPilot exposes no quota API; the cloud providers report headroom

    def cluster_name(self, request: LaunchRequest) -> str:
        return f"fleet-{bootstrap.token(request.idempotency_key, 12)}"

    def offer_for(self, request: LaunchRequest) -> CatalogOffer | None:
        fits = [
            o
            for o in self._offers
            if o.region == request.region
            and o.accelerator is request.accelerator
            and o.accelerator_count == request.gpus_per_node
            and (request.instance_type is None or o.instance_type == request.instance_type)
            and o.hourly(request.market) is not None
        ]
        return min(fits, key=lambda o: (o.hourly(request.market), o.instance_type), default=None)

    def launch(self, request: LaunchRequest) -> list[Node]:
        name = self.cluster_name(request)
        existing = [n for n in self.nodes() if n.node_id.split("#")[0] == name]
        if existing and existing[0].state is not NodeState.TERMINATED:
            return existing
        offer = self.offer_for(request)
        if offer is None:
            raise CapacityError(
                f"skypilot {self.cloud} {request.region}: no {request.gpus_per_node}x "
                f"{request.accelerator.value} on {request.market.value} in the catalog"
            )
        task = task_for(request, offer, self.broker_id, self.agent_install)
        validate_task(task)
        try:
            self._backend.launch(task, name)
        except (CapacityError, QuotaError, NotConfiguredError):
            raise
        except Exception as exc:
            raise ProviderError(f"skypilot launch {name}: {exc}") from exc
        return [n for n in self.nodes() if n.node_id.split("#")[0] == name]

    def terminate(self, node_id: str) -> None:
        """Takes the whole cluster down: SkyPilot cannot remove one node of a cluster."""
        self._backend.down(node_id.split("#")[0])

    def nodes(self) -> list[Node]:
        out = []
        for record in self._backend.status():
            labels = record.get("labels") or {}
            if labels.get(bootstrap.BROKER_TAG) not in (
                self.broker_id,
                bootstrap.label_value(self.broker_id),
            ) or labels.get(CLOUD_LABEL, self.cloud) != self.cloud:
                continue
            launched = record.get("launched_at")
            for index in range(int(labels.get(NODES_LABEL, "1"))):
                out.append(
                    Node(
                        node_id=f"{record['name']}#{index}",
                        provider=self.name,
                        region=labels.get(REGION_LABEL, ""),
                        job_id=labels.get(bootstrap.JOB_TAG),
                        idempotency_key=labels.get(bootstrap.KEY_TAG),
                        accelerator=Accelerator.parse(labels[bootstrap.ACCELERATOR_TAG]),
                        gpus=int(labels.get(bootstrap.GPUS_TAG, "0")),
                        market=Market(labels.get(bootstrap.MARKET_TAG, "on-demand")),
                        state=STATE.get(record["status"], NodeState.TERMINATED),
                        launched_at=datetime.fromtimestamp(launched, UTC) if launched else None,
                        rank=bootstrap.tagged_rank(labels, index),
                    )
                )
        return out
