"""Control-plane speed against a real redis-server (AOF everysec): submissions per second into
the store, and one scheduling round (snapshot, fitted job models, type choice, allocation,
placement, atomic plan write) with 10,000 jobs across 20 pools, three times from a fresh store,
and the next round of the same broker. Writes ``examples/results/scheduler.json``."""

from __future__ import annotations

import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from broker.scheduler import SchedulerConfig, plan_round
from broker.scheduler.round import paused_gc
from broker.store import Store
from policies.models import Accelerator, BatchRange, GpuRange, JobSpec, Market, Pool
from providers import registry
from tests.bench.results import measured, write
from tests.redis_server import RedisServer

N_JOBS = 10_000
CLOUDS = registry.names()


def pools(seed: int = 0) -> list[Pool]:
    """20 pools: 4 clouds x 5 regions, T4 and A100, spot and on-demand, 64-256 GPUs each."""
    rng = random.Random(seed)
    out = []
    for i in range(20):
        cloud = CLOUDS[i % len(CLOUDS)]
        out.append(Pool(cloud=cloud, region=f"region-{i}", accelerator=(
            Accelerator.T4 if i % 2 else Accelerator.A100),
            market=Market.SPOT if i % 3 else Market.ON_DEMAND, nodes=rng.randint(8, 32),
            gpus_per_node=8, price_per_gpu_hour=round(rng.uniform(0.2, 3.0), 2)))
    return out


TYPES = ([Accelerator.T4], [Accelerator.A100], [Accelerator.A100, Accelerator.T4])
MODELS = (None, "cifar10", "imagenet", "bert")


def spec(i: int, rng: random.Random) -> JobSpec:
    """A third of the jobs accept either type (the round chooses); three in four name a
    measured model (their prior is its table), the others start from the generic prior."""
    return JobSpec(name=f"job{i}", run="python train.py", accelerators=rng.choice(TYPES),
                   gpus=GpuRange(min=1, max=rng.choice([1, 2, 4, 8])),
                   batch_size=BatchRange(min=32, max=rng.choice([256, 1024, 4096])),
                   work_samples=10**6, model=rng.choice(MODELS))


def bench_submit(url: str, n: int, threads: int) -> float:
    """Submissions per second with ``threads`` clients, each with its own connection."""
    rng = random.Random(1)
    specs = [spec(i, rng) for i in range(n)]
    per = n // threads

    def worker(k: int) -> None:
        own = Store.from_url(url)
        for s in specs[k * per:(k + 1) * per]:
            own.submit(s, team="bench")

    start = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return per * threads / (time.perf_counter() - start)


def fresh(store: Store, url: str) -> None:
    """An empty store with 10,000 queued jobs and the 20 pools."""
    store.r.flushall()
    bench_submit(url, N_JOBS, 4)
    store.set_pools(pools())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        try:
            url = server.url
            store = Store.from_url(url)
            print("| measurement | value |")
            print("|---|---|")
            numbers = {}
            for threads in (1, 4):
                rate = bench_submit(url, 2000, threads)
                numbers[f"submissions into the store, {threads} client thread(s)"] = measured(
                    [rate], "submissions/s")
                print(f"| submissions/s into the store, {threads} client thread(s) | "
                      f"{rate:,.0f} |", flush=True)
                store.r.flushall()
            capacity = sum(p.capacity for p in pools())
            snaps, plans, applies, totals, warm = [], [], [], [], []
            launches = 0
            for _ in range(3):
                fresh(store, url)  # every repetition schedules 10,000 queued jobs
                cold = Store.from_url(url)  # a broker that just started: nothing cached
                fence = cold.acquire_lease("bench", ttl_s=600)
                # the collector held off, as Scheduler.run_round does
                with paused_gc():
                    t0 = time.perf_counter()
                    snap = cold.snapshot()
                    t1 = time.perf_counter()
                    res = plan_round(snap, fence, SchedulerConfig())
                    t2 = time.perf_counter()
                    cold.apply(res.plan, fence=fence)
                    t3 = time.perf_counter()
                snaps.append(t1 - t0)
                plans.append(t2 - t1)
                applies.append(t3 - t2)
                totals.append(t3 - t0)
                launches = max(launches, res.launches)
                # The next round of the same broker: records it has parsed before are cached.
                with paused_gc():
                    t4 = time.perf_counter()
                    res2 = plan_round(cold.snapshot(), fence, SchedulerConfig())
                    if not res2.plan.empty():
                        cold.apply(res2.plan, fence=fence)
                    warm.append(time.perf_counter() - t4)
            med = statistics.median
            head = f"{N_JOBS:,} queued jobs, 20 pools, {capacity:,} GPUs"
            print(f"| first round ({head}): snapshot | {med(snaps) * 1e3:.0f} ms |")
            print(f"| first round: allocation + placement + diff | {med(plans) * 1e3:.0f} ms |")
            print(f"| first round: atomic plan write ({launches:,} launches) | "
                  f"{med(applies) * 1e3:.0f} ms |")
            print(f"| first round: total (median of 3) | {med(totals) * 1e3:.0f} ms |")
            print(f"| next round of the same broker: total (median of 3) | "
                  f"{med(warm) * 1e3:.0f} ms |")
            numbers.update({
                "first round: snapshot": measured(snaps, "ms", 1e3),
                "first round: allocation + placement + diff": measured(plans, "ms", 1e3),
                "first round: atomic plan write": measured(applies, "ms", 1e3),
                "first round: total": measured(totals, "ms", 1e3),
                "next round of the same broker: total": measured(warm, "ms", 1e3)})
            write("scheduler", {"server": "redis-server, AOF everysec", "queued jobs": N_JOBS,
                                "pools": 20, "GPUs": capacity, "launches planned": launches,
                                "submissions per rate": 2000}, numbers)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
