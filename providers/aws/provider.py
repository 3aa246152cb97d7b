"""AWS EC2 provider (boto3): catalog offers, vCPU quotas, idempotent spot/on-demand launches.

Idempotency is twofold: EC2's ``ClientToken`` (derived from the idempotency key alone, so one key
is one EC2 request whatever a lookup shows) and, before every launch, a lookup of instances tagged
with that key, so a retry returns the first launch's nodes even where ``ClientToken`` is not
honoured (moto) or has expired. One launch tries one AZ: falling back to another AZ is the
broker's next attempt, under a new key (``LaunchRequest.avoid_zones``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from policies.models import Accelerator, Market, Offer
from providers import bootstrap
from providers.aws import CLOUD
from providers.base import (
    CapacityError,
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

# Service Quotas codes (vCPUs) per instance family letter and market.
QUOTA_CODE = {
    ("p", Market.ON_DEMAND): "L-417A185B",
    ("g", Market.ON_DEMAND): "L-DB2E81BA",
    ("p", Market.SPOT): "L-7212CCBC",
    ("g", Market.SPOT): "L-3819A6DF",
}
LIVE_STATES = ["pending", "running"]
OWNED_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
STATE = {
    "pending": NodeState.PENDING,
    "running": NodeState.RUNNING,
    "stopping": NodeState.TERMINATED,
    "stopped": NodeState.TERMINATED,
    "shutting-down": NodeState.TERMINATED,
}
DLAMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)
SPOT_NOTICE_S = 120  # EC2's two-minute interruption warning


def placement(key: str, zone: str | None) -> dict[str, Any]:
    """The AZ of a launch (``None``: EC2 picks) and its ``ClientToken``, the idempotency key's
    alone: EC2 runs one request per key, so a retry can never start a second instance, in
    whatever AZ (a different AZ under the same token is ``IdempotentParameterMismatch``)."""
    token = {"ClientToken": bootstrap.token(key)}
    return token if zone is None else {**token, "Placement": {"AvailabilityZone": zone}}


S3_LEGACY_REGIONS = {"EU": "eu-west-1"}  # GetBucketLocation's old names


def _s3_bucket(uri: str) -> str | None:
    """The bucket of an ``s3://bucket/key`` URI (None for other schemes)."""
    if not uri.startswith("s3://"):
        return None
    return uri[len("s3://"):].split("/", 1)[0] or None


def _mismatch(exc: Exception) -> bool:
    """EC2 saw this ``ClientToken`` before with other parameters."""
    response = getattr(exc, "response", None) or {}
    return response.get("Error", {}).get("Code") == "IdempotentParameterMismatch"


