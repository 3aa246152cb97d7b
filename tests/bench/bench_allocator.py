"""Allocator speed: the elastic DP against scipy's HiGHS MILP on the same instances (medians)."""

from __future__ import annotations

import math
import random
import statistics
import time

from policies.elastic_dp import Choice, JobChoices, allocate
from policies.elastic_milp import allocate_milp

# GPU counts a job may take under the placement rules: 1, 2, 4 on one node, then whole 4-GPU nodes.
GPU_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32)
SIZES = [(64, 128), (256, 512), (512, 1024), (1000, 2048), (2000, 4096)]
MILP_UP_TO = 512  # jobs; HiGHS beyond this takes minutes per instance


def instance(n_jobs: int, seed: int) -> list[JobChoices]:
    """Sub-linear speed-up curves (Amdahl-like with communication cost), several batch sizes."""
    rng = random.Random(seed)
    jobs = []
    for j in range(n_jobs):
        serial, comm = rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.03)
        choices = []
        for g in GPU_COUNTS:
            for batch in (64 * g, 128 * g):
                speedup = 1 / (serial + (1 - serial) / g + comm * math.log2(g))
                choices.append(Choice(g, batch, speedup * rng.uniform(0.97, 1.0)))
        jobs.append(JobChoices(f"job-{j}", choices))
    return jobs


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    print("| jobs x GPUs | GPU counts x batches per job | DP ms (median) | HiGHS ms (median) "
          "| HiGHS / DP |")
    print("|---|---|---|---|---|")
    for n_jobs, capacity in SIZES:
        dp_times, milp_times = [], []
        for seed in range(3):
            jobs = instance(n_jobs, seed)
            solve = lambda jobs=jobs, capacity=capacity: allocate(jobs, capacity)  # noqa: E731
            dp_times.append(timed(solve, repeat=5))
            if n_jobs <= MILP_UP_TO:
                start = time.perf_counter()
                best, _ = allocate_milp(jobs, capacity)
                milp_times.append(time.perf_counter() - start)
                got = sum(c.value for c in allocate(jobs, capacity).values() if c)
                assert math.isclose(got, best, rel_tol=1e-9), (got, best)
        dp = statistics.median(dp_times) * 1e3
        if milp_times:
            milp = statistics.median(milp_times) * 1e3
            cells = f"{milp:.1f} | {milp / dp:.0f}x"
        else:
            cells = "- | -"
        print(f"| {n_jobs} x {capacity} | {len(GPU_COUNTS)} x 2 | {dp:.1f} | {cells} |", flush=True)
