"""Azure: VMs through azure-mgmt-compute (``provider.py``), prices from the public Retail Prices
API (``refresh.py``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from broker.protocol import BrokerEnv, Env
from providers.cloud import DATA, Cloud

if TYPE_CHECKING:
    from providers.base import Provider
    from providers.catalog import CatalogOffer

CATALOG_CSV = DATA / "cloud-gpu-prices-gcp-azure" / "azure_gpu_vm_prices.csv"


class Azure(Cloud):
    name = "azure"
    aliases = ("microsoft", "az")
    region_shape = re.compile(r"^[a-z]*(east|west|north|south|central)[a-z]*\d?$")  # eastus2
    region_example = "eastus"
    object_store = "azure"
    notice = (Env.NOTICE_AZURE_URL,
              "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01")
    not_configured = (
        f"azure is not configured: set AZURE_SUBSCRIPTION_ID, {BrokerEnv.AZURE_RESOURCE_GROUP} "
        f"and {BrokerEnv.AZURE_SUBNET_ID}, and sign in for DefaultAzureCredential (`az login`, or "
        "AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or a managed identity).")
    quota_codes = frozenset({"OperationNotAllowed", "QuotaExceeded", "SubscriptionQuotaExceeded"})
    capacity_codes = frozenset({
        "AllocationFailed",
        "ZonalAllocationFailed",
        "OverconstrainedAllocationRequest",
        "OverconstrainedZonalAllocationRequest",
        "SkuNotAvailable",
        "SpotPriceTooLow",  # max price below the current spot price
    })
    # azure-core raises ClientAuthenticationError for credentials it could not get or use.
    auth_codes = frozenset({"AuthorizationFailed", "InvalidAuthenticationToken",
                            "AuthenticationFailed", "ClientAuthenticationError"})

    def error_codes(self, exc: Exception) -> tuple[set[str], str] | None:
        """An azure-core ``HttpResponseError``'s code and the known codes its message names."""
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        if isinstance(exc, ClientAuthenticationError):
            return {"ClientAuthenticationError"}, str(exc.message)
        if not isinstance(exc, HttpResponseError):
            return None
        code = getattr(exc.error, "code", None) or ""
        known = self.quota_codes | self.capacity_codes | self.auth_codes
        codes = {code} | {c for c in re.findall(r"[A-Za-z]+", str(exc.message)) if c in known}
        return codes, f"{code or exc.reason}: {exc.message}"

    def snapshot(self) -> list[CatalogOffer]:
        """Azure prices are regional: the zone stays empty, as in SkyPilot's Azure catalog."""
        from providers.catalog import read_vms_csv

        return read_vms_csv(CATALOG_CSV.read_text(), self.name, CATALOG_CSV.name)

    def refresh(self) -> list[CatalogOffer]:
        from providers.azure.refresh import offers_now

        return offers_now()

    def provider(self, **options: Any) -> Provider:
        from providers.azure.provider import AzureProvider

        return AzureProvider(**options)


CLOUD = Azure()
