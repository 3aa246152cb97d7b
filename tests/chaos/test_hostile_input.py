"""Hostile requests against a real API on loopback over a real redis-server: YAML anchor bombs,
alias floods, oversized fields, deep nesting and out-of-range ids are each answered 4xx naming
the field, in well under 100 ms, while ``/healthz`` keeps answering and nothing is stored."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import pytest

from broker.api import build_app
from broker.auth import ApiConfig
from broker.spec import MAX_ENVS, MAX_TEXT_BYTES
from broker.store import Store
from tests.api_server import TOKENS, ApiServer, api_config
from tests.chaos.conftest import Tally
from tests.chaos.hostile import CASES, Case, attack, send, timed
from tests.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]

FAST_S = 0.100  # the bound for answering one hostile request
TRIES = 3  # each case is sent this often; its median must be under FAST_S (a shared machine)

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Store]]:
    """The API with the production body limit (the shared test config's is 64 KB)."""
    redis = RedisServer(tmp_path_factory.mktemp("hostile") / "redis")
    redis.start()
    srv = None
    try:
        store = Store.from_url(redis.url)
        config = api_config().model_copy(update={"max_body_bytes": ApiConfig().max_body_bytes})
        srv = ApiServer(build_app(store, config)).start()
        yield srv, store
    finally:
        if srv is not None:
            srv.stop()
        redis.stop()


class HealthProbe:
    """Polls ``/healthz`` from its own thread; ``.worst`` is the slowest answer seen."""

    def __init__(self, url: str, every_s: float = 0.02) -> None:
        self.url, self.every_s = url, every_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = c.get(self.url + "/healthz")
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text[:100]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies.append(time.perf_counter() - t0)
                self._stop.wait(self.every_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("inf"))


def check_answer(case: Case, r: httpx.Response) -> None:
    assert r.status_code == case.status, f"{case.name}: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    if case.field is not None:
        fields = [p["field"] for p in err["problems"]]
        assert any(f.startswith(case.field) for f in fields), f"{case.name}: {err}"
        assert all(p["message"] for p in err["problems"])
    assert len(r.content) < 8192, f"{case.name}: a {len(r.content)}-byte error"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_is_a_fast_4xx_naming_the_field(
        stack: tuple[ApiServer, Store], case: Case, chaos: Tally) -> None:
    srv, store = stack
    store.r.flushdb()
    with HealthProbe(srv.url) as health, httpx.Client(base_url=srv.url, timeout=60) as c:
        send(c, Case("warm-up", "ml", "GET", "/v1/jobs"), TOKENS)
        times, errors = [], 0
        for _ in range(TRIES):
            took, r = timed(lambda: send(c, case, TOKENS))
            errors += r.status_code >= 500
            chaos.record(faults=1, latency_s=took)
            check_answer(case, r)
            times.append(took)
        time.sleep(0.05)  # one more probe after the last answer
    print(f"hostile: {case.name}: median {statistics.median(times) * 1000:.1f} ms, worst "
          f"{max(times) * 1000:.1f} ms; /healthz worst {health.worst * 1000:.1f} ms")
    chaos.record(server_errors=errors, latency_s=health.worst)
    assert statistics.median(times) < FAST_S, f"{case.name}: answered in {times}"
    assert not health.failures and health.latencies
    assert health.worst < 1.0, f"/healthz took {health.worst:.3f} s during {case.name}"
    assert store.list_jobs() == [] and store.r.dbsize() == 0  # nothing of it was kept


def test_a_submitted_spec_may_still_use_anchors(stack: tuple[ApiServer, Store]) -> None:
    """Bounded aliases are not refused: an anchor reused a few times is a plain spec."""
    srv, store = stack
    body = ("name: anchors\nrun: &cmd echo hi\nsetup: *cmd\nbatch_size: 1\n"
            "work: {samples: 1}\nenvs: {A: &v shared, B: *v}\n")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = send(c, Case("anchors", "ml", "POST", "/v1/jobs", body, status=201), TOKENS)
    assert r.status_code == 201, r.text
    job = r.json()["job"]
    assert job["spec"]["setup"] == "echo hi" and job["spec"]["envs"] == {"A": "shared",
                                                                          "B": "shared"}
    store.r.flushdb()


def test_a_json_spec_at_the_field_limits_is_accepted(stack: tuple[ApiServer, Store]) -> None:
    """The caps refuse what is over them, not what is at them."""
    srv, store = stack
    spec = {"name": "edge", "run": "r" * MAX_TEXT_BYTES, "batch_size": 1,
            "work": {"samples": 1}, "envs": {f"V{i}": "v" for i in range(MAX_ENVS)}}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = send(c, Case("edge", "ml", "POST", "/v1/jobs", json.dumps(spec),
                         content_type="application/json", status=201), TOKENS)
    assert r.status_code == 201, r.text
    assert len(store.get_job(r.json()["job"]["id"]).spec.run) == MAX_TEXT_BYTES  # type: ignore[union-attr]
    store.r.flushdb()


LEASE_TTL_S = 1.0  # short, so that a frozen leader loses its lease within the test
LOAD_S = 4.0
CLIENTS = 4


def _python(*args: str, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]


def test_the_leader_keeps_its_lease_under_hostile_load(tmp_path: Path) -> None:
    """``fleet up``'s process (API and leader loop together) under concurrent hostile requests,
    a second broker waiting for the lease: the leader never loses it and ``/healthz`` answers
    throughout."""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    store = Store.from_url(redis.url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FLEET_TEAM_TOKENS": f"ml={TOKENS['ml']}"}
    procs = [_python("-m", "tests.chaos.stack_main", redis.url, str(tmp_path / "leader"),
                     str(port), "leader", str(LEASE_TTL_S), env=env)]
    try:
        deadline = time.monotonic() + 60
        while (store.leader() or (0, ""))[1] != "leader" or not _healthy(url):
            assert procs[0].poll() is None and time.monotonic() < deadline, "no leader"
            time.sleep(0.1)
        fence = store.leader()[0]  # type: ignore[index]
        procs.append(_python("-m", "broker.server", "--redis-url", redis.url, "--state-dir",
                             str(tmp_path / "standby"), "--lease-ttl", str(LEASE_TTL_S),
                             "--owner", "standby", "--no-agent"))
        leaders: list[tuple[int, str] | None] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                leaders.append(store.leader())

        watcher = threading.Thread(target=watch)
        # the attackers in their own processes: the probe here competes with nothing of theirs
        with HealthProbe(url) as health, ProcessPoolExecutor(
                CLIENTS, mp_context=multiprocessing.get_context("spawn")) as pool:
            watcher.start()
            attacks = [pool.submit(attack, url, TOKENS, i, CLIENTS, LOAD_S)
                       for i in range(CLIENTS)]
            answers = [a for f in attacks for a in f.result(timeout=120)]
            stop.set()
            watcher.join(timeout=60)
        assert procs[1].poll() is None  # the standby was there to take over all along
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        redis.stop()
    worst = max(answers, key=lambda a: a[2])
    print(f"hostile load: {len(answers)} hostile requests from {CLIENTS} processes in {LOAD_S} s, "
          f"worst {worst[2] * 1000:.0f} ms ({worst[0]}); /healthz {len(health.latencies)} "
          f"probes, worst {health.worst * 1000:.0f} ms; leader {fence} held in "
          f"{sum(1 for x in leaders if x == (fence, 'leader'))}/{len(leaders)} samples")
    assert leaders and all(x == (fence, "leader") for x in leaders), set(leaders)
    assert {name for name, _, _ in answers} == {c.name for c in CASES}
    assert all(400 <= status < 500 for _, status, _ in answers), \
        {(n, s) for n, s, _ in answers if not 400 <= s < 500}
    assert not health.failures and health.worst < 1.0, (health.failures, health.worst)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
