"""GCP Compute Engine provider (google-cloud-compute): Spot VMs with GPUs, zone operations, quotas.

Idempotent twice over: instance names are derived from the idempotency key (a second insert of the
same name is ``alreadyExists``), and each insert carries ``requestId`` = UUIDv5 of the key, which
GCE deduplicates for the retried request itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from policies.models import Accelerator, Market, Offer, UnknownAccelerator, pool_id
from providers import bootstrap
from providers.base import (
    CapacityError,
    LaunchRequest,
    Node,
    NodeState,
    NotConfiguredError,
    PreemptionNotice,
    Provider,
)
from providers.catalog import CatalogOffer, load_offers
from providers.gcp import CLOUD

# GCE's accelerator type names for the catalog's (cloud) GPU names.
GPU_TYPE = {
    "T4": "nvidia-tesla-t4",
    "V100": "nvidia-tesla-v100",
    "P100": "nvidia-tesla-p100",
    "P4": "nvidia-tesla-p4",
    "K80": "nvidia-tesla-k80",
    "L4": "nvidia-l4",
    "A100": "nvidia-tesla-a100",
    "A100-80GB": "nvidia-a100-80gb",
    "H100": "nvidia-h100-80gb",
    "H100-MEGA": "nvidia-h100-mega-80gb",
    "H200": "nvidia-h200-141gb",
    "B200": "nvidia-b200",
}
STATE = {
    "PROVISIONING": NodeState.PENDING,
    "STAGING": NodeState.PENDING,
    "RUNNING": NodeState.RUNNING,
    "STOPPING": NodeState.PREEMPTING,
}
PREEMPTION_NOTICE_S = 30
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11"


def operation_error(op: Any, what: str) -> Exception | None:
    """The broker error an operation finished with (stock-outs arrive this way), or None."""
    errors = list(op.error.errors) if op.error else []
    if not errors:
        return None
    return CLOUD.classify({e.code for e in errors}, f"gcp {what}: " + "; ".join(
        f"{e.code}: {e.message}" for e in errors))


def _quota_metric(metric: str) -> tuple[Accelerator, Market] | None:
    """``PREEMPTIBLE_NVIDIA_V100_GPUS`` -> (V100, spot); ``NVIDIA_A100_80GB_GPUS`` -> (A100, od)."""
    m = re.fullmatch(r"(PREEMPTIBLE_)?NVIDIA_(\w+?)_GPUS", metric)
    if not m:
        return None
    try:
        accelerator = Accelerator.parse(m.group(2).replace("_", "-"))
    except UnknownAccelerator:
        return None
    return accelerator, Market.SPOT if m.group(1) else Market.ON_DEMAND


class GcpProvider(Provider):
    """Compute Engine in one project; nodes are ``<zone>/<instance-name>``."""

    name = "gcp"
    starts_agent = True  # the user data / startup script runs the agent

    def __init__(
        self,
        project: str | None = None,
        regions: Iterable[str] | None = None,
        *,
        broker_id: str = "fleetbroker",
        credentials: Any = None,
        image: str = DEFAULT_IMAGE,
        offers: list[CatalogOffer] | None = None,
        termination_action: str = "DELETE",
        agent_install: str | None = None,
        shutdown_command: str | None = None,
    ) -> None:
        if credentials is None:
            import google.auth
            from google.auth.exceptions import DefaultCredentialsError

            try:
                credentials, found = google.auth.default(
                    scopes=["https://www.googleapis.com/auth/cloud-platform"]
                )
            except DefaultCredentialsError as exc:
                raise NotConfiguredError(CLOUD.not_configured) from exc
            project = project or found
        if not project:
            raise NotConfiguredError(CLOUD.not_configured)
        from google.cloud import compute_v1

        self.project = project
        self.broker_id = broker_id
        self.image = image
        self.agent_install = bootstrap.agent_install_spec(agent_install)
        self.shutdown_command = shutdown_command
        self.termination_action = termination_action
        self._offers = offers if offers is not None else load_offers(["gcp"])
        self.regions = list(regions or sorted({o.region for o in self._offers}))
        opts = {"credentials": credentials, "transport": "rest"}
        self._instances = compute_v1.InstancesClient(**opts)
        self._operations = compute_v1.ZoneOperationsClient(**opts)
        self._regions = compute_v1.RegionsClient(**opts)

    # --- offers and capacity ---------------------------------------------------------------

    def offers(self) -> list[Offer]:
        return [o for o in self._offers if o.region in self.regions]

    def capacity(self) -> dict[str, int]:
        """GPU quota headroom per pool from each region's ``*_GPUS`` quota metrics."""
        out: dict[str, int] = {}
        for region in self.regions:
            try:
                info = self._regions.get(project=self.project, region=region)
            except Exception as exc:
                raise CLOUD.map_error(exc, f"regions.get {region}") from exc
            for quota in info.quotas:
                parsed = _quota_metric(quota.metric)
                if parsed is None:
                    continue
                acc, market = parsed
                pool = pool_id("gcp", region, market, acc)
                free = int(max(quota.limit - quota.usage, 0))
                out[pool] = out.get(pool, 0) + free
        return out

    # --- launch, terminate, inventory -------------------------------------------------------

    def offer_for(self, request: LaunchRequest) -> CatalogOffer:
        fits = [
            o
            for o in self._offers
            if o.region == request.region
            and (request.zone is None or o.zone == request.zone)
            and o.accelerator is request.accelerator
            and o.accelerator_count == request.gpus_per_node
            and (request.instance_type is None or o.instance_type == request.instance_type)
            and o.hourly(request.market) is not None
        ]
        if not fits:
            raise CapacityError(
                f"gcp {request.zone or request.region}: no machine type with "
                f"{request.gpus_per_node}x {request.accelerator.value} on {request.market.value}"
            )
        return min(fits, key=lambda o: (o.hourly(request.market), o.zone or "", o.instance_type))

    def instance_names(self, request: LaunchRequest) -> list[str]:
        """Deterministic names (a GCE name: ``[a-z]([-a-z0-9]{0,61}[a-z0-9])``) for the gang."""
        stem = f"fleet-{bootstrap.token(request.idempotency_key, 16)}"
        return [f"{stem}-{i}" for i in range(request.nodes)]

    def instance_resource(self, request: LaunchRequest, offer: CatalogOffer, name: str,
                          rank: int) -> Any:
        """The instance JSON of the node of rank ``rank``: its own startup script and label."""
        from google.cloud import compute_v1

        zone = offer.zone
        labels = {
            k: CLOUD.tag_value(v)
            for k, v in bootstrap.tags(request, self.broker_id, rank).items()
        }
        metadata = compute_v1.Metadata(
            items=[
                compute_v1.Items(
                    key="startup-script",
                    value=bootstrap.agent_script(request, "gcp", self.agent_install,
                                                 self.shutdown_command, rank),
                ),
                compute_v1.Items(key=bootstrap.KEY_TAG, value=request.idempotency_key),
                compute_v1.Items(key=bootstrap.JOB_TAG, value=request.job_id),
            ]
        )
        if request.market is Market.SPOT:
            scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT",
                instance_termination_action=self.termination_action,
                on_host_maintenance="TERMINATE",
                automatic_restart=False,
            )
        else:
            scheduling = compute_v1.Scheduling(
                provisioning_model="STANDARD",
                on_host_maintenance="TERMINATE",
                automatic_restart=True,
            )
        accelerators = []
        if offer.instance_type.startswith("n1-"):  # N1 hosts take GPUs as attachments
            accelerators.append(
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{GPU_TYPE[offer.accelerator_name]}",
                    accelerator_count=offer.accelerator_count,
                )
            )
        return compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{offer.instance_type}",
            labels=labels,
            metadata=metadata,
            scheduling=scheduling,
            guest_accelerators=accelerators,
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=self.image, disk_size_gb=200
                    ),
                )
            ],
            network_interfaces=[
                compute_v1.NetworkInterface(
                    network="global/networks/default",
                    access_configs=[
                        compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
                    ],
                )
            ],
        )

    def launch(self, request: LaunchRequest) -> list[Node]:
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        offer = self.offer_for(request)
        zone = offer.zone or ""
        for i, name in enumerate(self.instance_names(request)):
            resource = self.instance_resource(request, offer, name,
                                              bootstrap.node_rank(request, i))
            try:
                op = self._instances.insert_unary(
                    request=compute_v1.InsertInstanceRequest(
                        project=self.project,
                        zone=zone,
                        instance_resource=resource,
                        request_id=bootstrap.request_uuid(f"{request.idempotency_key}/{i}"),
                    )
                )
            except gexc.Conflict:
                continue  # the name exists: an earlier attempt of this launch made it
            except Exception as exc:
                raise CLOUD.map_error(exc, f"instances.insert {zone}/{name}") from exc
            self._wait(op, zone, f"instances.insert {zone}/{name}")
        return [self._get(zone, name) for name in self.instance_names(request)]

    def _wait(self, op: Any, zone: str, what: str) -> None:
        """Wait on the zone operation (stock-outs and some quota errors only show up here)."""
        while op.status != op.Status.DONE:
            try:
                op = self._operations.wait(project=self.project, zone=zone, operation=op.name)
            except Exception as exc:
                raise CLOUD.map_error(exc, f"zoneOperations.wait {op.name}") from exc
        if err := operation_error(op, what):
            raise err

    def _get(self, zone: str, name: str) -> Node:
        try:
            return self._node(self._instances.get(project=self.project, zone=zone, instance=name))
        except Exception as exc:
            raise CLOUD.map_error(exc, f"instances.get {zone}/{name}") from exc

    def terminate(self, node_id: str) -> None:
        from google.api_core import exceptions as gexc
        from google.cloud import compute_v1

        zone, _, name = node_id.partition("/")
        try:
            op = self._instances.delete_unary(
                request=compute_v1.DeleteInstanceRequest(
                    project=self.project,
                    zone=zone,
                    instance=name,
                    request_id=bootstrap.request_uuid(f"delete/{node_id}"),
                )
            )
        except gexc.NotFound:
            return
        except Exception as exc:
            raise CLOUD.map_error(exc, f"instances.delete {node_id}") from exc
        self._wait(op, zone, f"instances.delete {node_id}")

    def forget(self, node_id: str) -> None:
        """A VM powered off from inside (its start script does so once the agent exited) stays
        TERMINATED with its disk, which bills: delete it once the broker settled its job."""
        self.terminate(node_id)

    def nodes(self) -> list[Node]:
        from google.cloud import compute_v1

        label = f"labels.{bootstrap.BROKER_TAG} = {CLOUD.tag_value(self.broker_id)}"
        try:
            query = compute_v1.AggregatedListInstancesRequest(project=self.project, filter=label)
            pages = self._instances.aggregated_list(request=query)
            found = [inst for _, scoped in pages for inst in scoped.instances]
        except Exception as exc:
            raise CLOUD.map_error(exc, "instances.aggregatedList") from exc
        return [self._node(inst) for inst in found if _zone_of(inst.zone)[:-2] in self.regions]

    def notices(self) -> list[PreemptionNotice]:
        """``compute.instances.preempted`` zone operations on our instances (GCE's 30 s warning)."""
        from google.cloud import compute_v1

        owned = {n.node_id: n for n in self.nodes()}
        out = []
        for zone in sorted({n.zone for n in owned.values() if n.zone}):
            try:
                ops = self._operations.list(
                    request=compute_v1.ListZoneOperationsRequest(
                        project=self.project,
                        zone=zone,
                        filter='operationType="compute.instances.preempted"',
                    )
                )
            except Exception as exc:
                raise CLOUD.map_error(exc, f"zoneOperations.list {zone}") from exc
            for op in ops:
                node_id = f"{zone}/{op.target_link.rsplit('/', 1)[-1]}"
                if node_id in owned:
                    began = datetime.fromisoformat(op.insert_time)
                    out.append(
                        PreemptionNotice(
                            node_id=node_id,
                            region=owned[node_id].region,
                            deadline=began + timedelta(seconds=PREEMPTION_NOTICE_S),
                        )
                    )
        return out

    def _node(self, inst: Any) -> Node:
        zone = _zone_of(inst.zone)
        labels = dict(inst.labels)
        metadata = {item.key: item.value for item in inst.metadata.items}
        spot = inst.scheduling.provisioning_model == "SPOT"
        return Node(
            node_id=f"{zone}/{inst.name}",
            provider=self.name,
            region=zone[:-2],
            zone=zone,
            job_id=metadata.get(bootstrap.JOB_TAG),
            idempotency_key=metadata.get(bootstrap.KEY_TAG),
            accelerator=Accelerator.parse(labels[bootstrap.ACCELERATOR_TAG]),
            gpus=int(labels.get(bootstrap.GPUS_TAG, "0")),
            market=Market.SPOT if spot else Market.ON_DEMAND,
            state=STATE.get(inst.status, NodeState.TERMINATED),
            launched_at=datetime.fromisoformat(inst.creation_timestamp)
            if inst.creation_timestamp
            else None,
            rank=bootstrap.tagged_rank(labels),
        )


def _zone_of(url: str) -> str:
    return url.rsplit("/", 1)[-1]
