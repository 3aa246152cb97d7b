"""Cost accounting: the on-demand reference recorded at launch, per-job and per-team sums across
recoveries and regions, and `fleet cost-report` through the real API and redis-server."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from broker.cli import app
from broker.costs import cost_report, job_cost, ondemand_reference
from broker.models import JobRecord, JobState, Placement
from broker.store import Plan, Store
from policies.models import Accelerator, BatchRange, JobSpec, Market, Pool
from providers.catalog import load_offers
from tests.api_server import TOKENS, ApiServer, api_stack

SPOT = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100, market=Market.SPOT,
            nodes=2, gpus_per_node=4, price_per_gpu_hour=0.9)
SPOT_WEST = SPOT.model_copy(update={"region": "us-west-2", "price_per_gpu_hour": 1.1})
OD = Pool(cloud="gcp", region="us-central1", accelerator=Accelerator.V100,
          market=Market.ON_DEMAND, nodes=1, gpus_per_node=4, price_per_gpu_hour=2.5)
SPEC = JobSpec(name="x", run="true", batch_size=BatchRange(min=32, max=64, default=32),
               work_samples=1000)
OD_T4 = OD.model_copy(update={"accelerator": Accelerator.T4, "price_per_gpu_hour": 0.4})


def placement(job: str, attempt: int, pool: Pool, start: float, end: float | None, gpus: int,
              reference: float | None) -> Placement:
    return Placement(job_id=job, attempt=attempt, start=start, end=end, pool=pool.id,
                     cloud=pool.cloud, region=pool.region, market=pool.market, gpus=gpus,
                     price_per_gpu_hour=pool.price_per_gpu_hour,
                     ondemand_price_per_gpu_hour=reference)


def test_reference_is_the_pool_itself_then_the_fleets_cheapest_on_demand_then_the_catalog() -> None:
    assert ondemand_reference(OD, [SPOT, OD]) == 2.5
    cheaper = OD.model_copy(update={"region": "europe-west4", "price_per_gpu_hour": 2.2})
    assert ondemand_reference(SPOT, [SPOT, OD, cheaper, OD_T4]) == 2.2  # same accelerator only
    # no on-demand V100 in the fleet: the catalog's price in the same region
    want = min(o.per_gpu(Market.ON_DEMAND) for o in load_offers()
               if o.accelerator is Accelerator.V100 and o.cloud == "aws"
               and o.region == "us-east-1" and o.per_gpu(Market.ON_DEMAND) is not None)
    assert ondemand_reference(SPOT, [SPOT, OD_T4]) == pytest.approx(want)
    nowhere = SPOT.model_copy(update={"cloud": "local", "region": "lab",
                                      "accelerator": Accelerator.RTX6000})
    assert ondemand_reference(nowhere, [nowhere]) in (None, *[
        o.per_gpu(Market.ON_DEMAND) for o in load_offers()
        if o.accelerator is Accelerator.RTX6000])


def test_costs_add_up_across_attempts_regions_and_teams() -> None:
    hour = 3600.0
    a = [placement("a-1", 1, SPOT, 0, 2 * hour, 4, 2.5),  # 8 GPU-h at 0.9, reference 2.5
         placement("a-1", 2, SPOT_WEST, 2 * hour, 3 * hour, 2, 2.5),  # moved after a notice
         placement("a-1", 3, OD, 3 * hour, 3.5 * hour, 4, 2.5)]  # on-demand to make the deadline
    b = [placement("b-1", 1, SPOT, 0, hour, 1, None)]  # an old record: no reference kept
    line = job_cost(a)
    assert line.intervals == 3
    assert math.isclose(line.gpu_hours, 8 + 2 + 2)
    assert math.isclose(line.cost_usd, 8 * 0.9 + 2 * 1.1 + 2 * 2.5)
    assert math.isclose(line.ondemand_cost_usd, 12 * 2.5)
    assert math.isclose(line.saving or 0, 1 - (7.2 + 2.2 + 5.0) / 30.0)
    assert job_cost(b).saving == 0.0
    assert job_cost([]).saving is None

    spec = SPEC
    jobs = [JobRecord(id="a-1", team="ml", spec=spec, state=JobState.COMPLETED, migrations=2,
                      preemptions=1),
            JobRecord(id="b-1", team="vision", spec=spec, state=JobState.RUNNING),
            JobRecord(id="c-1", team="ml", spec=spec, state=JobState.QUEUED)]
    report = cost_report(jobs, {"a-1": a, "b-1": b})
    assert [r["regions"] for r in report["jobs"]] == [
        ["aws:us-east-1", "aws:us-west-2", "gcp:us-central1"], ["aws:us-east-1"], []]
    ml = next(t for t in report["teams"] if t["team"] == "ml")
    assert math.isclose(ml["cost_usd"], line.cost_usd) and ml["intervals"] == 3
    assert math.isclose(report["total"]["cost_usd"], line.cost_usd + 0.9)
    assert math.isclose(report["total"]["ondemand_cost_usd"], 30.0 + 0.9)
    newest = cost_report(jobs, {"a-1": a, "b-1": b}, rows=1)
    assert [r["job"] for r in newest["jobs"]] == ["c-1"]  # only the newest row...
    assert newest["teams"] == report["teams"] and newest["total"] == report["total"]  # all sums


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Store]]:
    with api_stack(tmp_path_factory.mktemp("costs")) as s:
        yield s


def fleet(server: ApiServer, who: str, *args: str) -> tuple[int, str, str]:
    env = {"FLEET_URL": server.url, "FLEET_TOKEN": TOKENS[who], "FLEET_CONFIG": "/nonexistent"}
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def report_total(server: ApiServer) -> dict[str, object]:
    """The admin's total with no limit on the rows."""
    code, out, _ = fleet(server, "admin", "cost-report", "--json")
    assert code == 0
    return json.loads(out)["total"]


