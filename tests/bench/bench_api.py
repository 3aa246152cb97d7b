"""Submissions per second: through the HTTP API (uvicorn in its own process, httpx on loopback)
and directly into the store, against the same real redis-server in the same run (medians).

Five rounds, each 1,000 direct submissions and 300 through the API from one client and from eight
keep-alive clients, of ``examples/jobs/digits-elastic.yaml``; redis-server with AOF everysec on
loopback. Writes ``examples/results/api.json``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from broker.spec import load_spec_file, spec_to_json
from broker.store import Store
from policies.models import JobSpec
from tests.bench.results import measured, single, write
from tests.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "jobs" / "digits-elastic.yaml"
TOKEN = "bench-team-token-0123456789"
ROUNDS = 5
DIRECT_N = 1000  # submissions per round
API_N = 300
THREADS = 8


def serve(redis_url: str, port: int) -> None:
    """Child process: the API over ``redis_url`` on 127.0.0.1:``port`` (as ``fleet up`` does)."""
    import uvicorn

    from broker.api import build_app
    from broker.auth import ApiConfig

    app = build_app(Store.from_url(redis_url), ApiConfig.load())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _start_api(redis_url: str, tokens: dict[str, str] | None = None,
               ) -> tuple[subprocess.Popen[bytes], str]:
    """The API in its own process; ``tokens``: its token settings (env), team ml's by default."""
    port = free_port()
    env = {**os.environ, **(tokens or {"FLEET_TEAM_TOKENS": f"ml={TOKEN}"}),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.bench_api", "--serve", redis_url,
                             str(port)], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the API server did not start")


def _api_round(url: str, body: str, n: int, threads: int) -> tuple[float, list[float]]:
    """Submit ``n`` jobs from ``threads`` keep-alive clients; returns (rate, latencies)."""
    latencies: list[float] = []
    lock = threading.Lock()

    def worker(count: int) -> None:
        own: list[float] = []
        with httpx.Client(base_url=url, timeout=30, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}) as c:
            for _ in range(count):
                t0 = time.perf_counter()
                r = c.post("/v1/jobs", content=body)
                own.append(time.perf_counter() - t0)
                if r.status_code != 201:
                    raise RuntimeError(f"submit failed: {r.status_code} {r.text[:200]}")
        with lock:
            latencies.extend(own)

    per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    pool = [threading.Thread(target=worker, args=(c,)) for c in per]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return n / (time.perf_counter() - start), latencies


def _direct_round(store: Store, spec: JobSpec, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        store.submit(spec, team="ml")
    return n / (time.perf_counter() - start)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    spec = load_spec_file(SPEC).spec
    body = spec_to_json(spec)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-api-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        proc, url = _start_api(redis.url)
        try:
            store = Store.from_url(redis.url)
            _api_round(url, body, 50, 1)  # warm-up: connections, imports, script cache
            _direct_round(store, spec, 50)
            direct, seq, conc, seq_lat, conc_lat = [], [], [], [], []
            for _ in range(ROUNDS):
                direct.append(_direct_round(store, spec, DIRECT_N))
                rate, lat = _api_round(url, body, API_N, 1)
                seq.append(rate)
                seq_lat += lat
                rate, lat = _api_round(url, body, API_N, THREADS)
                conc.append(rate)
                conc_lat += lat
            total = len(store.list_jobs())
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            redis.stop()
    print(f"redis-server with AOF everysec on loopback; spec {SPEC.relative_to(ROOT)}; "
          f"{ROUNDS} rounds; {total} jobs stored; {os.cpu_count()} CPUs\n")
    print("| path | submissions/s (median of rounds) | latency p50 | latency p99 |")
    print("|---|---|---|---|")
    print(f"| store.submit direct, 1 client ({DIRECT_N}/round) | {statistics.median(direct):,.0f}"
          " | - | - |")
    numbers = {f"store.submit direct, 1 client ({DIRECT_N}/round)": measured(
        direct, "submissions/s")}
    for name, rates, lat in ((f"HTTP API, 1 client ({API_N}/round)", seq, seq_lat),
                             (f"HTTP API, {THREADS} clients ({API_N}/round)", conc, conc_lat)):
        print(f"| {name} | {statistics.median(rates):,.0f} | "
              f"{1000 * statistics.median(lat):.2f} ms | {1000 * _pct(lat, 0.99):.2f} ms |")
        numbers[name] = measured(rates, "submissions/s")
        numbers[f"{name}: latency"] = measured(lat, "ms", 1e3)
        numbers[f"{name}: latency p99"] = single(1000 * _pct(lat, 0.99), "ms")
    write("api", {"server": "redis-server, AOF everysec, loopback",
                  "spec": str(SPEC.relative_to(ROOT)), "rounds": ROUNDS, "CPUs": os.cpu_count(),
                  "jobs stored": total}, numbers)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main()
