"""How fast the API refuses hostile requests (issue 13's bound: every one a 4xx in under 100 ms),
alone and under attack, against a real API on loopback over a real redis-server.

The hostile requests are the chaos suite's (``tests/chaos/hostile.py``: anchor bombs, alias
floods, oversized fields, deep nesting, out-of-range stream ids), with the production body
limit. Alone: each case sent 20 times in turn from one client. Under attack: two processes send
the cases round and round for 15 s while one client sends each case 10 times more and polls
``/healthz`` between them. Percentiles are over all answers of a phase. Writes
``examples/results/hostile.json``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from broker.api import build_app
from broker.auth import ApiConfig
from broker.store import Store
from tests.api_server import TOKENS, ApiServer, api_config
from tests.bench.results import measured, single, write
from tests.chaos.hostile import CASES, Case, attack, send, timed
from tests.redis_server import RedisServer

ALONE = 20  # answers per case, alone
UNDER_ATTACK = 10  # answers per case while the attackers run
ATTACK_S = 15.0
ATTACKERS = 2


def _answers(c: httpx.Client, repeats: int, healthz: list[float] | None = None,
             ) -> tuple[dict[str, list[float]], list[str]]:
    """Seconds per answer of each case, and what was not the 4xx it should be."""
    took: dict[str, list[float]] = {case.name: [] for case in CASES}
    wrong = []
    for _ in range(repeats):
        for case in CASES:
            s, r = timed(lambda case=case: send(c, case, TOKENS))  # type: ignore[misc]
            took[case.name].append(s)
            if r.status_code != case.status:
                wrong.append(f"{case.name}: {r.status_code}")
            if healthz is not None:
                healthz.append(timed(lambda: c.get("/healthz"))[0])
    return took, wrong


def _percentiles(label: str, samples: list[float]) -> dict[str, dict]:
    return {f"{label}: latency": measured(samples, "ms", 1e3),
            f"{label}: latency p95": single(float(np.percentile(samples, 95)) * 1e3, "ms"),
            f"{label}: latency p99": single(float(np.percentile(samples, 99)) * 1e3, "ms")}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        srv = None
        try:
            store = Store.from_url(redis.url)
            config = api_config().model_copy(
                update={"max_body_bytes": ApiConfig().max_body_bytes})
            srv = ApiServer(build_app(store, config)).start()
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                send(c, Case("warm-up", "ml", "GET", "/v1/jobs"), TOKENS)
                alone, wrong = _answers(c, ALONE)
                healthz: list[float] = []
                with ProcessPoolExecutor(ATTACKERS) as pool:
                    started = time.monotonic()
                    futures = [pool.submit(attack, srv.url, dict(TOKENS), k, ATTACKERS, ATTACK_S)
                               for k in range(ATTACKERS)]
                    under: dict[str, list[float]] = {case.name: [] for case in CASES}
                    while time.monotonic() - started < ATTACK_S - 2:
                        got, bad = _answers(c, 1, healthz)
                        wrong += bad
                        for name, s in got.items():
                            under[name] += s
                        if min(len(v) for v in under.values()) >= UNDER_ATTACK:
                            break
                    attacked = [a for f in futures for a in f.result()]
            expected = {case.name: case.status for case in CASES}
            wrong += [f"{name}: {status}" for name, status, _ in attacked
                      if status != expected[name]]
            stored = store.r.dbsize()
        finally:
            if srv is not None:
                srv.stop()
            redis.stop()
    alone_all = [s for v in alone.values() for s in v]
    under_all = [s for v in under.values() for s in v] + [s for _, _, s in attacked]
    numbers = {**_percentiles("alone, every case", alone_all),
               **_percentiles("under attack, every case", under_all),
               **_percentiles("under attack, /healthz", healthz),
               "answers that were not the case's 4xx": single(len(wrong), "answers"),
               "keys left in Redis": single(stored, "keys")}
    worst = max(alone, key=lambda k: statistics.median(alone[k]))
    numbers[f"slowest case alone ({worst}): latency"] = measured(alone[worst], "ms", 1e3)
    print("| measurement | median | p95 | p99 | max |")
    print("|---|---|---|---|---|")
    for label, samples in (("alone", alone_all), ("under attack", under_all),
                           ("/healthz under attack", healthz)):
        p95, p99 = np.percentile(samples, [95, 99]) * 1e3
        print(f"| {label} ({len(samples)} answers) | {statistics.median(samples) * 1e3:.1f} ms "
              f"| {p95:.1f} ms | {p99:.1f} ms | {max(samples) * 1e3:.1f} ms |")
    print(f"slowest case alone: {worst}, median {statistics.median(alone[worst]) * 1e3:.1f} ms; "
          f"answers not the expected 4xx: {len(wrong)}; keys left in Redis: {stored}")
    write("hostile", {"server": "uvicorn on loopback, redis-server with AOF everysec",
                      "cases": len(CASES), "answers per case alone": ALONE,
                      "attackers": ATTACKERS, "attack seconds": ATTACK_S}, numbers)


if __name__ == "__main__":
    main()
