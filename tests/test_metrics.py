"""``GET /metrics`` and ``/readyz`` of a running broker (real redis-server, leader loop over the
local provider with shell jobs, the API on loopback): the numbers match the store and the API,
the names follow Prometheus's rules, the token rules hold, and a reported checkpoint is counted
once."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from broker import metrics
from broker.api import build_app
from broker.auth import ApiConfig, ConfigError, Principal, Role
from broker.models import JobState, Placement
from broker.store import Plan, Store
from policies.models import Market, SpotPolicy
from providers.base import CapacityError, ProviderError, QuotaError
from tests import builders
from tests.api_server import TOKENS
from tests.metrics_stack import ADMIN, METRICS_TOKEN, Running, Scrape, running_broker, wait_for

# Exits 75 on SIGTERM, like the runtime agent after a checkpoint.
LOOP = "trap 'exit 75' TERM; echo ready; i=0; while [ $i -lt {n} ]; do sleep 0.1; i=$((i+1)); done"


spec = functools.partial(builders.spec, batch=(8, 64), samples=100)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    with running_broker(tmp_path) as r:
        yield r


def test_metrics_match_the_store_and_the_api(running: Running) -> None:
    store = running.broker.store
    before = Scrape(httpx.get(f"{running.api.url}/metrics", timeout=10, headers={
        "Authorization": f"Bearer {ADMIN}"}).text)  # the admin token scrapes too
    # a job in a spot region that gets reclaimed: preempted there, resumed elsewhere
    mover = store.submit(spec("mover", run=LOOP.format(n=30), spot=SpotPolicy.PREFERRED),
                         team="ml")
    quick = [store.submit(spec(f"q{i}", run="sleep 0.3"), team=t).id
             for i, t in enumerate(["ml", "vision", "vision"])]
    wait_for(lambda: "ready" in store.read_logs(mover.id)[0])
    first = store.get_job(mover.id)
    assert first is not None and first.pool is not None
    store.request_preempt(first.pool.split(":")[1], duration_s=60)
    ids = [mover.id, *quick]
    wait_for(lambda: all(store.get_job(i).state is JobState.COMPLETED  # type: ignore[union-attr]
                         for i in ids), timeout=60)
    waiting = store.submit(spec("waits", run="true", gpus=64), team="vision")

    got = running.scrape()
    # jobs by state and team, and the queue
    assert got.value("fleet_jobs", state="completed", team="ml") == 2
    assert got.value("fleet_jobs", state="completed", team="vision") == 2
    wait_for(lambda: store.get_job(waiting.id) is not None)
    assert got.value("fleet_queue_jobs", team="vision") == 1
    # nothing of ml's waits or runs: zeros, not absent series
    for name, labels in (("fleet_queue_jobs", {}), ("fleet_queue_oldest_wait_seconds", {}),
                         ("fleet_jobs", {"state": "running"}),
                         ("fleet_jobs", {"state": "queued"})):
        assert [s.value for s in got.samples(name, team="ml", **labels)] == [0], name
    assert 0 <= got.value("fleet_queue_oldest_wait_seconds", team="vision") < 30
    # pools: capacity as the API shows it; everything finished, so nothing allocated
    cap = httpx.get(f"{running.api.url}/v1/capacity", timeout=10,
                    headers={"Authorization": f"Bearer {ADMIN}"}).json()
    for pool in cap["pools"]:
        assert got.value("fleet_pool_gpus", pool=pool["id"]) == pool["capacity"]
        assert got.value("fleet_pool_gpus_allocated", pool=pool["id"]) == pool["used"]
        assert got.value("fleet_pool_gpus_free", pool=pool["id"]) == pool["free"]
    # cost per team: the same sums as GET /v1/costs (every interval is closed)
    costs = httpx.get(f"{running.api.url}/v1/costs", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()
    for team in costs["teams"]:
        assert got.value("fleet_cost_usd_total", team=team["team"]) == pytest.approx(
            team["cost_usd"], rel=1e-9)
        assert got.value("fleet_ondemand_cost_usd_total", team=team["team"]) == \
            pytest.approx(team["ondemand_cost_usd"], rel=1e-9)
        assert got.value("fleet_gpu_seconds_total", team=team["team"]) == pytest.approx(
            team["gpu_hours"] * 3600, rel=1e-9)
    spot_s = got.value("fleet_gpu_seconds_total", team="ml", market="spot")
    assert spot_s > 0
    assert got.value("fleet_open_gpu_seconds") == 0  # nothing runs
    # each job's wait from submission to its first launch, once per job (not per attempt)
    for team, launched in (("ml", 2), ("vision", 2)):
        name = "fleet_queue_wait_seconds_count"
        assert got.value(name, team=team) - before.value(name, team=team) == launched
    assert 0 < got.value("fleet_queue_wait_seconds_sum") - \
        before.value("fleet_queue_wait_seconds_sum") < 4 * 60
    # the reclaim: the jobs it hit were preempted in its region and moved out of it
    cloud, region = first.pool.split(":")[:2]
    jobs = [store.get_job(i) for i in ids]
    hit = sum(j.preemptions for j in jobs if j is not None)
    moved = sum(j.migrations for j in jobs if j is not None)
    assert hit >= 1 and moved >= 1
    assert got.value("fleet_preemptions_total", cloud=cloud, region=region) == hit
    assert got.value("fleet_preemptions_total") == hit
    assert got.value("fleet_migrations_total", cloud=cloud, region=region) == moved
    assert got.value("fleet_migrations_total") == moved
    # the leader's own: rounds, solves, one leader so far
    rounds = got.value("fleet_scheduling_round_duration_seconds_count")
    assert rounds > before.value("fleet_scheduling_round_duration_seconds_count")
    assert got.value("fleet_allocator_solve_duration_seconds_count") > \
        before.value("fleet_allocator_solve_duration_seconds_count")
    assert got.value("fleet_leader_changes_total") == 1
    assert got.value("fleet_leader_lease_held") == 1
    # no label carries a job id
    values = {v for f in got.families.values() for s in f.samples for v in s.labels.values()}
    assert not values & {*ids, waiting.id}


def test_metric_names_follow_the_prometheus_rules(running: Running) -> None:
    got = running.scrape()
    ours = {n: f for n, f in got.families.items() if not n.startswith(("python_", "process_"))}
    assert ours, "no metric exposed"
    for name, family in ours.items():
        assert re.fullmatch(r"fleet_[a-z0-9_]+", name), name
        assert "__" not in name and not name.startswith("fleet_fleet")
        if family.type == "counter":
            assert got.samples(name + "_total") or f"# TYPE {name}_total counter" in got.text
        # base units only: no milliseconds, minutes, hours, days or bytes multiples in a name
        assert not re.search(r"_(ms|milliseconds?|minutes?|min|hours?|h|days?|kb|mb|gb|"
                             r"dollars)(_|$)", name), name
        for sample in family.samples:
            assert "job" not in sample.labels and "job_id" not in sample.labels


def test_the_operations_table_lists_every_metric(running: Running) -> None:
    table = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    documented = dict(re.findall(r"^\| `(fleet_[a-z0-9_]+)` \| (\w+) \|", table, re.M))
    got = running.scrape()
    exposed = {(n + "_total" if f.type == "counter" else n): f.type
               for n, f in got.families.items() if n.startswith("fleet_")}
    assert documented == exposed


def test_metrics_token_rules(running: Running) -> None:
    url = f"{running.api.url}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401
    for who in ("ml", "agent"):
        r = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {TOKENS[who]}"})
        assert r.status_code == 403 and "metrics token" in r.json()["error"]["message"]
    running.scrape(ADMIN)
    running.scrape(METRICS_TOKEN)
    # the metrics token reads /metrics only
    r = httpx.get(f"{running.api.url}/v1/jobs", timeout=10,
                  headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert r.status_code == 403 and "/metrics" in r.json()["error"]["message"]


def test_metrics_tokens_from_config_and_env() -> None:
    token = "scraper-token-0123456789"
    for config in (ApiConfig.from_mapping({"tokens": [{"metrics": True, "token": token}]}),
                   ApiConfig.load(environ={"FLEET_METRICS_TOKEN": token})):
        assert config.authenticate(token) == Principal(role=Role.METRICS)
        assert not Principal(role=Role.METRICS).can_see("ml")
    with pytest.raises(ConfigError, match="give exactly one of team: NAME, admin: true, "
                       "agent: true, metrics: true"):
        ApiConfig.from_mapping({"tokens": [{"metrics": True, "admin": True, "token": token}]})


def test_a_reported_checkpoint_is_observed_once(running: Running) -> None:
    store = running.broker.store
    job = store.submit(spec("ck", run=LOOP.format(n=100)), team="ml")
    wait_for(lambda: (j := store.get_job(job.id)) is not None and j.state is JobState.RUNNING)
    before = running.scrape()
    beat = {"job_id": job.id, "attempt": 1, "step": 9, "checkpoint_step": 8,
            "checkpoint_bytes": 3 * 2**20, "checkpoint_seconds": 1.5}
    with httpx.Client(base_url=running.api.url, timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        for body in (beat, beat, {**beat, "step": 10}):  # the same checkpoint, three reports
            assert c.post("/v1/agent/heartbeat", json=body).status_code == 200
        # a checkpoint reported without its write time (loaded, not written) is not counted
        c.post("/v1/agent/heartbeat", json={**beat, "checkpoint_step": 9,
                                            "checkpoint_seconds": None})
        bad = c.post("/v1/agent/heartbeat", json={**beat, "checkpoint_seconds": -1})
        assert bad.status_code == 422
        assert [p["field"] for p in bad.json()["error"]["problems"]] == ["checkpoint_seconds"]
    after = running.scrape()
    for name, added in (("fleet_checkpoint_duration_seconds_count", 1),
                        ("fleet_checkpoint_duration_seconds_sum", 1.5),
                        ("fleet_checkpoint_size_bytes_count", 1),
                        ("fleet_checkpoint_size_bytes_sum", 3 * 2**20)):
        assert after.value(name) - before.value(name) == pytest.approx(added), name

    def buckets(scrape: Scrape) -> dict[float, float]:
        return {float(s.labels["le"]): s.value
                for s in scrape.samples("fleet_checkpoint_size_bytes_bucket")}

    grew = {le for le, n in buckets(after).items() if n != buckets(before).get(le, 0)}
    assert min(grew) == 4 * 2**20  # 3 MiB falls in the 4 MiB bucket and every larger one
    store.request_cancel(job.id)


def test_readyz(running: Running) -> None:
    url = f"{running.api.url}/readyz"
    wait_for(lambda: running.broker.store.leader() is not None)
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["leader_fence"] == running.broker.fence
    running.broker.stop()  # releases the lease: no leader known
    r = httpx.get(url, timeout=10)
    assert r.status_code == 503
    assert "no broker replica holds the leader lease" in r.json()["error"]["message"]
    running.redis.stop()
    r = httpx.get(url, timeout=10)
    assert r.status_code == 503 and "redis does not answer" in r.json()["error"]["message"]
    assert httpx.get(f"{running.api.url}/healthz", timeout=10).status_code == 200  # alive
    running.redis.start()  # back for the teardown


def test_provider_errors_by_kind() -> None:
    def count(kind: str) -> float:
        return metrics.PROVIDER_ERRORS.labels(cloud="aws", kind=kind)._value.get()

    before = {k: count(k) for k in ("capacity", "quota", "other")}
    metrics.provider_error("aws", CapacityError("no p3 in us-east-1a"))
    metrics.provider_error("aws", QuotaError("vCPU limit"))
    metrics.provider_error("aws", ProviderError("throttled"))
    metrics.provider_error("aws", ProviderError("throttled"))
    assert {k: count(k) - before[k] for k in before} == {"capacity": 1, "quota": 1, "other": 2}


def test_pool_labels() -> None:
    assert metrics.pool_labels("aws:us-east-1/us-east-1a:spot:v100") == (
        "aws", "us-east-1", "spot", "v100")
    assert metrics.pool_labels("local:east:on-demand:t4") == ("local", "east", "on-demand", "t4")


def _running_job(store: Store, start: float) -> str:
    """A running job of team ml holding 2 spot GPUs at $3.60/GPU-hour since ``start``."""
    job = store.submit(spec("open", run="true", gpus=2), team="ml")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1, pool="aws:east:spot:v100", gpus=2)
    store.apply(plan)
    job = store.get_job(job.id)
    assert job is not None
    plan = Plan()
    plan.change(job, JobState.RUNNING)
    plan.open_placement(Placement(job_id=job.id, attempt=1, start=start,
                                  pool="aws:east:spot:v100", cloud="aws", region="east",
                                  market=Market.SPOT, gpus=2, price_per_gpu_hour=3.6))
    store.apply(plan)
    return job.id


def test_cost_counters_only_grow_when_an_interval_closes_before_the_last_scrape(
        store: Store) -> None:
    """The reconciler closes an interval at its node's recorded end, which may be before the
    last scrape: an open interval counted until that scrape would make the counter fall."""
    start = time.time() - 100
    job_id = _running_job(store, start)
    scrape, _ = metrics.registry(store)
    first = Scrape(generate_latest(scrape).decode())
    assert first.value("fleet_gpu_seconds_total") == 0  # still open: the gauge has it
    assert first.value("fleet_open_gpu_seconds") == pytest.approx(200, abs=20)
    assert first.value("fleet_open_cost_usd") == pytest.approx(0.2, abs=0.02)

    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()  # ended 50 s after it started: 50 s before the first scrape
    plan.change(job, JobState.COMPLETED)
    (interval,) = store.placements(job_id)
    plan.close_placement(interval.model_copy(update={"end": start + 50}))
    store.apply(plan)
    second = Scrape(generate_latest(scrape).decode())
    for name in ("fleet_gpu_seconds_total", "fleet_cost_usd_total",
                 "fleet_ondemand_cost_usd_total"):
        assert second.value(name) >= first.value(name), name
    assert second.value("fleet_gpu_seconds_total") == pytest.approx(100)
    assert second.value("fleet_cost_usd_total") == pytest.approx(0.1)
    # the gauge's series stays, at 0, beside the counter's
    assert [s.value for s in second.samples("fleet_open_gpu_seconds", team="ml")] == [0]


def test_series_of_a_known_team_read_zero_once_its_jobs_are_done(store: Store) -> None:
    job = store.submit(spec("gone", run="true"), team="ml")
    scrape, _ = metrics.registry(store)
    assert Scrape(generate_latest(scrape).decode()).value("fleet_queue_jobs", team="ml") == 1
    plan = Plan()
    plan.change(job, JobState.CANCELLED)
    store.apply(plan)
    got = Scrape(generate_latest(scrape).decode())
    assert {s.labels["state"]: s.value for s in got.samples("fleet_jobs", team="ml")} == {
        s.value: 1 if s is JobState.CANCELLED else 0 for s in JobState}
    for name in ("fleet_queue_jobs", "fleet_queue_oldest_wait_seconds"):
        assert [s.value for s in got.samples(name, team="ml")] == [0], name


def test_the_first_scrape_reads_no_job_the_api_read_at_its_start(store: Store) -> None:
    _running_job(store, time.time() - 10)

    def reads() -> dict[str, int]:  # the commands that read a job's record and intervals
        stats = store.r.info("commandstats")
        return {k: stats.get(f"cmdstat_{k}", {}).get("calls", 0) for k in ("hmget", "lrange")}

    before = reads()
    app = build_app(store, ApiConfig.from_mapping({"tokens": [{"admin": True,
                                                               "token": ADMIN}]}))
    assert reads() == before  # building the app reads nothing
    with TestClient(app) as client:  # the app starts: it reads every job once
        started = reads()
        got = Scrape(client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text)
    assert started != before
    assert got.value("fleet_jobs", state="running", team="ml") == 1
    assert reads() == started  # and the first scrape reads nothing more
