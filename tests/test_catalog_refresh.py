"""Catalog refresh: AWS spot price history (moto), GCP billing catalog and Azure retail prices
(`responses`), written as user catalog files; `fleet prices --refresh` end to end."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import boto3
import pytest
import requests
import responses
from moto import mock_aws
from typer.testing import CliRunner

from broker.cli import app
from policies.models import Market
from providers import catalog, registry
from providers.aws import refresh as aws_refresh
from providers.azure import refresh as azure_refresh
from providers.gcp import refresh as gcp_refresh
from tests.cloud_env import no_cloud_config


@pytest.fixture
def no_aws_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_cloud_config(monkeypatch, tmp_path)



def get_json(url: str, params: dict) -> dict:
    resp = requests.get(url, params=params, timeout=5)
    resp.raise_for_status()
    return resp.json()


def test_aws_spot_prices_come_from_price_history(no_aws_config, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    keep = {"g4dn.xlarge", "p3.2xlarge"}
    snapshot = [
        o for o in registry.get("aws").snapshot() or []
        if o.region == "us-east-1" and o.instance_type in keep
    ]
    with mock_aws():
        session = boto3.Session()
        ec2 = session.client("ec2", "us-east-1")
        zone_of = {
            z["ZoneId"]: z["ZoneName"]
            for z in ec2.describe_availability_zones()["AvailabilityZones"]
        }
        history = ec2.describe_spot_price_history(InstanceTypes=["g4dn.xlarge"])["SpotPriceHistory"]
        fresh = aws_refresh.refresh_aws(session, snapshot)
    moto_price = {h["AvailabilityZone"]: float(h["SpotPrice"]) for h in history}
    g4 = [o for o in fresh if o.instance_type == "g4dn.xlarge"]
    assert g4 and all(o.zone.startswith("use1-az") for o in g4)  # still AZ ids, not names
    updated = [o for o in g4 if zone_of[o.zone] in moto_price]
    assert updated and all(o.spot_price == moto_price[zone_of[o.zone]] for o in updated)
    assert all(
        o.price == snapshot[0].price for o in g4 if o.instance_type == snapshot[0].instance_type
    )
    result = catalog.write_user_catalog("aws", fresh, tmp_path)
    assert catalog.load_offers(["aws"], tmp_path) == fresh and not result.kept_user_file


def sku(description: str, usage: str, regions: list[str], price: float) -> dict:
    units, nanos = int(price), round((price - int(price)) * 1e9)
    return {
        "description": description,
        "category": {"resourceFamily": "Compute", "resourceGroup": "GPU", "usageType": usage},
        "serviceRegions": regions,
        "pricingInfo": [{"pricingExpression": {"usageUnit": "h", "tieredRates": [
            {"startUsageAmount": 0,
             "unitPrice": {"currencyCode": "USD", "units": str(units), "nanos": nanos}},
        ]}}],
    }  # fmt: skip


@responses.activate
def test_gcp_gpu_prices_from_the_billing_catalog() -> None:
    page1 = {"skus": [
        sku("Nvidia Tesla V100 GPU running in Americas", "OnDemand", ["us-central1"], 2.0),
        sku("Nvidia Tesla V100 GPU attached to Spot Preemptible VMs running in Americas",
            "Preemptible", ["us-central1"], 0.5),
        sku("Commitment v1: Nvidia Tesla V100 GPU in Americas for 1 Year", "Commit1Yr",
            ["us-central1"], 1.0),
    ], "nextPageToken": "p2"}  # fmt: skip
    page2 = {
        "skus": [
            sku("Nvidia Tesla A100 80GB GPU running in Americas", "OnDemand", ["us-central1"], 3.0)
        ]
    }
    query = responses.matchers.query_param_matcher
    responses.add(responses.GET, gcp_refresh.SKUS_URL, json=page2,
                  match=[query({"currencyCode": "USD", "pageToken": "p2"})])  # fmt: skip
    responses.add(responses.GET, gcp_refresh.SKUS_URL, json=page1,
                  match=[query({"currencyCode": "USD"})])  # fmt: skip
    fresh = gcp_refresh.refresh_gcp(get_json)
    old = {(o.instance_type, o.zone, o.accelerator_name): o for o in registry.get("gcp").snapshot()}
    host = "n1-highmem-16"  # 2x V100
    for o in fresh:
        if o.region == "us-central1" and o.instance_type == host and o.accelerator_name == "V100":
            before = old[(host, o.zone, "V100")]
            host_price = before.price - before.accelerator_count * 2.48  # the snapshot's V100 rate
            assert o.price == pytest.approx(host_price + 2 * 2.0, abs=1e-3)
        if (
            o.region == "us-central1"
            and o.accelerator_name == "A100-80GB"
            and o.accelerator_count == 1
        ):
            assert o.price != old[(o.instance_type, o.zone, "A100-80GB")].price
    assert len(fresh) == len(old)


@responses.activate
def test_azure_retail_prices_linux_pay_as_you_go_and_spot() -> None:
    items = [
        {
            "armRegionName": "eastus",
            "armSkuName": "Standard_NC6s_v3",
            "skuName": "NC6s v3",
            "productName": "Virtual Machines NCSv3 Series",
            "retailPrice": 3.5,
            "unitOfMeasure": "1 Hour",
        },
        {
            "armRegionName": "eastus",
            "armSkuName": "Standard_NC6s_v3",
            "skuName": "NC6s v3 Spot",
            "productName": "Virtual Machines NCSv3 Series",
            "retailPrice": 0.4,
            "unitOfMeasure": "1 Hour",
        },
    ]
    base = {"armRegionName": "eastus", "armSkuName": "Standard_NC6s_v3", "unitOfMeasure": "1 Hour"}
    more = [  # Windows and Low Priority rows must not win
        {**base, "skuName": "NC6s v3", "productName": "Virtual Machines NCSv3 Series Windows",
         "retailPrice": 9.9},
        {**base, "skuName": "NC6s v3 Low Priority", "productName": "Virtual Machines NCSv3 Series",
         "retailPrice": 0.1},
    ]  # fmt: skip
    next_page = f"{azure_refresh.PRICES_URL}?page=2"

    def prices(req):
        query = parse_qs(urlparse(req.url).query)
        if query.get("page") == ["2"]:
            return 200, {}, json.dumps({"Items": more, "NextPageLink": None})
        if "Standard_NC6s_v3" in query["$filter"][0]:
            return 200, {}, json.dumps({"Items": items, "NextPageLink": next_page})
        return 200, {}, json.dumps({"Items": [], "NextPageLink": None})

    responses.add_callback(responses.GET, azure_refresh.PRICES_URL, callback=prices)
    snapshot = registry.get("azure").snapshot()
    fresh = azure_refresh.refresh_azure(get_json, snapshot)
    nc6 = next(o for o in fresh if o.instance_type == "Standard_NC6s_v3" and o.region == "eastus")
    assert (nc6.price, nc6.spot_price) == (3.5, 0.4)
    unchanged = [
        (a, b)
        for a, b in zip(snapshot, fresh, strict=True)
        if a.instance_type != "Standard_NC6s_v3"
    ]
    assert all(a == b for a, b in unchanged)


@responses.activate
def test_prices_refresh_cli_skips_unconfigured_and_keeps_user_edits(
    no_aws_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    responses.add(responses.GET, azure_refresh.PRICES_URL, json={"Items": [], "NextPageLink": None})
    user = catalog.user_catalog_path("azure", tmp_path)
    user.parent.mkdir(parents=True)
    user.write_text(catalog.to_vms_csv(registry.get("azure").snapshot()[:3]))  # written by hand
    runner = CliRunner()
    result = runner.invoke(app, ["prices", "--refresh", "--json"])
    assert result.exit_code == 0, result.output
    assert "refresh aws: skipped: aws is not configured" in result.output
    assert "refresh gcp: skipped: gcp is not configured" in result.output
    assert "your edited vms.csv was kept" in result.output
    assert (user.parent / "vms.refreshed.csv").exists()
    assert len(catalog.load_offers(["azure"], tmp_path)) == 3  # the user's file still rules
    assert catalog.cheapest(catalog.load_offers(["azure"], tmp_path), Market.SPOT)


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        ({"body": requests.exceptions.ConnectionError("Max retries exceeded: no network")},
         "Max retries exceeded: no network"),
        ({"status": 500, "json": {"error": "boom"}}, "500 Server Error"),
    ],
)  # fmt: skip
@responses.activate
def test_refresh_one_cloud_failing_keeps_its_offers_and_the_others_go_on(
    no_aws_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: dict, reason: str
) -> None:
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path))  # aws and gcp are unconfigured
    responses.add(responses.GET, azure_refresh.PRICES_URL, **failure)
    gcp_offers = registry.get("gcp").snapshot()[:2]
    monkeypatch.setattr(registry.get("gcp"), "refresh", lambda: gcp_offers)  # gcp refreshes fine
    previous = registry.get("azure").snapshot()[:3]
    catalog.write_user_catalog("azure", previous, tmp_path)
    result = CliRunner().invoke(app, ["prices", "--refresh", "--json"])
    assert result.exit_code == 0, result.output  # gcp was refreshed: a partial success
    lines = [line for line in result.output.splitlines() if line.startswith("refresh azure:")]
    assert len(lines) == 1 and reason in lines[0], result.output
    assert lines[0].endswith("; kept the previous offers") and "Traceback" not in result.output
    assert "refresh aws: skipped: aws is not configured" in result.output
    assert "refresh gcp: 2 offers" in result.output
    assert catalog.load_offers(["azure"], tmp_path) == previous  # the last good offers stay
    assert catalog.load_offers(["gcp"], tmp_path) == gcp_offers


@responses.activate
def test_refresh_exits_non_zero_only_when_every_tried_cloud_failed(
    no_aws_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path))  # aws and gcp are unconfigured
    responses.add(responses.GET, azure_refresh.PRICES_URL, status=503)
    result = CliRunner().invoke(app, ["prices", "--refresh", "--json"])
    assert result.exit_code == 1, result.output  # aws, gcp skipped; azure, the one tried, failed
    assert "refresh azure: failed: 503 Server Error" in result.output
    assert json.loads(result.stdout)  # the (previous) offers are still listed
