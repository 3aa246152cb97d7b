"""The web dashboard: its series (cost over time, preemptions and migrations per region, catalog
prices), its routes behind the API's auth, and its pages in a real headless Chromium (the
system's, driven by Playwright) against the API over a real redis-server holding a fleet's
recorded history, and against a live broker running real jobs on the local fleet: no console
errors, the numbers the API gives, the login, screenshots."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker import transitions
from broker.costs import job_cost
from broker.dashboard import (
    EVENTS_LISTED,
    catalog_prices,
    cost_series,
    is_preemption,
    recovery_timeline,
)
from broker.models import Event, JobRecord, JobState, Placement
from broker.store import Plan, Store
from policies.models import BatchRange, JobSpec, Market
from providers.catalog import cheapest, load_offers
from tests.api_server import TOKENS, ApiServer, api_stack
from tests.dashboard_fleet import POOLS, record_fleet
from tests.test_api_e2e import env, wait_for

HOUR = 3600.0
# A live broker: redis, the API, the scheduler and actuator over the local provider (the e2e
# tests' fixture; its team token is ml's).
live_broker = env
PAGES = ("index", "costs", "recoveries", "prices", "queue")
SPOT = POOLS[0]
SPEC = JobSpec(name="x", run="true", batch_size=BatchRange(min=32, max=64, default=32),
               work_samples=1000)


def interval(job: str, attempt: int, pool: int, start: float, end: float | None, gpus: int,
             reference: float | None = 2.48) -> Placement:
    p = POOLS[pool]
    return Placement(job_id=job, attempt=attempt, start=start, end=end, pool=p.id,
                     cloud=p.cloud, region=p.region, market=p.market, gpus=gpus,
                     price_per_gpu_hour=p.price_per_gpu_hour,
                     ondemand_price_per_gpu_hour=reference)


# ---- the series ------------------------------------------------------------------------------

def test_cost_series_accrues_each_interval_over_its_time_and_ends_at_the_cost_report() -> None:
    ps = [interval("a", 1, 0, 0, 2 * HOUR, 4),  # spot, the first half of the span
          interval("a", 2, 2, 2 * HOUR, 4 * HOUR, 2),  # on-demand, the second half
          interval("b", 1, 1, HOUR, 3 * HOUR, 1, reference=None)]  # no reference kept
    s = cost_series(ps, now=10 * HOUR, buckets=4)
    assert s["t"] == [HOUR, 2 * HOUR, 3 * HOUR, 4 * HOUR]
    assert s["spot_usd"] == pytest.approx([4 * 0.92, 8 * 0.92 + 1.05, 8 * 0.92 + 2 * 1.05,
                                           8 * 0.92 + 2 * 1.05])
    assert s["ondemand_usd"] == pytest.approx([0, 0, 2 * 2.48, 4 * 2.48])
    total = job_cost(ps)
    assert s["spot_usd"][-1] + s["ondemand_usd"][-1] == pytest.approx(total.cost_usd)
    assert s["all_ondemand_usd"][-1] == pytest.approx(total.ondemand_cost_usd)
    assert s["saving_usd"][-1] == pytest.approx(total.ondemand_cost_usd - total.cost_usd)
    # a bucket edge inside an interval splits its cost by time
    half = cost_series([interval("c", 1, 0, 0, HOUR, 1)], now=HOUR, buckets=4)
    assert half["spot_usd"] == pytest.approx([0.23, 0.46, 0.69, 0.92])
    # an open interval runs until now
    open_ = cost_series([interval("d", 1, 2, 0, None, 1)], now=HOUR, buckets=2)
    assert open_["t"][-1] == HOUR and open_["ondemand_usd"][-1] == pytest.approx(2.48)
    assert cost_series([], now=HOUR)["t"] == []


def test_recovery_timeline_puts_each_preemption_in_the_region_held_then() -> None:
    a = [interval("a", 1, 0, 0, 100, 4),  # us-east-1 spot, reclaimed at 100
         interval("a", 2, 1, 150, 300, 4),  # moved to us-west-2, reclaimed at 300
         interval("a", 3, 1, 400, None, 4)]  # back in us-west-2: the same pool, no move
    b = [interval("b", 1, 2, 0, 50, 1), interval("b", 2, 2, 60, None, 2)]  # a resize: no move
    preempted = {"a": [Event(id="1-0", ts=100, type="preempted", job_id="a"),
                       Event(id="2-0", ts=300, type="preempted", job_id="a")]}
    t = recovery_timeline({"a": a, "b": b}, preempted, now=400, buckets=3)
    assert [(e["kind"], e["region"], e["ts"]) for e in t["events"]] == [
        ("preemption", "aws:us-east-1", 100), ("migration", "aws:us-east-1", 150),
        ("preemption", "aws:us-west-2", 300)]
    assert t["events"][1]["to"] == "aws:us-west-2"
    assert t["totals"] == {"aws:us-east-1": {"preemptions": 1, "migrations": 1},
                           "aws:us-west-2": {"preemptions": 1, "migrations": 0}}
    assert t["t"] == pytest.approx([200, 300, 400])
    assert t["series"]["aws:us-east-1"] == {"preemptions": [1, 0, 0], "migrations": [1, 0, 0]}
    assert t["series"]["aws:us-west-2"] == {"preemptions": [0, 0, 1], "migrations": [0, 0, 0]}
    assert t["events_total"] == 3
    assert recovery_timeline({"b": b}, {}, now=400)["regions"] == []
    many = {f"j{i}": [interval(f"j{i}", 1, 0, i, i + 1, 1), interval(f"j{i}", 2, 1, i + 2, None, 1)]
            for i in range(EVENTS_LISTED + 10)}
    listed = recovery_timeline(many, {}, now=10_000)
    assert listed["events_total"] == EVENTS_LISTED + 10  # all counted, the newest listed
    assert len(listed["events"]) == EVENTS_LISTED
    assert listed["events"][-1]["job"] == f"j{EVENTS_LISTED + 9}"
    assert listed["totals"]["aws:us-east-1"]["migrations"] == EVENTS_LISTED + 10


def test_every_transition_that_counts_a_preemption_marks_its_event() -> None:
    job = JobRecord(id="j", team="ml", spec=SPEC, state=JobState.RUNNING, pool=SPOT.id)
    stopping = job.model_copy(update={"state": JobState.SUSPENDING})
    marked, plain = Plan(), Plan()
    transitions.stopping(marked, job, event="nodes-lost", reason="r", preempted=True)
    transitions.ended(marked, job, JobState.SUSPENDED, reason="node lost", exit_code=None,
                      fence=1, preempted=True)
    transitions.replacing_nodes(marked, job, ranks=[1], alive=["n0"], reason="r",
                                recovery="replace-node", fence=1, preempted=True)
    transitions.stopping(plain, job, event="nodes-lost", reason="r")
    transitions.ended(plain, stopping, JobState.SUSPENDED, reason="checkpointed", exit_code=75,
                      fence=1)
    transitions.replacing_nodes(plain, job, ranks=[1], alive=["n0"], reason="r",
                                recovery="replace-node", fence=1, preempted=False)

    def events(plan: Plan) -> list[Event]:
        return [Event(id="0-1", ts=0, type=e["type"], job_id="j", data=json.loads(e["data"]))
                for e in plan.events]

    assert [is_preemption(e) for e in events(marked)] == [True, True, True]
    assert [is_preemption(e) for e in events(plain)] == [False, False, False]
    assert is_preemption(Event(id="0-1", ts=0, type="preempted"))  # records from before


def test_catalog_prices_are_the_cheapest_offer_per_accelerator() -> None:
    rows = {r["accelerator"]: r for r in catalog_prices()}
    offers = load_offers()
    od, spot = cheapest(offers, Market.ON_DEMAND), cheapest(offers, Market.SPOT)
    assert set(rows) == {a.value for a in set(od) | set(spot)}
    for acc, offer in spot.items():
        row = rows[acc.value]
        assert row["spot"]["price_per_gpu_hour"] == offer.per_gpu(Market.SPOT)
        if acc in od:
            want = 1 - offer.per_gpu(Market.SPOT) / od[acc].per_gpu(Market.ON_DEMAND)
            assert math.isclose(row["spot_saving"], want)


# ---- a fleet with a history behind the API ----------------------------------------------------

class Fleet:
    def __init__(self, server: ApiServer, store: Store) -> None:
        self.server, self.store = server, store

    def get(self, path: str, who: str = "admin") -> Any:
        r = httpx.get(self.server.url + path, headers={
            "Authorization": f"Bearer {TOKENS[who]}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with api_stack(tmp_path_factory.mktemp("dashboard")) as (server, store):
        with httpx.Client(base_url=server.url, timeout=30, headers={
                "Authorization": f"Bearer {TOKENS['admin']}"}) as client:
            def submit(spec: dict[str, object]) -> str:
                r = client.post("/v1/jobs", json=spec)
                assert r.status_code == 201, r.text
                return str(r.json()["job"]["id"])

            record_fleet(store, submit, jobs=60)
        yield Fleet(server, store)


def test_dashboard_routes_need_a_token_and_show_a_team_its_own(fleet: Fleet) -> None:
    url = fleet.server.url
    for path in ("/v1/costs/series", "/v1/recoveries", "/v1/prices"):
        assert httpx.get(url + path).status_code == 401
        r = httpx.get(url + path, headers={"Authorization": f"Bearer {TOKENS['agent']}"})
        assert r.status_code == 403
    r = httpx.get(url + "/v1/costs/series?buckets=0",
                  headers={"Authorization": f"Bearer {TOKENS['admin']}"})
    assert r.status_code == 422 and r.json()["error"]["problems"][0]["field"] == "buckets"
    assert httpx.get(url + "/v1/recoveries?team=ml", headers={
        "Authorization": f"Bearer {TOKENS['vision']}"}).status_code == 404
    mine = fleet.get("/v1/costs/series", "ml")
    report = fleet.get("/v1/costs?team=ml")  # read after: open intervals only grew since
    assert 0 < mine["spot_usd"][-1] + mine["ondemand_usd"][-1] <= report["total"]["cost_usd"]
    everyone = fleet.get("/v1/costs/series")
    assert everyone["all_ondemand_usd"][-1] > mine["all_ondemand_usd"][-1]
    jobs = fleet.get("/v1/costs?limit=10000")["jobs"]
    t = fleet.get("/v1/recoveries")
    assert sum(x["preemptions"] for x in t["totals"].values()) == \
        sum(j["preemptions"] for j in jobs) > 0
    assert sum(x["migrations"] for x in t["totals"].values()) == \
        sum(j["migrations"] for j in jobs) > 0


def test_pages_are_static_files_without_data_and_locked_to_their_origin(fleet: Fleet) -> None:
    url = fleet.server.url
    r = httpx.get(url + "/ui", follow_redirects=True)
    assert r.status_code == 200 and str(r.url).endswith("/ui/")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert fleet.store.list_jobs()[0].id not in r.text  # the page holds no job data
    js = httpx.get(url + "/ui/vendor/chart.umd.min.js")
    assert js.status_code == 200 and "Chart.js v4" in js.text[:200]
    assert httpx.get(url + "/ui/nothing.html").status_code == 404


# ---- in the browser --------------------------------------------------------------------------

def chromium() -> str:
    path = os.environ.get("FLEET_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("no chromium: run infra/bootstrap.sh (Debian: apt-get install chromium), "
                    "or set FLEET_CHROMIUM to a Chromium binary")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium())
        yield b
        b.close()


class Tab:
    """A page of a fresh browser context that records console errors and failed requests."""

    def __init__(self, browser: Any, base: str) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.base = base
        self.problems: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url}"))
        self.page.on("response", lambda r: self.problems.append(f"{r.status}: {r.url}")
                     if r.status >= 400 else None)

    def open(self, name: str) -> float:
        """Go to page ``name`` and wait until it drew everything; the seconds it took."""
        start = time.perf_counter()
        self.page.goto(f"{self.base}/ui/{name}.html")
        self.page.wait_for_selector("body[data-ready='1']")
        return time.perf_counter() - start

    def sign_in(self, who: str) -> None:
        self.page.goto(self.base + "/ui/")
        self.page.wait_for_url("**/ui/login.html")
        self.page.fill("#token", TOKENS[who])
        self.page.click("button[type=submit]")
        self.page.wait_for_url("**/ui/index.html")
        self.page.wait_for_selector("body[data-ready='1']")

    def kpi(self, name: str) -> str:
        return str(self.page.inner_text(f"[data-kpi='{name}']"))

    def column(self, table: str, index: int) -> list[str]:
        return [str(x) for x in self.page.locator(
            f"[data-table='{table}'] tbody tr td:nth-child({index})").all_inner_texts()]

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, fleet: Fleet) -> Iterator[Tab]:
    t = Tab(browser, fleet.server.url)
    yield t
    t.close()


def usd(v: float) -> str:
    return f"${v:,.2f}"


def dollars(text: str) -> float:
    return float(text.replace("$", "").replace(",", ""))


def test_no_token_leads_to_the_login_page_and_a_wrong_token_is_refused(tab: Tab) -> None:
    for name in PAGES:
        tab.page.goto(f"{tab.base}/ui/{name}.html")
        tab.page.wait_for_url("**/ui/login.html")
    tab.page.fill("#token", "not-a-token-0123456789")
    tab.page.click("button[type=submit]")
    tab.page.wait_for_selector("#login-error:has-text('does not know this token')")
    assert tab.page.url.endswith("/ui/login.html")
    # the refused sign-in's 401 (and the browser's note of it) is all that went wrong
    assert tab.problems and all("401" in p for p in tab.problems), tab.problems
    assert "token" not in tab.page.url.split("/ui/")[1]


def test_every_page_loads_clean_and_shows_the_apis_numbers(tab: Tab, fleet: Fleet,
                                                           tmp_path: Path) -> None:
    tab.sign_in("admin")
    loads = {}
    for name in PAGES:
        before = fleet.get("/v1/costs?limit=10000")["total"] if name == "costs" else None
        loads[name] = tab.open(name)
        tab.page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
        assert tab.page.locator("canvas[data-chart]").count() >= 1, name
        assert tab.page.locator(".error").count() == 0, name
        if name == "index":
            cap = fleet.get("/v1/capacity")
            holding = fleet.get("/v1/jobs?state=launching&state=running&state=suspending"
                                "&limit=10000")
            assert tab.kpi("gpus-used") == \
                f"{cap['total']['used']:,} / {cap['total']['capacity']:,}"
            assert tab.kpi("jobs-holding") == str(holding["total"])
            assert tab.column("pools", 1) == [p["id"] for p in cap["pools"]]
            assert tab.column("pools", 5) == [str(p["used"]) for p in cap["pools"]]
            assert sorted(tab.column("holding", 1)) == sorted(j["id"] for j in holding["jobs"])
        elif name == "costs":
            after = fleet.get("/v1/costs?limit=10000")["total"]
            # running jobs cost more every second: what the page shows lies between the two reads
            for kpi, key in (("cost", "cost_usd"), ("all-ondemand", "ondemand_cost_usd")):
                assert round(before[key], 2) <= dollars(tab.kpi(kpi)) <= round(after[key], 2)
            assert tab.column("teams", 1) == ["ml", "speech", "vision"]
        elif name == "recoveries":
            t = fleet.get("/v1/recoveries")
            assert tab.kpi("preemptions") == str(
                sum(x["preemptions"] for x in t["totals"].values()))
            assert tab.kpi("migrations") == str(
                sum(x["migrations"] for x in t["totals"].values()))
            assert tab.column("regions", 1) == t["regions"]
            assert tab.column("regions", 2) == [str(t["totals"][r]["preemptions"])
                                                for r in t["regions"]]
        elif name == "prices":
            rows = fleet.get("/v1/prices")["accelerators"]
            assert tab.column("prices", 1) == [r["accelerator"] for r in rows]
            assert tab.column("prices", 4) == [
                "\N{EN DASH}" if r["spot"] is None else f"${r['spot']['price_per_gpu_hour']:.3f}"
                for r in rows]
        else:
            waiting = fleet.get("/v1/jobs?state=queued&state=suspended&limit=10000")
            assert tab.kpi("waiting") == str(waiting["total"])
            shown = dict(zip(tab.column("queue", 1), tab.column("queue", 8), strict=True))
            assert shown == {j["id"]: j["reason"] or "no reason given yet"
                             for j in waiting["jobs"]}
    assert tab.problems == []
    assert all((tmp_path / f"{n}.png").stat().st_size > 10_000 for n in PAGES)
    assert max(loads.values()) < 5, loads  # a generous bound; the benchmark measures it


def test_a_team_sees_its_own_and_signing_out_forgets_the_token(tab: Tab, fleet: Fleet) -> None:
    tab.sign_in("ml")
    tab.open("costs")
    assert tab.column("teams", 1) == ["ml"]
    ml = {j.id for j in fleet.store.list_jobs(team="ml")}
    assert set(tab.column("jobs", 1)) <= ml
    tab.page.click("header button")
    tab.page.wait_for_url("**/ui/login.html")
    assert tab.page.evaluate("sessionStorage.length") == 0
    tab.page.goto(f"{tab.base}/ui/costs.html")
    tab.page.wait_for_url("**/ui/login.html")
    assert tab.problems == []


@pytest.mark.slow
def test_a_live_brokers_jobs_on_the_pages(live_broker: dict[str, str], store: Store,
                                          browser: Any, tmp_path: Path) -> None:
    """``fleet up``'s parts (scheduler, actuator, local provider, agents over HTTP) run a job
    to completion and keep another running; the pages show both as the API does."""
    url, auth = live_broker["FLEET_URL"], {
        "Authorization": f"Bearer {live_broker['FLEET_TOKEN']}"}
    sleeper = "python -c 'import time; time.sleep({})'"
    ids = {}
    for name, seconds in (("short", 1), ("long", 600)):
        r = httpx.post(url + "/v1/jobs", headers=auth, json={
            "name": name, "run": sleeper.format(seconds), "gpus": 1,
            "batch_size": {"min": 32, "max": 32}, "work": {"samples": 10**6}})
        assert r.status_code == 201, r.text
        ids[name] = r.json()["job"]["id"]
    wait_for(store, ids["short"], lambda j: j.state.terminal)
    wait_for(store, ids["long"], lambda j: j.state is JobState.RUNNING)

    tab = Tab(browser, url)
    try:
        tab.page.goto(tab.base + "/ui/login.html")
        tab.page.fill("#token", live_broker["FLEET_TOKEN"])
        tab.page.click("button[type=submit]")
        tab.page.wait_for_selector("body[data-ready='1']")
        holding = httpx.get(url + "/v1/jobs?state=running", headers=auth).json()
        assert tab.column("holding", 1) == [ids["long"]]
        assert tab.column("holding", 4) == [j["pool"] for j in holding["jobs"]]
        tab.page.screenshot(path=str(tmp_path / "live-index.png"), full_page=True)
        tab.open("costs")
        report = httpx.get(url + "/v1/costs", headers=auth).json()
        rows = dict(zip(tab.column("jobs", 1), tab.column("jobs", 4), strict=True))
        assert rows == {r["job"]: ", ".join(r["regions"]) for r in report["jobs"]}
        done = next(r for r in report["jobs"] if r["job"] == ids["short"])
        assert done["state"] == "completed" and done["intervals"] == 1
        shown = dict(zip(tab.column("jobs", 1), tab.column("jobs", 6), strict=True))
        assert shown[ids["short"]] == usd(done["cost_usd"])  # a closed interval: fixed
        tab.page.screenshot(path=str(tmp_path / "live-costs.png"), full_page=True)
        assert tab.problems == []
    finally:
        tab.close()
        # the long job ends here, through the broker, so no job process outlives the test
        httpx.post(url + f"/v1/jobs/{ids['long']}/cancel", headers=auth)
        wait_for(store, ids["long"], lambda j: j.state.terminal)
