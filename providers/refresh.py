"""Refresh catalog prices from the clouds' own APIs and write them as the user's catalog files.

AWS: spot prices per AZ from ``describe_spot_price_history`` (on-demand stays the snapshot's).
GCP: GPU on-demand and spot prices per region from the Cloud Billing Catalog API, re-joined with the
snapshot's host VM rows. Azure: VM on-demand and spot prices from the public Retail Prices API.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from providers import catalog
from providers.base import NotConfiguredError
from providers.catalog import CatalogOffer

GCP_COMPUTE_SERVICE = "6F81-5844-456A"  # Compute Engine in the Cloud Billing Catalog
GCP_SKUS_URL = f"https://cloudbilling.googleapis.com/v1/services/{GCP_COMPUTE_SERVICE}/skus"
AZURE_PRICES_URL = "https://prices.azure.com/api/retail/prices"


# --- AWS -----------------------------------------------------------------------------------------


def refresh_aws(session: Any, offers: list[CatalogOffer] | None = None) -> list[CatalogOffer]:
    """The AWS offers with spot prices from the last spot price per (type, AZ), keyed by AZ id."""
    offers = offers if offers is not None else catalog.snapshot_aws()
    out: list[CatalogOffer] = []
    for region in sorted({o.region for o in offers}):
        rows = [o for o in offers if o.region == region]
        ec2 = session.client("ec2", region_name=region)
        zone_id = {
            z["ZoneName"]: z["ZoneId"]
            for z in ec2.describe_availability_zones()["AvailabilityZones"]
        }
        latest: dict[tuple[str, str], tuple[datetime, float]] = {}
        pages = ec2.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=sorted({o.instance_type for o in rows}),
            ProductDescriptions=["Linux/UNIX"],
            StartTime=datetime.now(UTC),
        )
        for page in pages:
            for h in page["SpotPriceHistory"]:
                if not h["ProductDescription"].startswith("Linux/UNIX"):
                    continue
                key = (h["InstanceType"], zone_id.get(h["AvailabilityZone"], h["AvailabilityZone"]))
                if key not in latest or h["Timestamp"] > latest[key][0]:
                    latest[key] = (h["Timestamp"], float(h["SpotPrice"]))
        by_type = {o.instance_type: o for o in rows}
        seen = set()
        for o in rows:
            price = latest.get((o.instance_type, o.zone or ""))
            out.append(o.model_copy(update={"spot_price": price[1]}) if price else o)
            seen.add((o.instance_type, o.zone))
        for (itype, zone), (_, price) in sorted(latest.items()):  # AZs the snapshot lacked
            if (itype, zone) not in seen and itype in by_type:
                out.append(by_type[itype].model_copy(update={"zone": zone, "spot_price": price}))
    return out


# --- GCP -----------------------------------------------------------------------------------------

# Billing-catalog GPU descriptions -> the catalog's GPU names (most specific first).
_GCP_GPU_NAMES = [
    (r"A100 80GB", "A100-80GB"),
    (r"A100", "A100"),
    (r"H100 80GB Mega|H100 Mega", "H100-MEGA"),
    (r"H100", "H100"),
    (r"H200", "H200"),
    (r"B200", "B200"),
    (r"\bL4\b", "L4"),
    (r"T4", "T4"),
    (r"V100", "V100"),
    (r"P100", "P100"),
    (r"P4\b", "P4"),
    (r"K80", "K80"),
]


def _gcp_gpu(description: str) -> str | None:
    if "GPU" not in description or "Commit" in description:
        return None
    for pattern, name in _GCP_GPU_NAMES:
        if re.search(pattern, description):
            return name
    return None


def _unit_price(sku: dict[str, Any]) -> float | None:
    try:
        rate = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"][-1]["unitPrice"]
    except (KeyError, IndexError):
        return None
    return int(rate.get("units", 0) or 0) + rate.get("nanos", 0) / 1e9


def gcp_gpu_prices(get_json: Callable[[str, dict], dict]) -> dict[tuple[str, str, str], float]:
    """``(gpu, region, OnDemand|Preemptible) -> USD per GPU-hour`` from the billing catalog."""
    prices: dict[tuple[str, str, str], float] = {}
    params: dict[str, str] = {"currencyCode": "USD"}
    while True:
        page = get_json(GCP_SKUS_URL, params)
        for sku in page.get("skus", []):
            category = sku.get("category", {})
            usage = category.get("usageType")
            gpu = _gcp_gpu(sku.get("description", ""))
            price = _unit_price(sku)
            if category.get("resourceGroup") != "GPU" or usage not in ("OnDemand", "Preemptible"):
                continue
            if gpu is None or price is None:
                continue
            for region in sku.get("serviceRegions", []):
                prices[(gpu, region, usage)] = price
        token = page.get("nextPageToken")
        if not token:
            return prices
        params = {**params, "pageToken": token}


def refresh_gcp(get_json: Callable[[str, dict], dict]) -> list[CatalogOffer]:
    """GCP offers with GPU prices from the billing catalog (host VM prices from the snapshot)."""
    prices = gcp_gpu_prices(get_json)
    gpus = list(csv.DictReader((catalog.GCP_DIR / "gcp_gpu_accelerator_prices.csv").open()))
    for row in gpus:
        count = int(float(row["AcceleratorCount"]))
        for column, usage in (("Price", "OnDemand"), ("SpotPrice", "Preemptible")):
            per_gpu = prices.get((row["AcceleratorName"], row["Region"], usage))
            if per_gpu is not None:
                row[column] = f"{per_gpu * count:.5f}"
    hosts = list(csv.DictReader((catalog.GCP_DIR / "gcp_gpu_host_vm_prices.csv").open()))
    return catalog.rows_to_offers(catalog.combine_gcp(hosts, gpus), "gcp")


# --- Azure ---------------------------------------------------------------------------------------


def refresh_azure(
    get_json: Callable[[str, dict], dict], offers: list[CatalogOffer] | None = None
) -> list[CatalogOffer]:
    """Azure offers with Linux pay-as-you-go and spot prices from the Retail Prices API."""
    offers = offers if offers is not None else catalog.snapshot_azure()
    found: dict[tuple[str, str], dict[str, float]] = {}
    for size in sorted({o.instance_type for o in offers}):
        url: str | None = AZURE_PRICES_URL
        params: dict[str, str] = {
            "$filter": "serviceName eq 'Virtual Machines' and priceType eq 'Consumption' "
            f"and armSkuName eq '{size}'"
        }
        while url:
            page = get_json(url, params)
            for item in page.get("Items", []):
                if item.get("productName", "").endswith("Windows") or "Low Priority" in item.get(
                    "skuName", ""
                ):
                    continue
                if item.get("unitOfMeasure") != "1 Hour":
                    continue
                market = "spot" if item.get("skuName", "").endswith("Spot") else "price"
                found.setdefault((size, item["armRegionName"]), {})[market] = item["retailPrice"]
            url, params = page.get("NextPageLink"), {}
    out = []
    for o in offers:
        got = found.get((o.instance_type, o.region), {})
        update = {
            k: v for k, v in (("price", got.get("price")), ("spot_price", got.get("spot"))) if v
        }
        out.append(o.model_copy(update=update) if update else o)
    return out


# --- what `fleet prices --refresh` runs ----------------------------------------------------------


def _http_get_json(session: Any) -> Callable[[str, dict], dict]:
    def get_json(url: str, params: dict) -> dict:
        resp = session.get(url, params=params, timeout=60)
        resp.raise_for_status()
        return resp.json()

    return get_json


@dataclass
class RefreshReport:
    """What ``refresh_clouds`` did: a one-line outcome per cloud, and which clouds failed."""

    outcome: dict[str, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    refreshed: list[str] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        """Every cloud that could be tried failed (unconfigured, skipped clouds do not count)."""
        return bool(self.failed) and not self.refreshed


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def refresh_clouds(clouds: list[str], root: Any = None) -> RefreshReport:
    """Refresh each cloud that can be refreshed; one cloud's failure keeps its previous offers
    and does not stop the others."""
    report = RefreshReport()
    for cloud in clouds:
        try:
            offers = _REFRESHERS[cloud]()
        except NotConfiguredError as exc:
            report.outcome[cloud] = f"skipped: {exc}"
            continue
        except Exception as exc:  # network, HTTP, API or parse errors: any of them, per cloud
            report.outcome[cloud] = f"failed: {_one_line(exc)}; kept the previous offers"
            report.failed.append(cloud)
            continue
        result = catalog.write_user_catalog(cloud, offers, root)
        note = " (your edited vms.csv was kept)" if result.kept_user_file else ""
        report.outcome[cloud] = f"{len(offers)} offers -> {result.path}{note}"
        report.refreshed.append(cloud)
    return report


def _aws_now() -> list[CatalogOffer]:
    import boto3

    session = boto3.Session()
    if session.get_credentials() is None:
        raise NotConfiguredError("aws is not configured: no credentials in boto3's default chain")
    return refresh_aws(session)


def _gcp_now() -> list[CatalogOffer]:
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    from google.auth.transport.requests import AuthorizedSession

    try:
        credentials, _ = google.auth.default(
            scopes=["https://www.googleapis.com/auth/cloud-billing.readonly"]
        )
    except DefaultCredentialsError as exc:
        raise NotConfiguredError(
            "gcp is not configured: run `gcloud auth application-default login`"
        ) from exc
    return refresh_gcp(_http_get_json(AuthorizedSession(credentials)))


def _azure_now() -> list[CatalogOffer]:
    try:
        import requests  # the Retail Prices API is public: no credentials needed
    except ImportError as exc:
        raise NotConfiguredError("azure refresh needs `pip install fleetbroker[azure]`") from exc

    return refresh_azure(_http_get_json(requests.Session()))


_REFRESHERS: dict[str, Callable[[], list[CatalogOffer]]] = {
    "aws": _aws_now,
    "gcp": _gcp_now,
    "azure": _azure_now,
}
