"""The price catalog: vms.csv snapshots, GCP host+GPU joins, user catalog files, priors."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.models import Accelerator, Market, Pool
from providers import catalog
from providers.aws import CATALOG_CSV as AWS_CSV
from providers.azure import CATALOG_CSV as AZURE_CSV
from providers.catalog import CatalogOffer
from providers.gcp import catalog as gcp_catalog


@pytest.fixture(scope="module")
def offers() -> list[CatalogOffer]:
    return catalog.load_offers(root=Path("/nonexistent-config"))


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_every_cloud_has_offers_with_known_accelerators(offers: list[CatalogOffer]) -> None:
    clouds = Counter(o.cloud for o in offers)
    assert set(clouds) == {"aws", "gcp", "azure"}
    assert all(isinstance(o.accelerator, Accelerator) for o in offers)
    assert {Accelerator.A100, Accelerator.V100, Accelerator.T4, Accelerator.H100} <= {
        o.accelerator for o in offers
    }


def test_one_row_per_instance_type_per_zone(offers: list[CatalogOffer]) -> None:
    keys = Counter((o.cloud, o.instance_type, o.accelerator_name, o.region, o.zone) for o in offers)
    assert max(keys.values()) == 1


def test_aws_rows_match_the_vendored_file(offers: list[CatalogOffer]) -> None:
    raw = _rows(AWS_CSV)
    aws = {(o.instance_type, o.zone): o for o in offers if o.cloud == "aws"}
    assert len(aws) == len(raw)
    for row in raw:
        o = aws[(row["InstanceType"], row["AvailabilityZone"])]
        assert o.price == float(row["Price"])
        assert o.spot_price == (float(row["SpotPrice"]) if row["SpotPrice"] else None)
        assert o.accelerator_count == int(float(row["AcceleratorCount"]))


def test_gcp_offer_is_host_vm_plus_gpu_row(offers: list[CatalogOffer]) -> None:
    hosts = _rows(gcp_catalog.HOSTS_CSV)
    gpus = _rows(gcp_catalog.GPUS_CSV)
    host = next(r for r in hosts if r["InstanceType"] == "a2-highgpu-1g")
    gpu = next(
        r
        for r in gpus
        if r["AcceleratorName"] == "A100"
        and r["AcceleratorCount"] == "1"
        and r["AvailabilityZone"] == host["AvailabilityZone"]
    )
    o = next(
        o
        for o in offers
        if o.cloud == "gcp"
        and o.instance_type == "a2-highgpu-1g"
        and o.zone == host["AvailabilityZone"]
    )
    assert o.price == pytest.approx(float(host["Price"]) + float(gpu["Price"]), abs=1e-5)
    assert o.spot_price == pytest.approx(
        float(host["SpotPrice"]) + float(gpu["SpotPrice"]), abs=1e-5
    )
    assert o.vcpus == float(host["vCPUs"]) and o.accelerator_count == 1


def test_gcp_host_mapping() -> None:
    assert gcp_catalog.host_gpus("a2-ultragpu-4g") == [("A100-80GB", 4)]
    assert gcp_catalog.host_gpus("g2-standard-48") == [("L4", 4)]
    assert ("V100", 2) in gcp_catalog.host_gpus("n1-highmem-16")
    assert gcp_catalog.host_gpus("n1-standard-1") == []


def test_normalised_names_keep_the_cloud_name(offers: list[CatalogOffer]) -> None:
    ultra = [o for o in offers if o.accelerator_name == "A100-80GB"]
    assert ultra and all(o.accelerator is Accelerator.A100 for o in ultra)


def test_fractional_gpus_are_skipped(offers: list[CatalogOffer]) -> None:
    raw = _rows(AZURE_CSV)
    fractional = {r["InstanceType"] for r in raw if float(r["AcceleratorCount"]) < 1}
    assert fractional
    assert not {o.instance_type for o in offers if o.cloud == "azure"} & fractional


def test_vms_csv_round_trip(offers: list[CatalogOffer]) -> None:
    gcp = [o for o in offers if o.cloud == "gcp"][:50]
    assert catalog.read_vms_csv(catalog.to_vms_csv(gcp), "gcp") == gcp


def test_bad_vms_csv_names_the_missing_column() -> None:
    with pytest.raises(ValueError, match="AcceleratorName"):
        catalog.read_vms_csv("InstanceType,Region\nx,y\n", "aws", "my.csv")


def test_refresh_never_clobbers_a_user_edited_file(
    tmp_path: Path, offers: list[CatalogOffer]
) -> None:
    aws = [o for o in offers if o.cloud == "aws"]
    first = catalog.write_user_catalog("aws", aws, root=tmp_path)
    assert not first.kept_user_file and first.path == catalog.user_catalog_path("aws", tmp_path)
    # Unchanged since we wrote it: a refresh replaces it.
    second = catalog.write_user_catalog("aws", aws[:10], root=tmp_path)
    assert second.path == first.path and not second.kept_user_file
    assert len(catalog.load_offers(["aws"], root=tmp_path)) == 10
    # The user edits it: the next refresh goes next to it and the edit stays.
    edited = first.path.read_text().replace(f"{aws[0].price}", "0.001", 1)
    first.path.write_text(edited)
    third = catalog.write_user_catalog("aws", aws, root=tmp_path)
    assert third.kept_user_file and third.path.name == "vms.refreshed.csv"
    assert first.path.read_text() == edited
    assert catalog.load_offers(["aws"], root=tmp_path)[0].price == 0.001


def test_unknown_cloud_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown cloud 'ibm'"):
        catalog.load_offers(["ibm"])


def test_interruption_priors_follow_the_advisor_buckets() -> None:
    raw = _rows(catalog.SPOT_ADVISOR_CSV)
    priors = catalog.interruption_priors()
    assert len(priors) == len(raw)
    row = next(r for r in raw if r["instance_type"] == "p3.2xlarge" and r["region"] == "us-east-1")
    assert (
        priors[("us-east-1", "p3.2xlarge")]
        == catalog.BUCKET_RATE[int(row["interruption_range_index"])]
    )


def test_interruption_prior_of_an_offer(offers: list[CatalogOffer]) -> None:
    priors = catalog.interruption_priors()
    p3 = next(o for o in offers if o.instance_type == "p3.2xlarge" and o.region == "us-east-1")
    gcp = next(o for o in offers if o.cloud == "gcp")
    assert catalog.interruption_prior(p3, priors) == priors[("us-east-1", "p3.2xlarge")]
    assert catalog.interruption_prior(gcp) is None  # the round's unknown rate serves


def test_pool_prior_is_the_advisor_bucket_of_the_type_the_pool_is_priced_at(
        offers: list[CatalogOffer]) -> None:
    priors = catalog.interruption_priors()

    def pool(cloud: str, region: str, acc: Accelerator, zone: str | None = None) -> Pool:
        return Pool(cloud=cloud, region=region, zone=zone, accelerator=acc, market=Market.SPOT,
                    nodes=1, gpus_per_node=1)

    east = pool("aws", "us-east-1", Accelerator.V100)
    cheapest = min((o for o in offers if (o.cloud, o.region, o.accelerator) ==
                    ("aws", "us-east-1", Accelerator.V100) and o.spot_price is not None),
                   key=lambda o: (o.per_gpu(Market.SPOT), o.instance_type))
    assert catalog.pool_prior(east, offers, priors) == priors[("us-east-1",
                                                                cheapest.instance_type)]
    assert catalog.pool_prior(pool("gcp", "us-central1", Accelerator.T4), offers,
                              priors) is None  # the advisor covers AWS only
    assert catalog.pool_prior(pool("aws", "us-east-1", Accelerator.V100, zone="nowhere"),
                              offers, priors) is None  # no offer in that zone


prices = st.one_of(st.none(), st.floats(min_value=0, max_value=100, allow_nan=False))


@given(
    st.lists(
        st.tuples(st.sampled_from([Accelerator.T4, Accelerator.A100]), st.integers(1, 8), prices),
        min_size=1,
        max_size=20,
    )
)
def test_cheapest_is_the_minimum_per_gpu(rows: list[tuple[Accelerator, int, float | None]]) -> None:
    offers = [
        CatalogOffer(
            cloud="aws", region=f"r{i}", instance_type="x", accelerator=acc,
            accelerator_name=acc.value, accelerator_count=n, spot_price=p,
        )
        for i, (acc, n, p) in enumerate(rows)
    ]  # fmt: skip
    best = catalog.cheapest(offers, Market.SPOT)
    for acc in {o.accelerator for o in offers}:
        priced = [
            o.spot_price / o.accelerator_count
            for o in offers
            if o.accelerator is acc and o.spot_price is not None
        ]
        if priced:
            assert best[acc].per_gpu(Market.SPOT) == min(priced)
        else:
            assert acc not in best