class AwsProvider(Provider):
    """EC2 in a set of regions; nodes are ``<region>/<instance-id>``."""

    name = "aws"
    starts_agent = True  # the user data / startup script runs the agent

    def __init__(
        self,
        regions: Iterable[str] | None = None,
        *,
        broker_id: str = "fleetbroker",
        image_id: str | None = None,
        session: Any = None,
        endpoint_url: str | None = None,
        offers: list[CatalogOffer] | None = None,
        agent_install: str | None = None,
        shutdown_command: str | None = None,
    ) -> None:
        import boto3

        self._session = session or boto3.Session()
        if self._session.get_credentials() is None:
            raise NotConfiguredError(CLOUD.not_configured)
        self._offers = offers if offers is not None else load_offers(["aws"])
        self.regions = list(regions or sorted({o.region for o in self._offers}))
        self.broker_id = broker_id
        self.image_id = image_id
        self.agent_install = bootstrap.agent_install_spec(agent_install)
        self.shutdown_command = shutdown_command
        self._endpoint_url = endpoint_url
        self._clients: dict[tuple[str, str], Any] = {}
        self._zones: dict[str, dict[str, str]] = {}  # region -> AZ id or name -> name

    def _client(self, service: str, region: str) -> Any:
        key = (service, region)
        if key not in self._clients:
            self._clients[key] = self._session.client(
                service, region_name=region, endpoint_url=self._endpoint_url
            )
        return self._clients[key]

    def bucket_region(self, uri: str) -> str | None:
        """The region of an ``s3://`` checkpoint bucket (``GetBucketLocation``: no constraint
        is us-east-1, the legacy ``EU`` is eu-west-1); None for another scheme or a bucket this
        account cannot see."""
        from botocore.exceptions import BotoCoreError, ClientError

        bucket = _s3_bucket(uri)
        if bucket is None:
            return None
        try:
            got = self._client("s3", self.regions[0] if self.regions else "us-east-1") \
                .get_bucket_location(Bucket=bucket).get("LocationConstraint")
        except (ClientError, BotoCoreError) as exc:
            log.info("aws: where is bucket %s? %s", bucket, exc)
            return None
        return f"aws:{S3_LEGACY_REGIONS.get(got or '', got or 'us-east-1')}"

    # --- offers and capacity ---------------------------------------------------------------

    def offers(self) -> list[Offer]:
        return [o for o in self._offers if o.region in self.regions]

    def capacity(self) -> dict[str, int]:
        """GPU headroom per pool: each family's free vCPUs (``quotas()`` has the shared budgets)
        dealt in whole instances of the catalog's sizes among that family's accelerators,
        biggest instance first (``providers.base.share``)."""
        return share(self.quotas(), sizes=instance_sizes("aws", self.offers()))

    def quotas(self) -> list[Quota]:
        """One budget per region, family (P, G) and market: its vCPU quota minus the vCPUs in
        use (every instance counts, this broker's too), shared by the family's accelerators."""
        out = []
        for region in self.regions:
            used = self._vcpus_in_use(region)
            for (family, market), code in QUOTA_CODE.items():
                quota = self._quota(region, code)
                if quota is None:
                    continue
                free = max(quota - used.get((family, market), 0), 0)
                budget = vcpu_quota("aws", self._offers, region, market, free, family)
                if budget is not None:
                    out.append(budget)
        return out

    def _quota(self, region: str, code: str) -> float | None:
        from botocore.exceptions import ClientError

        try:
            resp = self._client("service-quotas", region).get_service_quota(
                ServiceCode="ec2", QuotaCode=code
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchResourceException":
                return None  # not known in this account/region: headroom unknown
            raise CLOUD.map_error(exc, "get_service_quota") from exc
        return float(resp["Quota"]["Value"])

    def _vcpus_in_use(self, region: str) -> dict[tuple[str, Market], int]:
        used: dict[tuple[str, Market], int] = {}
        known = {o.instance_type: o.vcpus or 0 for o in self._offers}
        live = [{"Name": "instance-state-name", "Values": LIVE_STATES}]
        for inst in self._instances(region, live):
            family = inst["InstanceType"][0]
            market = Market.SPOT if inst.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND
            if (family, market) not in QUOTA_CODE:
                continue
            cpu = inst.get("CpuOptions")
            if cpu:
                vcpus = cpu["CoreCount"] * cpu.get("ThreadsPerCore", 1)
            else:  # moto omits CpuOptions: the catalog knows the vCPUs of its types
                vcpus = int(known.get(inst["InstanceType"], 0))
            used[(family, market)] = used.get((family, market), 0) + vcpus
        return used

    # --- launch, terminate, inventory -------------------------------------------------------

    def instance_type_for(self, request: LaunchRequest) -> str:
        return cheapest_type_for(self._offers, request, "aws")

    def launch(self, request: LaunchRequest) -> list[Node]:
        """Launch in one AZ (``_launch_zone``) under the key's ``ClientToken``. With no capacity
        there while other priced AZs remain, the ``CapacityError`` names that AZ: the broker's
        next attempt (a new key) avoids it. Each node carries its AZ's spot price, the price its
        placement records, on a retry that finds the first launch too. A gang is one request
        (``MinCount = MaxCount = nodes``: all or nothing, in one AZ) with one user data: each
        instance adds its launch index to the first rank (``bootstrap.rank_step``)."""
        existing = self._by_key(request.region, request.idempotency_key)
        if existing:
            return existing
        instance_type = self.instance_type_for(request)
        zone, others = self._launch_zone(request, instance_type)
        try:
            resp = self._run(request, instance_type, zone)
        except Exception as exc:
            error = CLOUD.map_error(exc, f"run_instances in {zone or request.region}")
            if isinstance(error, CapacityError) and others:
                raise CapacityError(f"{error} (other AZs may have room)", zone=zone) from exc
            if _mismatch(exc):
                return self._replay(request, instance_type, zone, error)
            raise error from exc
        return self._launched(request.region, resp["Instances"])

    def _run(self, request: LaunchRequest, instance_type: str, zone: str | None) -> Any:
        return self._client("ec2", request.region).run_instances(
            **self._run_args(request, instance_type), **placement(request.idempotency_key, zone))

    def _replay(self, request: LaunchRequest, instance_type: str, tried: str | None,
                error: Exception) -> list[Node]:
        """The key's token already launched in another AZ (the refusals or the catalog changed
        between a launch and its retry, and the listing does not show the instance yet): the
        same request in that AZ returns that launch, and in any other starts nothing. So ask
        each priced AZ in turn for the original."""
        for zone in self._spot_prices(request.region, instance_type):
            if zone == tried:
                continue
            try:
                resp = self._run(request, instance_type, zone)
            except Exception as exc:
                if _mismatch(exc):
                    continue
                raise CLOUD.map_error(exc, f"run_instances in {zone}") from exc
            return self._launched(request.region, resp["Instances"])
        raise error

    def _run_args(self, request: LaunchRequest, instance_type: str) -> dict[str, Any]:
        """``run_instances`` arguments but the AZ and the token (``placement``)."""
        tag_list = [
            {"Key": k, "Value": v} for k, v in bootstrap.tags(request, self.broker_id).items()
        ]
        tag_list.append({"Key": "Name", "Value": f"fleet-{request.job_id}"})
        kwargs: dict[str, Any] = {
            "ImageId": self.image_id or self._default_image(request.region),
            "InstanceType": instance_type,
            "MinCount": request.nodes,
            "MaxCount": request.nodes,
            "UserData": bootstrap.agent_script(request, "aws", self.agent_install,
                                               self.shutdown_command),
            # The start script powers the VM off once its agent exited: that must end the bill.
            "InstanceInitiatedShutdownBehavior": "terminate",
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tag_list},
                {"ResourceType": "volume", "Tags": tag_list},
            ],
        }
        if request.market is Market.SPOT:
            kwargs["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        return kwargs

    def _launch_zone(self, request: LaunchRequest, instance_type: str) -> tuple[str | None, bool]:
        """The AZ (by name) of this launch attempt, and whether other priced AZs remain after
        it. A pool's own zone: that one. Spot: the cheapest AZ with a spot price for the type
        that the request does not avoid; its price is the pool's (unpinned, EC2 picks any AZ,
        often a dearer one). On-demand costs the same in every AZ: EC2 picks (``None``)."""
        if request.zone:
            return self._zone_names(request.region).get(request.zone, request.zone), False
        if request.market is not Market.SPOT:
            return None, False
        priced = self._spot_prices(request.region, instance_type)
        names = self._zone_names(request.region)
        avoid = {names.get(z, z) for z in request.avoid_zones}
        left = [z for z in priced if z not in avoid]
        if priced and not left:
            raise CapacityError(f"aws {request.region}: every AZ with a {instance_type} spot "
                                f"price refused a launch just now ({', '.join(sorted(avoid))})")
        return (left[0], len(left) > 1) if left else (None, False)

    def _spot_prices(self, region: str, instance_type: str) -> dict[str, float | None]:
        """AZ name -> the type's spot price per GPU-hour there, cheapest first."""
        names = self._zone_names(region)
        priced: dict[str, float | None] = {}
        for price, zone in sorted(
            (o.per_gpu(Market.SPOT), names[o.zone])
            for o in self._offers
            if o.region == region and o.instance_type == instance_type
            and o.spot_price is not None and o.zone in names
        ):  # fmt: skip
            priced.setdefault(zone, price)
        return priced

    def _launched(self, region: str, instances: list[dict[str, Any]]) -> list[Node]:
        """The nodes of a launch, each spot one with its AZ's price from the catalog (by AZ,
        instance type and market), the same whether the launch was just made or found again
        by its key; on-demand costs the pool's price everywhere (``None``)."""
        nodes = []
        for inst in instances:
            node = self._node(region, inst)
            if node.market is Market.SPOT and node.zone:
                price = self._spot_prices(region, inst["InstanceType"]).get(node.zone)
                node = node.model_copy(update={"price_per_gpu_hour": price})
            nodes.append(node)
        return nodes

    def _zone_names(self, region: str) -> dict[str, str]:
        """AZ id (the catalog's ``use1-az1``, the same in every account) and name -> the name
        this account launches with (``us-east-1b``), for the region's available AZs."""
        if region not in self._zones:
            try:
                found = self._client("ec2", region).describe_availability_zones(
                    Filters=[{"Name": "state", "Values": ["available"]}]
                )["AvailabilityZones"]
            except Exception as exc:
                raise CLOUD.map_error(exc, f"describe_availability_zones in {region}") from exc
            self._zones[region] = {
                key: z["ZoneName"] for z in found for key in (z["ZoneId"], z["ZoneName"])
            }
        return self._zones[region]

    def _default_image(self, region: str) -> str:
        """The Deep Learning Base AMI (NVIDIA driver) from its public SSM parameter."""
        name = DLAMI_PARAMETER
        try:
            return self._client("ssm", region).get_parameter(Name=name)["Parameter"]["Value"]
        except Exception as exc:
            raise ProviderError(
                f"aws {region}: cannot resolve the GPU image from SSM {name} ({exc}); "
                "pass image_id (an AMI with NVIDIA drivers and python3)"
            ) from exc

    def terminate(self, node_id: str) -> None:
        from botocore.exceptions import ClientError

        region, _, instance_id = node_id.partition("/")
        try:
            self._client("ec2", region).terminate_instances(InstanceIds=[instance_id])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidInstanceID.NotFound":
                return
            raise CLOUD.map_error(exc, f"terminate_instances {node_id}") from exc

    def nodes(self) -> list[Node]:
        return [
            self._node(region, inst)
            for region in self.regions
            for inst in self._instances(region, self._owned_filters())
        ]

    def notices(self) -> list[PreemptionNotice]:
        """Spot requests EC2 has ``marked-for-termination`` for our instances (2-minute warning)."""
        out = []
        for region in self.regions:
            owned = {inst["InstanceId"] for inst in self._instances(region, self._owned_filters())}
            if not owned:
                continue
            resp = self._client("ec2", region).describe_spot_instance_requests(
                Filters=[{"Name": "instance-id", "Values": sorted(owned)}]
            )
            for req in resp.get("SpotInstanceRequests", []):
                marked = req.get("Status", {}).get("Code") == "marked-for-termination"
                if marked and req.get("InstanceId") in owned:
                    since = req["Status"]["UpdateTime"]
                    out.append(
                        PreemptionNotice(
                            node_id=f"{region}/{req['InstanceId']}",
                            region=region,
                            deadline=since + timedelta(seconds=SPOT_NOTICE_S),
                        )
                    )
        return out

    def _owned_filters(self) -> list[dict[str, Any]]:
        return [
            {"Name": f"tag:{bootstrap.BROKER_TAG}", "Values": [self.broker_id]},
            {"Name": "instance-state-name", "Values": OWNED_STATES},
        ]

    def _by_key(self, region: str, key: str) -> list[Node]:
        filters = [
            {"Name": f"tag:{bootstrap.BROKER_TAG}", "Values": [self.broker_id]},
            {"Name": f"tag:{bootstrap.KEY_TAG}", "Values": [key]},
            {"Name": "instance-state-name", "Values": LIVE_STATES},
        ]
        return self._launched(region, self._instances(region, filters))

    def _instances(self, region: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            pages = (
                self._client("ec2", region)
                .get_paginator("describe_instances")
                .paginate(Filters=filters)
            )
            return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
        except Exception as exc:
            raise CLOUD.map_error(exc, f"describe_instances in {region}") from exc

    def _offer_of(self, instance_type: str) -> CatalogOffer:
        """The catalog row for an instance type (for nodes whose tags were edited away)."""
        for o in self._offers:
            if o.instance_type == instance_type:
                return o
        raise ProviderError(f"aws: instance type {instance_type} is not a GPU type in the catalog")

    def _node(self, region: str, inst: dict[str, Any]) -> Node:
        tag = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        spot = inst.get("InstanceLifecycle") == "spot" or tag.get(bootstrap.MARKET_TAG) == "spot"
        known = self._offer_of(inst["InstanceType"])
        return Node(
            node_id=f"{region}/{inst['InstanceId']}",
            provider=self.name,
            region=region,
            zone=inst.get("Placement", {}).get("AvailabilityZone"),
            job_id=tag.get(bootstrap.JOB_TAG),
            idempotency_key=tag.get(bootstrap.KEY_TAG),
            accelerator=Accelerator.parse(tag.get(bootstrap.ACCELERATOR_TAG) or known.accelerator),
            gpus=int(tag.get(bootstrap.GPUS_TAG) or known.accelerator_count),
            market=Market.SPOT if spot else Market.ON_DEMAND,
            state=STATE.get(inst["State"]["Name"], NodeState.TERMINATED),
            launched_at=inst.get("LaunchTime"),
            # The start script's rank: the launch's first rank plus the instance's index in
            # its RunInstances (``bootstrap.rank_step``), which EC2 and moto both report.
            rank=bootstrap.tagged_rank(tag, inst.get("AmiLaunchIndex")),
        )
