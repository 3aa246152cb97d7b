"""Azure prices now: Linux pay-as-you-go and spot prices per VM size and region from the public
Retail Prices API (no credentials needed)."""

from __future__ import annotations

from collections.abc import Callable

from providers.azure import CLOUD
from providers.base import NotConfiguredError
from providers.catalog import CatalogOffer
from providers.refresh import http_get_json

PRICES_URL = "https://prices.azure.com/api/retail/prices"


def refresh_azure(
    get_json: Callable[[str, dict], dict], offers: list[CatalogOffer] | None = None
) -> list[CatalogOffer]:
    """Azure offers with Linux pay-as-you-go and spot prices from the Retail Prices API."""
    offers = offers if offers is not None else CLOUD.snapshot()
    found: dict[tuple[str, str], dict[str, float]] = {}
    for size in sorted({o.instance_type for o in offers}):
        url: str | None = PRICES_URL
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


def offers_now() -> list[CatalogOffer]:
    try:
        import requests  # the Retail Prices API is public: no credentials needed
    except ImportError as exc:
        raise NotConfiguredError("azure refresh needs `pip install fleetbroker[azure]`") from exc

    return refresh_azure(http_get_json(requests.Session()))
