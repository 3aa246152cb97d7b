"""GCP prices now: GPU on-demand and spot prices per region from the Cloud Billing Catalog API,
re-joined with the snapshot's host VM rows."""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from typing import Any

from providers.base import NotConfiguredError
from providers.catalog import CatalogOffer, rows_to_offers
from providers.gcp import CLOUD
from providers.gcp.catalog import GPUS_CSV, HOSTS_CSV, combine
from providers.refresh import http_get_json

COMPUTE_SERVICE = "6F81-5844-456A"  # Compute Engine in the Cloud Billing Catalog
SKUS_URL = f"https://cloudbilling.googleapis.com/v1/services/{COMPUTE_SERVICE}/skus"


# Billing-catalog GPU descriptions -> the catalog's GPU names (most specific first).
_GPU_NAMES = [
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


def _gpu(description: str) -> str | None:
    if "GPU" not in description or "Commit" in description:
        return None
    for pattern, name in _GPU_NAMES:
        if re.search(pattern, description):
            return name
    return None


def _unit_price(sku: dict[str, Any]) -> float | None:
    try:
        rate = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"][-1]["unitPrice"]
    except (KeyError, IndexError):
        return None
    return int(rate.get("units", 0) or 0) + rate.get("nanos", 0) / 1e9


def gpu_prices(get_json: Callable[[str, dict], dict]) -> dict[tuple[str, str, str], float]:
    """``(gpu, region, OnDemand|Preemptible) -> USD per GPU-hour`` from the billing catalog."""
    prices: dict[tuple[str, str, str], float] = {}
    params: dict[str, str] = {"currencyCode": "USD"}
    while True:
        page = get_json(SKUS_URL, params)
        for sku in page.get("skus", []):
            category = sku.get("category", {})
            usage = category.get("usageType")
            gpu = _gpu(sku.get("description", ""))
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
    prices = gpu_prices(get_json)
    gpus = list(csv.DictReader(GPUS_CSV.open()))
    for row in gpus:
        count = int(float(row["AcceleratorCount"]))
        for column, usage in (("Price", "OnDemand"), ("SpotPrice", "Preemptible")):
            per_gpu = prices.get((row["AcceleratorName"], row["Region"], usage))
            if per_gpu is not None:
                row[column] = f"{per_gpu * count:.5f}"
    hosts = list(csv.DictReader(HOSTS_CSV.open()))
    return rows_to_offers(combine(hosts, gpus), "gcp")


def offers_now() -> list[CatalogOffer]:
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    from google.auth.transport.requests import AuthorizedSession

    try:
        credentials, _ = google.auth.default(
            scopes=["https://www.googleapis.com/auth/cloud-billing.readonly"]
        )
    except DefaultCredentialsError as exc:
        raise NotConfiguredError(CLOUD.not_configured) from exc
    return refresh_gcp(http_get_json(AuthorizedSession(credentials)))
