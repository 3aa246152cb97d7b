"""Time of one Prometheus scrape, ``GET /metrics``, with 10,000 jobs in the store (target: under
100 ms).

A real redis-server (AOF everysec) on loopback holds 10,000 jobs of 8 teams over 12 pools:
6,000 completed with two closed placement intervals each (one spot, one on-demand), 500
cancelled with one, 500 suspended with one, 1,000 running with one open interval, 2,000
queued; pool preemption and migration counts as the reconciler and scheduler keep them. The API
runs in its own process (uvicorn, as ``fleet up`` serves it) and an httpx client on loopback
scrapes it with a metrics token: the first scrape (a fresh API process read every job's record
and intervals once as it started), then ``SCRAPES`` more (only jobs whose record changed are read
again). Writes ``examples/results/metrics.json`` with the machine's CPU count and its load
average at the end (the timings are wall-clock and share the CPUs with whatever else runs), and
the CPU time one scrape costs the API process and redis-server (from ``/proc`` and ``INFO cpu``
over the ``SCRAPES`` scrapes, which other load does not inflate the way it does wall time).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from broker.models import JobState, Placement
from broker.store import Plan, Store
from policies.models import Accelerator, BatchRange, GpuRange, JobSpec, Market, Pool
from providers import registry
from tests.bench.bench_api import _start_api
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "examples" / "results" / "metrics.json"
TOKEN = "bench-metrics-token-0123456789"
JOBS = 10_000
MIX = {"completed": 6_000, "cancelled": 500, "suspended": 500, "running": 1_000,
       "queued": 2_000}
TEAMS = [f"team{i}" for i in range(8)]
SCRAPES = 30
BATCH = 250  # jobs per plan while filling the store


def _pools() -> list[Pool]:
    return [Pool(cloud=cloud, region=region, market=market, accelerator=Accelerator.V100,
                 nodes=64, gpus_per_node=8, price_per_gpu_hour=0.9 if market is Market.SPOT
                 else 3.06)
            for cloud in registry.rented() for region in ("east", "west")
            for market in (Market.SPOT, Market.ON_DEMAND)]


def _interval(job_id: str, attempt: int, pool: Pool, start: float, end: float | None,
              ) -> Placement:
    return Placement(job_id=job_id, attempt=attempt, start=start, end=end, pool=pool.id,
                     cloud=pool.cloud, region=pool.region, market=pool.market, gpus=4,
                     batch_size=256, price_per_gpu_hour=pool.price_per_gpu_hour,
                     ondemand_price_per_gpu_hour=3.06)


def fill(store: Store) -> None:
    """Submit ``JOBS`` jobs and move them to ``MIX``'s states with their intervals."""
    pools = _pools()
    store.set_pools(pools)
    spec = JobSpec(name="bench", run="true", gpus=GpuRange(min=1, max=8),
                   batch_size=BatchRange(min=32, max=512), work_samples=10_000)
    ids = [store.submit(spec.model_copy(update={"team": TEAMS[i % len(TEAMS)]}),
                       team=TEAMS[i % len(TEAMS)]).id for i in range(JOBS)]
    targets = [s for s, n in MIX.items() for _ in range(n)]
    now = time.time()
    moving = [(i, s) for i, s in zip(ids, targets, strict=True) if s != "queued"]
    for lo in range(0, len(moving), BATCH):
        chunk = moving[lo:lo + BATCH]
        jobs = {j.id: j for j in store._get_many([i for i, _ in chunk])}
        plan = Plan()
        for n, (job_id, _) in enumerate(chunk):
            plan.change(jobs[job_id], JobState.LAUNCHING, attempt=1,
                        pool=pools[n % len(pools)].id, gpus=4)
        store.apply(plan)
        jobs = {j.id: j for j in store._get_many([i for i, _ in chunk])}
        plan = Plan()
        for n, (job_id, state) in enumerate(chunk):
            pool = pools[n % len(pools)]
            other = pools[(n + 1) % len(pools)]
            start = now - 7200 + n
            if state == "running":
                plan.change(jobs[job_id], JobState.RUNNING)
                plan.open_placement(_interval(job_id, 1, pool, start, None))
            elif state == "completed":
                plan.change(jobs[job_id], JobState.RUNNING)
                plan.open_placement(_interval(job_id, 1, pool, start, start + 1800))
                plan.open_placement(_interval(job_id, 2, other, start + 1900, start + 3600))
                plan.count_preemption(pool.id)
                plan.count_migration(pool.id)
            else:  # cancelled, suspended: one closed interval
                plan.change(jobs[job_id], JobState.SUSPENDED)
                plan.open_placement(_interval(job_id, 1, pool, start, start + 900))
        store.apply(plan)
        finished = [(i, s) for i, s in chunk if s in ("completed", "cancelled")]
        jobs = {j.id: j for j in store._get_many([i for i, _ in finished])}
        plan = Plan()
        for job_id, state in finished:
            plan.change(jobs[job_id], JobState(state))
        if finished:
            store.apply(plan)


def _scrape(client: httpx.Client) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.get("/metrics")
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"/metrics answered {r.status_code}: {r.text[:200]}")
    return took, len(r.content)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu_s(store: Store) -> float:
    info = store.r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-metrics-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        proc = None
        try:
            store = Store.from_url(redis.url, confirm_durable=False)
            t0 = time.perf_counter()
            fill(store)
            fill_s = time.perf_counter() - t0
            counts = {s.value: len(store.job_ids([s])) for s in JobState}
            os.environ["FLEET_METRICS_TOKEN"] = TOKEN  # the API child takes its tokens from env
            proc, url = _start_api(redis.url)
            with httpx.Client(base_url=url, timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as client:
                cold, size = _scrape(client)
                cpu = (_cpu_s(proc.pid), _redis_cpu_s(store))
                warm = [_scrape(client)[0] for _ in range(SCRAPES)]
                api_cpu = (_cpu_s(proc.pid) - cpu[0]) / SCRAPES
                redis_cpu = (_redis_cpu_s(store) - cpu[1]) / SCRAPES
                series = sum(1 for line in client.get("/metrics").text.splitlines()
                             if line and not line.startswith("#"))
        finally:
            os.environ.pop("FLEET_METRICS_TOKEN", None)
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
            redis.stop()
    ms = [1000 * x for x in warm]
    result = {
        "jobs": sum(counts.values()), "states": {k: v for k, v in counts.items() if v},
        "teams": len(TEAMS), "pools": len(_pools()), "scrapes": SCRAPES,
        "first_scrape_ms": round(1000 * cold, 2),
        "scrape_ms": {"median": round(statistics.median(ms), 2),
                      "p10": round(_pct(ms, 0.10), 2), "p90": round(_pct(ms, 0.90), 2),
                      "min": round(min(ms), 2), "max": round(max(ms), 2)},
        "cpu_ms_per_scrape": {"api_process": round(1000 * api_cpu, 2),
                              "redis_server": round(1000 * redis_cpu, 2)},
        "response_bytes": size, "series": series, "fill_s": round(fill_s, 1),
        "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 1), "target_ms": 100,
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {RESULT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