def test_cost_report_through_the_api_and_cli(stack: tuple[ApiServer, Store]) -> None:
    server, store = stack
    store.r.flushdb()
    store.set_pools([SPOT, SPOT_WEST, OD])
    mine = store.submit(SPEC.model_copy(update={"name": "train"}), team="ml")
    theirs = store.submit(SPEC.model_copy(update={"name": "eval"}), team="vision")
    plan = Plan()
    for p in (placement(mine.id, 1, SPOT, 0, 3600, 4, 2.5),
              placement(mine.id, 2, SPOT_WEST, 3600, 5400, 4, 2.5),
              placement(theirs.id, 1, OD, 0, 1800, 2, 2.5)):
        plan.open_placement(p)
    store.apply(plan)

    code, out, _ = fleet(server, "ml", "cost-report", "--json")
    report = json.loads(out)
    assert code == 0 and [r["job"] for r in report["jobs"]] == [mine.id]  # a team sees its own
    row = report["jobs"][0]
    assert row["regions"] == ["aws:us-east-1", "aws:us-west-2"] and row["intervals"] == 2
    assert math.isclose(row["cost_usd"], 4 * 0.9 + 2 * 1.1)
    assert math.isclose(row["saving"], 1 - 5.8 / 15.0)

    code, out, _ = fleet(server, "admin", "cost-report")
    assert code == 0
    assert mine.id in out and theirs.id in out and "per team" in out and "total" in out
    assert "61%" in out  # ml saved 1 - 5.8/15 against on-demand
    code, out, _ = fleet(server, "admin", "cost-report", "--json", "--limit", "1")
    newest = json.loads(out)
    assert [r["job"] for r in newest["jobs"]] == [theirs.id] and newest["jobs_total"] == 2
    # --limit shortens the per-job rows only: the teams and the total still count both jobs
    assert [t["team"] for t in newest["teams"]] == ["ml", "vision"]
    assert math.isclose(newest["teams"][0]["cost_usd"], 4 * 0.9 + 2 * 1.1)
    assert math.isclose(newest["total"]["cost_usd"], 4 * 0.9 + 2 * 1.1 + 1 * 2.5)
    assert newest["total"] == report_total(server)
    code, _, err = fleet(server, "ml", "cost-report", "--team", "vision")
    assert code == 3 and "no team 'vision'" in err
