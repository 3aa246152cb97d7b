"""AWS prices now: the last spot price per (instance type, AZ) from EC2's
``describe_spot_price_history``; on-demand prices stay the snapshot's."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from providers.aws import CLOUD
from providers.base import NotConfiguredError
from providers.catalog import CatalogOffer


def refresh_aws(session: Any, offers: list[CatalogOffer] | None = None) -> list[CatalogOffer]:
    """The AWS offers with spot prices from the last spot price per (type, AZ), keyed by AZ id."""
    offers = offers if offers is not None else CLOUD.snapshot()
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


def offers_now() -> list[CatalogOffer]:
    import boto3

    session = boto3.Session()
    if session.get_credentials() is None:
        raise NotConfiguredError(CLOUD.not_configured)
    return refresh_aws(session)
