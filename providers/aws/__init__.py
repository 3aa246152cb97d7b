"""AWS: EC2 through boto3 (``provider.py``), spot prices from EC2's history (``refresh.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from broker.protocol import Env
from providers.cloud import DATA, Cloud

if TYPE_CHECKING:
    from providers.base import Provider
    from providers.catalog import CatalogOffer

# SkyPilot's AWS rows, US subset (see its SOURCE.md).
CATALOG_CSV = DATA / "aws-gpu-prices-skypilot-catalog" / "aws_gpu_prices_us_subset.csv"


class Aws(Cloud):
    name = "aws"
    aliases = ("amazon", "ec2")
    region_shape = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d+$")  # us-gov-west-1
    region_example = "us-east-1"
    object_store = "s3"
    notice = (Env.NOTICE_AWS_URL,
              "http://169.254.169.254/latest/meta-data/spot/instance-action")
    not_configured = (
        "aws is not configured: boto3 found no credentials in its default chain. Set AWS_PROFILE "
        "(after `aws configure` or `aws sso login`), or AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or run on an instance with an IAM role.")
    capacity_codes = frozenset({
        "InsufficientInstanceCapacity",
        "InsufficientHostCapacity",
        "InsufficientCapacityOnHost",
        "InsufficientReservedInstanceCapacity",
        "SpotMaxPriceTooLow",
        "InsufficientFreeAddressesInSubnet",
        "Unsupported",  # the type is not offered in that AZ
    })
    quota_codes = frozenset({
        "VcpuLimitExceeded",
        "MaxSpotInstanceCountExceeded",
        "InstanceLimitExceeded",
        "MaxSpotFleetRequestCountExceeded",
        "SpotInstanceRequestLimitExceeded",
    })
    auth_codes = frozenset({"AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId",
                            "ExpiredToken"})
    error_hints: ClassVar[Mapping[str, str]] = {
        "IdempotentParameterMismatch": (
            "This launch key already started an instance with other parameters (another AZ: "
            "the AZs refused or the catalog changed since); it carries the key's tag, and the "
            "job's next attempt ends it first"),
    }

    def error_codes(self, exc: Exception) -> tuple[set[str], str] | None:
        """A botocore ``ClientError``'s code and message."""
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return None
        error = exc.response.get("Error", {})
        code = error.get("Code", "")
        return {code}, f"{code}: {error.get('Message', '')}"

    def snapshot(self) -> list[CatalogOffer]:
        """SkyPilot's AWS rows (US subset); the source dropped ``GpuInfo``, so it is empty."""
        from providers.catalog import read_vms_csv

        return read_vms_csv(CATALOG_CSV.read_text(), self.name, CATALOG_CSV.name)

    def refresh(self) -> list[CatalogOffer]:
        from providers.aws.refresh import offers_now

        return offers_now()

    def rank_step(self) -> str:
        """One RunInstances makes every node of a launch, with one user data."""
        from providers.aws.start import rank_step

        return rank_step()

    def provider(self, **options: Any) -> Provider:
        from providers.aws.provider import AwsProvider

        return AwsProvider(**options)


CLOUD = Aws()
