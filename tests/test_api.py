"""The HTTP API on a real uvicorn server over a real redis-server: jobs, auth, bad input."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.api import build_app
from broker.auth import attempt_token
from broker.models import JobState
from broker.store import Plan, Store
from policies.models import Accelerator, Market, Pool
from tests.api_server import TOKENS, ApiServer, api_config, api_stack
from tests.redis_server import RedisServer
from tests.test_rendezvous import change

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "jobs"

SPEC = """
name: digits
run: python examples/train_digits.py --steps 10
gpus: 1:2
batch_size: {min: 32, max: 128, default: 64}
work: {steps: 10}
"""
POOLS = [
    Pool(cloud="local", region="east", accelerator=Accelerator.T4, market=Market.SPOT, nodes=1,
         gpus_per_node=4, price_per_gpu_hour=0.2),
    Pool(cloud="local", region="west", accelerator=Accelerator.T4, market=Market.ON_DEMAND,
         nodes=2, gpus_per_node=2, price_per_gpu_hour=0.5),
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Store]]:
    """One redis-server and one API server for the module (each test starts from an empty db)."""
    with api_stack(tmp_path_factory.mktemp("api")) as stack:
        yield stack


@pytest.fixture
def server(shared: tuple[ApiServer, Store]) -> ApiServer:
    shared[1].r.flushdb()
    return shared[0]


@pytest.fixture
def store(shared: tuple[ApiServer, Store], server: ApiServer) -> Store:
    return shared[1]


def client(server: ApiServer, who: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {TOKENS[who]}"} if who else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=10)


def submit(server: ApiServer, who: str, body: str = SPEC, **kw: object) -> httpx.Response:
    with client(server, who) as c:
        return c.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml"},
                      **kw)


def test_openapi_and_health(server: ApiServer) -> None:
    with client(server, None) as c:
        assert c.get("/healthz").json()["status"] == "ok"
        paths = c.get("/openapi.json").json()["paths"]
    for path in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
                 "/v1/jobs/{job_id}/logs", "/v1/capacity", "/v1/events", "/v1/agent/heartbeat",
                 "/v1/agent/rendezvous", "/v1/agent/secrets", "/v1/chaos/preempt",
                 "/v1/chaos/node"):
        assert path in paths


def test_submit_list_get_cancel(server: ApiServer, store: Store) -> None:
    r = submit(server, "ml")
    assert r.status_code == 201, r.text
    job = r.json()["job"]
    assert job["team"] == "ml" and job["spec"]["team"] == "ml" and job["state"] == "queued"
    assert job["spec"]["work_samples"] == 640 and r.json()["format"] == "fleet"
    assert store.get_job(job["id"]).spec.gpus.max == 2  # type: ignore[union-attr]
    with client(server, "ml") as c:
        listed = c.get("/v1/jobs").json()
        assert [j["id"] for j in listed["jobs"]] == [job["id"]] and listed["total"] == 1
        assert c.get("/v1/jobs", params={"state": "running"}).json()["jobs"] == []
        one = c.get(f"/v1/jobs/{job['id']}").json()
        assert one["job"]["id"] == job["id"] and one["placements"] == [] and one["cost"] == 0
        cancelled = c.post(f"/v1/jobs/{job['id']}/cancel").json()["job"]
        assert cancelled["state"] == "cancelled"
    assert store.get_job(job["id"]).state is JobState.CANCELLED  # type: ignore[union-attr]


def test_teams_see_only_their_jobs_admin_sees_all(server: ApiServer, store: Store) -> None:
    mine = submit(server, "ml").json()["job"]["id"]
    theirs = submit(server, "vision").json()["job"]["id"]
    with client(server, "ml") as c:
        assert [j["id"] for j in c.get("/v1/jobs").json()["jobs"]] == [mine]
        for path in (f"/v1/jobs/{theirs}", f"/v1/jobs/{theirs}/logs"):
            r = c.get(path)
            assert r.status_code == 404 and theirs in r.json()["error"]["message"]
        assert c.post(f"/v1/jobs/{theirs}/cancel").status_code == 404
        assert c.get("/v1/jobs", params={"team": "vision"}).status_code == 404
        assert c.get("/v1/events", params={"job_id": theirs}).status_code == 404
        seen = {e["job_id"] for e in c.get("/v1/events").json()["events"]}
        assert seen == {mine}
    assert store.get_job(theirs).state is JobState.QUEUED  # type: ignore[union-attr]
    with client(server, "admin") as c:
        assert {j["id"] for j in c.get("/v1/jobs").json()["jobs"]} == {mine, theirs}
        assert [j["id"] for j in c.get("/v1/jobs", params={"team": "vision"}).json()["jobs"]] \
            == [theirs]
        assert c.get(f"/v1/jobs/{theirs}").status_code == 200
        assert {e["job_id"] for e in c.get("/v1/events").json()["events"]} == {mine, theirs}


# Who may call each operation: the roles of the tokens it takes (none: no token needed). An
# operation the app documents without an entry here fails the matrix test.
PUBLIC: frozenset[str] = frozenset()
USERS = frozenset({"admin", "team"})
AGENTS = frozenset({"admin", "agent"})
ALLOWED = {
    ("GET", "/healthz"): PUBLIC, ("GET", "/readyz"): PUBLIC,
    ("GET", "/metrics"): frozenset({"admin", "metrics"}),
    ("POST", "/v1/jobs"): USERS, ("GET", "/v1/jobs"): USERS, ("POST", "/v1/jobs/preview"): USERS,
    ("GET", "/v1/jobs/{job_id}"): USERS, ("POST", "/v1/jobs/{job_id}/cancel"): USERS,
    ("GET", "/v1/jobs/{job_id}/logs"): USERS, ("POST", "/v1/blobs"): USERS,
    ("GET", "/v1/capacity"): USERS, ("GET", "/v1/costs"): USERS, ("GET", "/v1/events"): USERS,
    ("GET", "/v1/costs/series"): USERS, ("GET", "/v1/recoveries"): USERS,
    ("GET", "/v1/prices"): USERS,
    ("GET", "/v1/agent/blobs/{digest}"): AGENTS, ("POST", "/v1/agent/heartbeat"): AGENTS,
    ("POST", "/v1/agent/rendezvous"): AGENTS,
    ("POST", "/v1/agent/secrets"): frozenset({"agent"}),  # no admin: no person reads them
    ("POST", "/v1/chaos/preempt"): frozenset({"admin"}),
    ("POST", "/v1/chaos/node"): frozenset({"admin"}),
}
ROLE = {"admin": "admin", "ml": "team", "vision": "team", "agent": "agent", "metrics": "metrics"}
PACK = gzip.compress(b"print('hi')\n")


def _request(method: str, path: str, op: dict, job_id: str, digest: str) -> dict:
    """The operation's request for team ml's running job: path and required query parameters
    filled, and a body it takes (so an allowed caller gets a 2xx)."""
    values = {"job_id": job_id, "digest": digest, "attempt": 1}
    query = {p["name"]: values[p["name"]] for p in op.get("parameters", [])
             if p["in"] == "query" and p.get("required")}
    url = path.format(**values)
    bodies: dict[tuple[str, str], dict] = {
        ("POST", "/v1/jobs"): {"content": SPEC, "headers": {"Content-Type": "application/yaml"}},
        ("POST", "/v1/jobs/preview"): {"content": SPEC,
                                       "headers": {"Content-Type": "application/yaml"}},
        ("POST", "/v1/blobs"): {"content": PACK},
        ("POST", "/v1/agent/heartbeat"): {"json": {"job_id": job_id, "attempt": 1}},
        ("POST", "/v1/agent/rendezvous"): {"json": {"job_id": job_id, "attempt": 1, "round": 0,
                                                    "node_rank": 0, "addr": "10.0.0.5:29500"}},
        ("POST", "/v1/agent/secrets"): {"json": {"job_id": job_id, "attempt": 1}},
        ("POST", "/v1/chaos/preempt"): {"json": {"region": "east"}},
        ("POST", "/v1/chaos/node"): {"json": {"job_id": job_id}},
    }
    return {"method": method, "url": url, "params": query, **bodies.get((method, path), {})}


def test_authorization_matrix(server: ApiServer, store: Store) -> None:
    """Every operation of the app's own OpenAPI document, called by no token, a wrong one, the
    admin's token sent as Basic, both teams, the agent, the scraper and the admin, over team
    ml's running job: 401 without a valid bearer token, 403 for a role it does not take, 404
    for the other team's job, a 2xx for the rest, never a 5xx; and the document names the roles
    of each (its security) as this table does."""
    ops = {(m.upper(), path): op for path, item in build_app(store, api_config()).openapi()[
        "paths"].items() for m, op in item.items()}
    assert set(ops) == set(ALLOWED), "each operation needs its entry in ALLOWED"
    tokens = {None: None, "wrong": "Bearer wrong-token-0123456789",
              "basic": f"Basic {TOKENS['admin']}",
              **{who: f"Bearer {TOKENS[who]}" for who in ROLE}}
    for (method, path), op in ops.items():
        allowed = ALLOWED[(method, path)]
        documented = set(op["security"][0]["bearer"]) if "security" in op else set()
        assert documented == allowed, (method, path)
        store.r.flushdb()
        store.set_pools(POOLS)
        store.acquire_lease("matrix", 60)  # /readyz: a leader holds the lease
        with client(server, "ml") as c:
            ref = c.post("/v1/blobs", content=PACK).json()["ref"]
        job_id = submit(server, "ml", SPEC + f"workdir: {ref}\n").json()["job"]["id"]
        change(store, job_id, JobState.LAUNCHING, attempt=1, gpus=1)
        change(store, job_id, JobState.RUNNING)
        request = _request(method, path, op, job_id, ref.removeprefix("blob:sha256:"))
        own_job = "job_id" in path or "job_id" in request["params"]
        for who, header in tokens.items():
            headers = {**request.get("headers", {}), **({"Authorization": header} if header
                                                        else {})}
            r = httpx.request(**{**request, "url": server.url + request["url"],
                                 "headers": headers}, timeout=10)
            where = (method, path, who, r.status_code, r.text[:200])
            assert r.status_code < 500, where
            if not allowed:
                assert r.status_code == 200, where
            elif who not in ROLE:
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", where
            elif ROLE[who] not in allowed:
                assert r.status_code == 403, where
            elif who == "vision" and own_job:
                assert r.status_code == 404 and job_id in r.text, where
            else:
                assert 200 <= r.status_code < 300, where


def test_roles(server: ApiServer, store: Store) -> None:
    with client(server, "agent") as c:
        assert c.get("/v1/jobs").status_code == 403
    assert submit(server, "agent").status_code == 403
    with client(server, "ml") as c:
        assert c.post("/v1/chaos/preempt", json={"region": "east"}).status_code == 403
        assert c.post("/v1/chaos/node", json={"job_id": "a-1"}).status_code == 403
        assert c.post("/v1/agent/heartbeat", json={"job_id": "a-1", "attempt": 1}
                      ).status_code == 403
    r = submit(server, "ml", SPEC + "team: vision\n")
    assert r.status_code == 403 and r.json()["error"]["problems"][0]["field"] == "team"
    assert store.list_jobs() == []
    admin_job = submit(server, "admin", SPEC + "team: vision\n").json()["job"]
    assert admin_job["team"] == "vision"


BAD_SPECS = [
    ("name: [oops", "line 1"),
    (SPEC + "accelerators: [TPU]", "accelerators[0]"),
    (SPEC.replace("gpus: 1:2", "gpus: -4"), "gpus.min"),
    (SPEC.replace("gpus: 1:2", "gpus: 99999999999999999999"), "gpus.min"),
    (SPEC.replace("{steps: 10}", "{samples: 100000000000000000000}"), "work"),
    (SPEC.replace("name: digits", "name: ../../etc"), "name"),
    (SPEC.replace("name: digits", "name: 'a\\\\b'"), "name"),
    (json.dumps({"name": "bad\u0007name", "run": "x", "batch_size": 2,
                 "work": {"samples": 1}}), "name"),
    ("", "(file)"),
    ('{"name": "x", "run": "y", "batch_size": 2, "work": {"samples": 1}, "deadline": Infinity}',
     "deadline"),
    ('{"name": "x", "run": "y", "batch_size": NaN, "work": {"samples": 1}}', "batch_size"),
    ("run: x\nworkdir: .\nresources: {accelerators: T4:1}", "workdir"),
    (SPEC + "gpu: 2", "gpu"),
]


@pytest.mark.parametrize(("body", "field"), BAD_SPECS)
def test_bad_specs_are_422_naming_the_field_and_store_nothing(
        server: ApiServer, store: Store, body: str, field: str) -> None:
    r = submit(server, "ml", body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["message"] == "invalid job spec"
    assert any(p["field"].startswith(field) and p["message"] for p in err["problems"]), err
    assert store.list_jobs() == [] and store.events() == []


def test_request_limits_and_bad_parameters(server: ApiServer, store: Store) -> None:
    big = SPEC + "setup: '" + "x" * 70_000 + "'\n"
    assert submit(server, "ml", big).status_code == 413
    with client(server, "ml") as c:
        chunked = c.post("/v1/jobs", content=iter([big.encode()]),
                         headers={"Content-Type": "application/yaml"})
        assert chunked.status_code == 413
        for path in ("/v1/agent/heartbeat", "/v1/chaos/preempt"):  # checked before auth
            huge = httpx.post(server.url + path, content=iter([b"{" + b" " * 70_000]))
            assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
        r = c.post("/v1/jobs", content=SPEC, headers={"Content-Type": "image/png"})
        assert r.status_code == 415
        r = c.post("/v1/jobs", content=SPEC, params={"gpus": "lots"},
                   headers={"Content-Type": "text/yaml"})
        assert r.status_code == 422 and r.json()["error"]["problems"][0]["field"] == "--gpus"
        r = c.get("/v1/jobs", params={"limit": 0, "state": "sleeping"})
        fields = {p["field"] for p in r.json()["error"]["problems"]}
        assert r.status_code == 422 and fields == {"limit", "state.0"}
        assert c.get("/v1/jobs/..%2Fetc/logs").status_code in (404, 422)
        assert c.get("/v1/events", params={"since": "$"}).status_code == 422
        assert c.get("/v1/jobs/x-1/logs", params={"offset": -1}).status_code == 422
    assert store.list_jobs() == []


def test_overrides_json_skypilot_and_idempotency(server: ApiServer, store: Store) -> None:
    r = submit(server, "ml", params={"gpus": "2:4", "spot": "never"})
    assert r.json()["job"]["spec"]["gpus"] == {"min": 2, "max": 4, "default": None}
    with client(server, "ml") as c:
        as_json = c.post("/v1/jobs", json={"name": "j", "run": "x", "batch_size": 8,
                                           "work": {"samples": 80}})
        assert as_json.status_code == 201
        assert as_json.json()["job"]["spec"]["batch_size"]["max"] == 8
        keyed = [c.post("/v1/jobs", content=SPEC, headers={"Idempotency-Key": "launch-7",
                                                           "Content-Type": "text/yaml"})
                 for _ in range(2)]
        assert keyed[0].json()["job"]["id"] == keyed[1].json()["job"]["id"]
    sky = submit(server, "ml", (EXAMPLES / "skypilot-task.yaml").read_text()).json()
    assert sky["format"] == "skypilot" and sky["warnings"]
    assert sky["job"]["spec"]["gpus"] == {"min": 2, "max": 2, "default": None}
    assert len(store.list_jobs()) == 4


def test_logs_capacity_and_events(server: ApiServer, store: Store) -> None:
    store.set_pools(POOLS)
    job_id = submit(server, "ml").json()["job"]["id"]
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, gpus=2, batch_size=64, pool=POOLS[0].id, attempt=1)
    store.apply(plan)
    store.append_log(job_id, [f"step {i}" for i in range(5)])
    with client(server, "ml") as c:
        first = c.get(f"/v1/jobs/{job_id}/logs", params={"limit": 3}).json()
        assert first["lines"] == ["step 0", "step 1", "step 2"] and first["next_offset"] == 3
        rest = c.get(f"/v1/jobs/{job_id}/logs", params={"offset": 3}).json()
        assert rest["lines"] == ["step 3", "step 4"] and rest["terminal"] is False
        cap = c.get("/v1/capacity").json()
        east = next(p for p in cap["pools"] if p["region"] == "east")
        assert (east["capacity"], east["used"], east["free"]) == (4, 2, 2)
        assert cap["total"] == {"capacity": 8, "used": 2}
        page = c.get("/v1/events", params={"job_id": job_id, "limit": 1}).json()
        assert [e["type"] for e in page["events"]] == ["submitted"]
        more = c.get("/v1/events", params={"job_id": job_id, "since": page["next"]}).json()
        assert [e["type"] for e in more["events"]] == ["launching"]


def launching(server: ApiServer, store: Store) -> str:
    """A submitted job the leader has launched (attempt 1): what heartbeats report on."""
    job_id = submit(server, "ml").json()["job"]["id"]
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, gpus=1, attempt=1)
    store.apply(plan)
    return job_id


def test_agent_heartbeat(server: ApiServer, store: Store) -> None:
    job_id = launching(server, store)
    beat = {"job_id": job_id, "attempt": 1, "node_rank": 0, "state": "running", "step": 5,
            "samples_done": 320, "samples_per_sec": 250.5, "world_size": 1,
            "global_batch_size": 64, "checkpoint_step": 4}
    store.announce_broker("http://10.0.0.7:8470", ttl_s=60)  # a replica: the agent learns it
    with client(server, "agent") as c:
        r = c.post("/v1/agent/heartbeat", json=beat)
        assert r.status_code == 200 and r.json() == {
            "action": None, "round": 0, "brokers": ["http://10.0.0.7:8470"], "nproc": None}
        store.r.delete(f"{store.p}brokers")
        got = store.get_job(job_id)
        assert got is not None and got.samples_done == 320 and got.checkpoint_step == 4
        warmup = c.post("/v1/agent/heartbeat", json={**beat, "samples_per_sec": 0.0,
                                                     "global_batch_size": None})
        assert warmup.json() == {"action": None, "round": 0, "brokers": [], "nproc": None}
        got = store.get_job(job_id)
        assert got is not None and got.samples_per_sec == 250.5  # 0 is not a measurement
        assert c.post("/v1/agent/heartbeat", json={**beat, "attempt": 0}).json() == {
            # a stale attempt must stop
            "action": "checkpoint-exit", "round": 0, "brokers": [], "nproc": None}
        bad = c.post("/v1/agent/heartbeat", json={**beat, "samples_per_sec": -1,
                                                  "world_size": 0})
        assert bad.status_code == 422
        assert {p["field"] for p in bad.json()["error"]["problems"]} == {
            "samples_per_sec", "world_size"}
        assert c.post("/v1/agent/heartbeat", json={**beat, "job_id": "nope-9"}
                      ).status_code == 404
    with client(server, "ml") as c:
        c.post(f"/v1/jobs/{job_id}/cancel")
    with client(server, "agent") as c:
        assert c.post("/v1/agent/heartbeat", json=beat).json() == {
            "action": "checkpoint-exit", "round": 0, "brokers": [], "nproc": None}


def test_an_attempt_token_reports_for_its_own_attempt_only(server: ApiServer,
                                                           store: Store) -> None:
    """A launched job's agent holds its attempt's token, not the fleet's: it can report for
    that attempt, not for another job or a later attempt, and cannot use the rest of the API."""
    mine, other = launching(server, store), launching(server, store)
    token = attempt_token(TOKENS["agent"], mine, 1)
    beat = {"job_id": mine, "attempt": 1, "step": 3, "exit_code": 0}
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as c:
        assert c.post("/v1/agent/heartbeat", json=beat).json() == {
            "action": None, "round": 0, "brokers": [], "nproc": None}
        for forged in ({**beat, "job_id": other}, {**beat, "attempt": 2}):
            r = c.post("/v1/agent/heartbeat", json=forged)
            assert r.status_code == 403 and "attempt's agent token" in r.json()["error"]["message"]
        assert c.get("/v1/jobs").status_code == 401  # not a token of the API at large
    victim = store.get_job(other)
    assert victim is not None and victim.samples_done == 0  # nothing recorded for it
    assert store.agent_reports([victim]) == {}  # no exit code to settle it with
    with client(server, "ml") as c:  # a team token is no agent either
        r = c.post("/v1/agent/heartbeat", json={**beat, "job_id": mine})
        assert r.status_code == 403


def test_agent_heartbeat_checkpoint_size(server: ApiServer, store: Store) -> None:
    """The measured checkpoint size is kept with its step as telemetry (no version bump),
    shown in the job view, and a bad size is a 422 naming the field."""
    job_id = launching(server, store)
    version = store.get_job(job_id).version  # type: ignore[union-attr]
    beat = {"job_id": job_id, "attempt": 1, "step": 12, "checkpoint_step": 10,
            "checkpoint_bytes": 52_100_000_000}
    with client(server, "agent") as c:
        assert c.post("/v1/agent/heartbeat", json=beat).json() == {
            "action": None, "round": 0, "brokers": [], "nproc": None}
        got = store.get_job(job_id)
        assert got is not None and (got.checkpoint_step, got.checkpoint_bytes) == (
            10, 52_100_000_000) and got.version == version
        for bad in (-1, "12", 1.5, True, 10**17):
            r = c.post("/v1/agent/heartbeat", json={**beat, "checkpoint_bytes": bad})
            assert r.status_code == 422, bad
            assert [p["field"] for p in r.json()["error"]["problems"]] == ["checkpoint_bytes"]
    with client(server, "ml") as c:
        shown = c.get(f"/v1/jobs/{job_id}").json()["job"]
        assert (shown["checkpoint_step"], shown["checkpoint_bytes"]) == (10, 52_100_000_000)
    with client(server, "agent") as c:  # a newer checkpoint without a size: size unknown
        c.post("/v1/agent/heartbeat", json={**beat, "checkpoint_step": 20,
                                            "checkpoint_bytes": None})
        got = store.get_job(job_id)
        assert got is not None and (got.checkpoint_step, got.checkpoint_bytes) == (20, None)


def test_agent_rendezvous(server: ApiServer, store: Store) -> None:
    """Rank 0 registers the master with its attempt's token; the others poll until it did; a
    heartbeat tells the agents the round; other tokens and bad addresses are refused."""
    job_id = launching(server, store)
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, nodes=2)
    store.apply(plan)
    visit = {"job_id": job_id, "attempt": 1, "round": 0, "node_rank": 1}
    own = {"Authorization": f"Bearer {attempt_token(TOKENS['agent'], job_id, 1)}"}
    with httpx.Client(base_url=server.url, headers=own, timeout=10) as c:
        assert c.post("/v1/agent/rendezvous", json=visit).json() == {
            "round": 0, "nnodes": 2, "master": None, "addrs": None, "action": None}
        r = c.post("/v1/agent/rendezvous", json={**visit, "node_rank": 0,
                                                 "addr": "10.0.0.5:29500"})
        assert r.status_code == 200 and r.json()["master"] == "10.0.0.5:29500"
        assert c.post("/v1/agent/rendezvous", json=visit).json()["master"] == "10.0.0.5:29500"
        for bad in ("10.0.0.5", "10.0.0.5:0", "10.0.0.5:65536", "10.0.0.5:+80", "bad_host:80",
                    "-node.internal:80", "::1:80", "[10.0.0.5]:80", "node:80\n", "999.1.1.1:80",
                    ":80", "x" * 64 + ".internal:80"):
            r = c.post("/v1/agent/rendezvous", json={**visit, "addr": bad})
            assert r.status_code == 422, bad
            problems = r.json()["error"]["problems"]
            assert [p["field"] for p in problems] == ["addr"], bad
            assert "host:port" in problems[0]["message"]
        for good in ("[fd00::5]:29500", "node-1.internal:1", "node-1.internal.:65535",
                     "localhost:80"):
            assert c.post("/v1/agent/rendezvous", json={**visit, "addr": good}
                          ).status_code == 200, good
        r = c.post("/v1/agent/rendezvous", json={**visit, "round": -1, "node_rank": 4097})
        assert {p["field"] for p in r.json()["error"]["problems"]} == {"round", "node_rank"}
        for forged in ({**visit, "attempt": 2}, {**visit, "job_id": launching(server, store)}):
            r = c.post("/v1/agent/rendezvous", json=forged)
            assert r.status_code == 403 and "attempt's agent token" in r.json()["error"]["message"]
    with client(server, "ml") as c:  # a team token is no agent
        assert c.post("/v1/agent/rendezvous", json=visit).status_code == 403
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, JobState.RUNNING, round=1)  # a lost node replaced
    store.apply(plan)
    with client(server, "agent") as c:  # the fleet's agent token works as for heartbeats
        beat = {"job_id": job_id, "attempt": 1, "node_rank": 1, "round": 0}
        assert c.post("/v1/agent/heartbeat", json=beat).json() == {
            "action": None, "round": 1, "brokers": [], "nproc": None}
        assert c.post("/v1/agent/rendezvous", json=visit).json() == {
            "round": 1, "nnodes": 2, "master": None, "addrs": None, "action": None}
        assert c.post("/v1/agent/rendezvous", json={**visit, "job_id": "nope-9"}
                      ).status_code == 404


def test_agent_launch_key(server: ApiServer, store: Store) -> None:
    """An agent's FLEET_LAUNCH_KEY is checked for shape on both agent endpoints, and a node
    whose rank was replaced is told to stop by either."""
    job_id = launching(server, store)
    job = change(store, job_id, JobState.RUNNING, nodes=2, launch_key=f"{job_id}:3:1",
                 round=1, stand_ins={1: 1})
    visit = {"job_id": job_id, "attempt": 1, "round": 1, "node_rank": 1}
    with client(server, "agent") as c:
        for path in ("/v1/agent/rendezvous", "/v1/agent/heartbeat"):
            for bad in ("", "a b", "key/1", "k\n", "x" * 161):
                r = c.post(path, json={**visit, "launch_key": bad})
                assert r.status_code == 422, (path, bad)
                assert [p["field"] for p in r.json()["error"]["problems"]] == ["launch_key"]
            old = c.post(path, json={**visit, "launch_key": job.launch_key}).json()
            assert old["action"] == "checkpoint-exit", path
            stand_in = c.post(path, json={**visit, "launch_key": f"{job.launch_key}~r1.1"})
            assert stand_in.json()["action"] is None, path
    assert store.checked_in([job]) == {job_id: {1}}


def test_chaos_preempt(server: ApiServer, store: Store) -> None:
    store.set_pools(POOLS)
    with client(server, "admin") as c:
        r = c.post("/v1/chaos/preempt", json={"region": "local:east"})
        assert r.status_code == 202 and r.json()["pools"] == [POOLS[0].id]
        assert store.pop_commands() == [{"kind": "preempt", "region": "east",
                                         "duration_s": 60.0}]
        miss = c.post("/v1/chaos/preempt", json={"region": "west"})  # on-demand only
        assert miss.status_code == 404 and "local:east" in miss.json()["error"]["message"]
        bad = c.post("/v1/chaos/preempt", json={"region": "east/../x", "extra": 1})
        assert bad.status_code == 422
    assert store.pop_commands() == []


def test_chaos_node(server: ApiServer, store: Store) -> None:
    job = store.get_job(submit(server, "ml").json()["job"]["id"])
    assert job is not None
    with client(server, "admin") as c:
        assert c.post("/v1/chaos/node", json={"job_id": "nope-1"}).status_code == 404
        queued = c.post("/v1/chaos/node", json={"job_id": job.id})
        assert queued.status_code == 409 and "queued" in queued.json()["error"]["message"]
        change(store, job.id, JobState.LAUNCHING, attempt=1, gpus=2, nodes=2)
        change(store, job.id, JobState.RUNNING)
        assert c.post("/v1/chaos/node", json={"job_id": job.id, "rank": 2}).status_code == 409
        bad = c.post("/v1/chaos/node", json={"job_id": job.id, "how": "melt"})
        assert bad.status_code == 422 and "how" in bad.text
        r = c.post("/v1/chaos/node", json={"job_id": job.id, "rank": 1, "how": "kill"})
        assert r.status_code == 202
    assert store.pop_commands() == [{"kind": "node", "job_id": job.id, "rank": 1,
                                     "how": "kill"}]


def test_store_down_is_503(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    srv = ApiServer(build_app(Store.from_url(redis.url), api_config())).start()
    try:
        redis.stop()
        with client(srv, "ml") as c:
            r = c.get("/v1/jobs")
        assert r.status_code == 503 and "redis" in r.json()["error"]["message"]
    finally:
        srv.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),  # JSON has no NaN or Infinity
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=3),
    max_leaves=12,
)
spec_keys = st.sampled_from(["name", "run", "gpus", "batch_size", "work", "spot", "regions",
                             "accelerators", "team", "deadline", "resources", "num_nodes"])


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(spec_keys, json_values, max_size=7))
def test_any_json_body_is_201_or_a_clear_4xx(server: ApiServer, store: Store,
                                              body: dict) -> None:
    before = len(store.list_jobs())
    with client(server, "ml") as c:
        r = c.post("/v1/jobs", json=body)
    assert r.status_code in (201, 403, 422), r.text
    if r.status_code == 201:
        assert len(store.list_jobs()) == before + 1
    else:
        err = r.json()["error"]
        assert err["problems"] and all(p["field"] and p["message"] for p in err["problems"])
        assert len(store.list_jobs()) == before


def test_heartbeat_reply_resizes_a_job_resized_in_place(server: ApiServer, store: Store) -> None:
    """After ``transitions.resized_in_place`` the node's rank 0 hears ``resize`` with the new
    size until it reports that world size; other ranks hear nothing of it."""
    job_id = launching(server, store)
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, JobState.RUNNING, gpus=2, resized_to=2)
    store.apply(plan)
    beat = {"job_id": job_id, "attempt": 1, "node_rank": 0, "state": "running", "step": 5,
            "samples_done": 320, "world_size": 1}
    with client(server, "agent") as c:
        asked = c.post("/v1/agent/heartbeat", json=beat).json()
        assert asked["action"] == "resize" and asked["nproc"] == 2
        done = c.post("/v1/agent/heartbeat", json={**beat, "world_size": 2}).json()
        assert done["action"] is None and done["nproc"] is None
        other = c.post("/v1/agent/heartbeat", json={**beat, "node_rank": 1}).json()
        assert other["action"] is None
