"""Azure provider (azure-mgmt-compute): Spot VMs in one resource group, idempotent by VM name.

A VM's name is derived from the idempotency key, and ARM's PUT of a name is idempotent, so a retried
launch finds (GET) or re-PUTs the same VM and never makes a second one. The VM creates its own NIC
(``networkInterfaceConfigurations``), so only a subnet id is needed, not azure-mgmt-network.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.errors import InvalidInput
from broker.protocol import BrokerEnv
from policies.models import Accelerator, Market, Offer
from providers import bootstrap
from providers.azure import CLOUD
from providers.base import (
    LaunchRequest,
    Node,
    NodeState,
    NotConfiguredError,
    PreemptionNotice,
    Provider,
    ProviderError,
    Quota,
    share,
)
from providers.catalog import (
    CatalogOffer,
    cheapest_type_for,
    instance_sizes,
    load_offers,
    vcpu_quota,
)

log = logging.getLogger(__name__)

STATE = {
    "Creating": NodeState.PENDING,
    "Updating": NodeState.PENDING,
    "Succeeded": NodeState.RUNNING,
}
# Power states (instance view) of a VM whose workload is gone though ARM still lists it as
# ``Succeeded``: evicted under ``Deallocate``, or powered off from inside (the start script's
# exit trap), which leaves it stopped and still billing until it is deleted.
STOPPED_POWER = {"deallocating", "deallocated", "stopping", "stopped"}
IMAGE = {  # Ubuntu 22.04 with NVIDIA drivers and CUDA (Microsoft's HPC image)
    "publisher": "microsoft-dsvm",
    "offer": "ubuntu-hpc",
    "sku": "2204",
    "version": "latest",
}


class AzureProvider(Provider):
    """Azure VMs in one resource group; nodes are VM names."""

    name = "azure"
    starts_agent = True  # the user data / startup script runs the agent

    def __init__(
        self,
        subscription_id: str | None = None,
        resource_group: str | None = None,
        subnet_id: str | None = None,
        regions: Iterable[str] | None = None,
        *,
        broker_id: str = "fleetbroker",
        credential: Any = None,
        ssh_public_key: str | None = None,
        eviction_policy: str = "Delete",
        max_price: float = -1.0,
        offers: list[CatalogOffer] | None = None,
        polling_interval: float = 15.0,
        agent_install: str | None = None,
        shutdown_command: str | None = None,
        power_ttl_s: float = 30.0,
    ) -> None:
        self.subscription_id = subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")
        self.resource_group = resource_group or os.environ.get(BrokerEnv.AZURE_RESOURCE_GROUP)
        self.subnet_id = subnet_id or os.environ.get(BrokerEnv.AZURE_SUBNET_ID)
        if not (self.subscription_id and self.resource_group and self.subnet_id):
            raise NotConfiguredError(CLOUD.not_configured)
        if eviction_policy not in ("Delete", "Deallocate"):
            raise InvalidInput(f"eviction_policy {eviction_policy!r}: use 'Delete' or "
                               "'Deallocate'")
        if credential is None:
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential()
        from azure.mgmt.compute import ComputeManagementClient

        self._compute = ComputeManagementClient(credential, self.subscription_id)
        self.broker_id = broker_id
        self.ssh_public_key = ssh_public_key
        self.eviction_policy = eviction_policy
        self.max_price = max_price  # -1: pay up to the on-demand price, never evicted for price
        self.polling_interval = polling_interval
        self.agent_install = bootstrap.agent_install_spec(agent_install)
        self.shutdown_command = shutdown_command
        self._stopped: dict[str, tuple[Node, str]] = {}  # the last nodes(): VM -> power state
        # VM name -> (when read, power state): one instance-view call per VM a pass would spend
        # ARM's read budget (about 12,000 an hour a subscription) at a few dozen VMs
        self.power_ttl_s = power_ttl_s
        self._powers: dict[str, tuple[float, str]] = {}
        self._offers = offers if offers is not None else load_offers(["azure"])
        self.regions = list(regions or sorted({o.region for o in self._offers}))

    # --- offers and capacity ---------------------------------------------------------------

    def offers(self) -> list[Offer]:
        return [o for o in self._offers if o.region in self.regions]

    def capacity(self) -> dict[str, int]:
        """GPU headroom per pool: each regional vCPU budget dealt in whole instances among the
        accelerators it covers, biggest instance first (``quotas()``, ``providers.base.share``)."""
        return share(self.quotas(), sizes=instance_sizes("azure", self._offers))

    def quotas(self) -> list[Quota]:
        """One budget per region and market: ``lowPriorityCores`` for spot, ``cores`` for
        on-demand, each shared by every accelerator of the region (VM-family quotas may be
        tighter; launches still map those to ``QuotaError``)."""
        out = []
        for region in self.regions:
            try:
                usages = {u.name.value: u for u in self._compute.usage.list(region)}
            except Exception as exc:
                raise CLOUD.map_error(exc, f"usage.list {region}") from exc
            for market, metric in ((Market.SPOT, "lowPriorityCores"), (Market.ON_DEMAND, "cores")):
                if metric not in usages:
                    continue
                free = max(usages[metric].limit - usages[metric].current_value, 0)
                budget = vcpu_quota("azure", self._offers, region, market, free)
                if budget is not None:
                    out.append(budget)
        return out

    # --- launch, terminate, inventory -------------------------------------------------------

    def vm_size_for(self, request: LaunchRequest) -> str:
        return cheapest_type_for(self._offers, request, "azure")

    def vm_names(self, request: LaunchRequest) -> list[str]:
        stem = f"fleet-{bootstrap.token(request.idempotency_key, 16)}"
        return [f"{stem}-{i}" for i in range(request.nodes)]

    def vm_body(self, request: LaunchRequest, name: str, rank: int) -> dict[str, Any]:
        """The ARM JSON of the VM of node rank ``rank`` (the documented
        ``Microsoft.Compute/virtualMachines`` shape): its own custom data and tag."""
        script = bootstrap.agent_script(request, "azure", self.agent_install,
                                        self.shutdown_command, rank)
        properties: dict[str, Any] = {
            "hardwareProfile": {"vmSize": self.vm_size_for(request)},
            "storageProfile": {
                "imageReference": IMAGE,
                "osDisk": {
                    "createOption": "FromImage",
                    "deleteOption": "Delete",
                    "diskSizeGB": 200,
                },
            },
            "osProfile": {
                "computerName": name,
                "adminUsername": "fleet",
                "customData": base64.b64encode(script.encode()).decode(),
                "linuxConfiguration": {
                    "disablePasswordAuthentication": True,
                    "ssh": {
                        "publicKeys": [
                            {"path": "/home/fleet/.ssh/authorized_keys", "keyData": self._ssh_key()}
                        ]
                    },
                },
            },
            "networkProfile": {
                "networkApiVersion": "2020-11-01",
                "networkInterfaceConfigurations": [
                    {
                        "name": f"{name}-nic",
                        "properties": {
                            "primary": True,
                            "deleteOption": "Delete",
                            "ipConfigurations": [
                                {
                                    "name": "ipconfig1",
                                    "properties": {"subnet": {"id": self.subnet_id}},
                                }
                            ],
                        },
                    }
                ],
            },
        }
        if request.market is Market.SPOT:
            properties["priority"] = "Spot"
            properties["evictionPolicy"] = self.eviction_policy
            properties["billingProfile"] = {"maxPrice": self.max_price}
        else:
            properties["priority"] = "Regular"
        body: dict[str, Any] = {
            "location": request.region,
            "tags": bootstrap.tags(request, self.broker_id, rank),
            "properties": properties,
        }
        if request.zone:
            body["zones"] = [request.zone]
        return body

    def _ssh_key(self) -> str:
        if self.ssh_public_key:
            return self.ssh_public_key
        default = Path.home() / ".ssh" / "id_rsa.pub"
        if default.exists():
            return default.read_text().strip()
        raise ProviderError(
            "azure: no SSH public key for the VMs; pass ssh_public_key or create ~/.ssh/id_rsa.pub"
        )

    def launch(self, request: LaunchRequest) -> list[Node]:
        from azure.core.exceptions import ResourceNotFoundError

        vms = self._compute.virtual_machines
        nodes = []
        for i, name in enumerate(self.vm_names(request)):
            try:
                nodes.append(self._node(vms.get(self.resource_group, name)))
                continue  # made by an earlier attempt of this launch
            except ResourceNotFoundError:
                pass
            except Exception as exc:
                raise CLOUD.map_error(exc, f"virtualMachines.get {name}") from exc
            try:
                poller = vms.begin_create_or_update(
                    self.resource_group,
                    name,
                    self.vm_body(request, name, bootstrap.node_rank(request, i)),
                    polling_interval=self.polling_interval,
                )
                nodes.append(self._node(poller.result()))
            except Exception as exc:
                raise CLOUD.map_error(exc, f"virtualMachines.createOrUpdate {name}") from exc
        return nodes

    def terminate(self, node_id: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self._compute.virtual_machines.begin_delete(
                self.resource_group, node_id, polling_interval=self.polling_interval
            ).result()
        except ResourceNotFoundError:
            return
        except Exception as exc:
            raise CLOUD.map_error(exc, f"virtualMachines.delete {node_id}") from exc

    def nodes(self) -> list[Node]:
        try:
            vms = list(self._compute.virtual_machines.list(self.resource_group))
        except Exception as exc:
            raise CLOUD.map_error(exc, "virtualMachines.list") from exc
        owned = [
            vm
            for vm in vms
            if (vm.tags or {}).get(bootstrap.BROKER_TAG) == self.broker_id
            and vm.location in self.regions
        ]
        from azure.core.exceptions import ResourceNotFoundError

        out, stopped = [], {}
        self._powers = {k: v for k, v in self._powers.items() if k in {vm.name for vm in owned}}
        for vm in owned:
            node = self._node(vm)
            try:
                power = self._power(vm) if node.state is NodeState.RUNNING else None
            except ResourceNotFoundError:
                continue  # deleted between the list and its instance view: gone
            if power in STOPPED_POWER:
                node = node.model_copy(update={"state": NodeState.TERMINATED})
                stopped[node.node_id] = (node, power)
            out.append(node)
        self._stopped = stopped
        return out

    def _power(self, vm: Any) -> str | None:
        """The VM's power state (``running``, ``stopped``, ``deallocated``...), which the
        provisioning state cannot tell: a VM of any priority powered off from inside, and a Spot
        VM evicted under ``Deallocate``, stay ``Succeeded``. One call per VM (the resource
        group's listing expands the instance view only under a scale-set filter, and the
        subscription's ``statusOnly`` listing needs a role beyond the resource group), reused
        for ``power_ttl_s``: a VM that powered off is seen that much later at most."""
        from azure.core.exceptions import AzureError, ResourceNotFoundError

        now = time.monotonic()
        read = self._powers.get(vm.name)
        if read is not None and now - read[0] < self.power_ttl_s:
            return read[1]
        try:
            view = self._compute.virtual_machines.instance_view(self.resource_group, vm.name)
        except ResourceNotFoundError:
            raise
        except AzureError as exc:
            # One VM's view must not hide the others: it stays listed, its power state unknown.
            # The status and error code only: a reply's text may quote request details.
            code = getattr(getattr(exc, "error", None), "code", None) or type(exc).__name__
            log.warning("azure virtualMachines.instanceView %s failed (HTTP %s %s); its power "
                        "state is unknown this pass", vm.name,
                        getattr(exc, "status_code", None), code)
            return None
        codes = [s.code or "" for s in view.statuses or []]
        power = next((c.split("/", 1)[1] for c in codes if c.startswith("PowerState/")), None)
        if power is not None:
            self._powers[vm.name] = (now, power)
        return power

    def notices(self) -> list[PreemptionNotice]:
        """Spot VMs the last ``nodes()`` found deallocated: Azure evicted them (a stopped one, or
        an on-demand one, was shut down from inside, not evicted)."""
        now = datetime.now(UTC)
        return [
            PreemptionNotice(node_id=node.node_id, region=node.region, deadline=now)
            for node, power in self._stopped.values()
            if node.market is Market.SPOT and power.startswith("dealloc")
        ]

    def forget(self, node_id: str) -> None:
        """A stopped VM still bills for compute, a deallocated one for its disk: delete it once
        settled, whatever its priority."""
        if self._stopped.pop(node_id, None) is not None:
            self.terminate(node_id)

    def _node(self, vm: Any) -> Node:
        tags = vm.tags or {}
        props = vm.properties
        return Node(
            node_id=vm.name,
            provider=self.name,
            region=vm.location,
            zone=(vm.zones or [None])[0],
            job_id=tags.get(bootstrap.JOB_TAG),
            idempotency_key=tags.get(bootstrap.KEY_TAG),
            accelerator=Accelerator.parse(tags[bootstrap.ACCELERATOR_TAG]),
            gpus=int(tags.get(bootstrap.GPUS_TAG, "0")),
            market=Market.SPOT if props.priority == "Spot" else Market.ON_DEMAND,
            state=STATE.get(props.provisioning_state or "", NodeState.TERMINATED),
            launched_at=props.time_created,
            rank=bootstrap.tagged_rank(tags),
        )
