"""``fleet gpus`` / ``fleet prices``: tables and JSON agree with the catalog; bad input is clear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.cli import app
from policies.models import Market
from providers.catalog import cheapest, load_offers, user_catalog_path

runner = CliRunner()


@pytest.fixture(autouse=True)
def _empty_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path))
    return tmp_path


def test_prices_json_is_the_cheapest_per_gpu_per_market() -> None:
    result = runner.invoke(app, ["prices", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["accelerator"]: r for r in json.loads(result.output)}
    offers = load_offers()
    for market, field in ((Market.SPOT, "spot"), (Market.ON_DEMAND, "on_demand")):
        for acc, o in cheapest(offers, market).items():
            got = rows[acc.value][field]
            assert (got["cloud"], got["region"], got["instance_type"]) == (
                o.cloud, o.region, o.instance_type,
            )  # fmt: skip
    a100 = rows["A100"]
    want = 100 * (1 - a100["spot"]["price_per_gpu_hour"] / a100["on_demand"]["price_per_gpu_hour"])
    assert a100["spot_saving_pct"] == pytest.approx(want, abs=0.1)


def test_prices_filters_by_cloud_accelerator_and_market() -> None:
    result = runner.invoke(app, ["prices", "--cloud", "aws", "-a", "v100", "--spot", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["accelerator"] for r in rows] == ["V100"]
    assert set(rows[0]) == {"accelerator", "spot"} and rows[0]["spot"]["cloud"] == "aws"


def test_tables_render() -> None:
    for args in (["prices"], ["gpus"], ["gpus", "t4", "--limit", "3"], ["prices", "--spot"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "T4" in result.output


def test_gpus_name_lists_offers_sorted_by_spot_price() -> None:
    result = runner.invoke(app, ["gpus", "H100", "--limit", "5", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    spot = [r["spot_price"] / r["accelerator_count"] for r in rows]
    assert len(rows) == 5 and spot == sorted(spot)


def test_user_catalog_file_replaces_the_snapshot(_empty_config: Path) -> None:
    path = user_catalog_path("aws", _empty_config)
    path.parent.mkdir(parents=True)
    path.write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,"
        "Region,AvailabilityZone\np3.2xlarge,V100,1,8,61,,3.06,0.01,us-east-1,use1-az1\n"
    )
    result = runner.invoke(app, ["prices", "--cloud", "aws", "--json"])
    rows = json.loads(result.output)
    assert rows == [
        {
            "accelerator": "V100",
            "on_demand": rows[0]["on_demand"],
            "spot": rows[0]["spot"],
            "spot_saving_pct": pytest.approx(99.7, abs=0.1),
        }
    ]
    assert rows[0]["spot"]["price_per_hour"] == 0.01


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prices", "-a", "TPU"], "--accelerator"),
        (["prices", "-c", "ibm"], "--cloud 'ibm'"),
        (["gpus", "B200", "-c", "aws"], "no offers for B200 on aws"),
        (["gpus", "V200"], "NAME: unknown accelerator 'V200'"),  # positional: no flag to name
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert args[0] != "gpus" or "--accelerator" not in result.output


def test_broken_user_catalog_is_named(_empty_config: Path) -> None:
    path = user_catalog_path("gcp", _empty_config)
    path.parent.mkdir(parents=True)
    path.write_text("nothing,useful\n1,2\n")
    result = runner.invoke(app, ["prices", "-c", "gcp"])
    assert result.exit_code == 2 and "missing column" in result.output
