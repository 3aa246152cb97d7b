"""Allocator speed: the elastic DP against scipy's HiGHS MILP on the same instances (medians).

Instances: jobs with Amdahl-like speed-up curves over GPU counts 1-32, two batch sizes per count,
three seeds per size; the DP is timed five times per instance, HiGHS once (and only up to 512
jobs: beyond, it takes minutes per instance); both must reach the same optimum. Writes
``examples/results/allocator.json``.
"""

from __future__ import annotations

import math
import random
import statistics
import time

from policies.elastic_dp import Choice, JobChoices, allocate
from policies.elastic_milp import allocate_milp
from tests.bench.results import measured, write

# GPU counts a job may take under the placement rules: 1, 2, 4 on one node, then whole 4-GPU nodes.
GPU_COUNTS = (1, 2, 4, 8, 12, 16, 24, 32)
SIZES = [(64, 128), (256, 512), (512, 1024), (1000, 2048), (2000, 4096)]
MILP_UP_TO = 512  # jobs; HiGHS beyond this takes minutes per instance
SEEDS = 3
REPEATS = 5


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


def timed(fn, repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    print("| jobs x GPUs | GPU counts x batches per job | DP ms (median) | HiGHS ms (median) "
          "| HiGHS / DP |")
    print("|---|---|---|---|---|")
    numbers: dict[str, dict] = {}
    for n_jobs, capacity in SIZES:
        dp_times, milp_times = [], []
        for seed in range(SEEDS):
            jobs = instance(n_jobs, seed)
            solve = lambda jobs=jobs, capacity=capacity: allocate(jobs, capacity)  # noqa: E731
            dp_times += timed(solve, repeat=REPEATS)
            if n_jobs <= MILP_UP_TO:
                start = time.perf_counter()
                best, _ = allocate_milp(jobs, capacity)
                milp_times.append(time.perf_counter() - start)
                got = sum(c.value for c in allocate(jobs, capacity).values() if c)
                assert math.isclose(got, best, rel_tol=1e-9), (got, best)
        size = f"{n_jobs} jobs x {capacity} GPUs"
        numbers[f"{size}: DP"] = measured(dp_times, "ms", 1e3)
        dp = statistics.median(dp_times) * 1e3
        if milp_times:
            numbers[f"{size}: HiGHS MILP"] = measured(milp_times, "ms", 1e3)
            milp = statistics.median(milp_times) * 1e3
            cells = f"{milp:.1f} | {milp / dp:.0f}x"
        else:
            cells = "- | -"
        print(f"| {n_jobs} x {capacity} | {len(GPU_COUNTS)} x 2 | {dp:.1f} | {cells} |", flush=True)
    write("allocator", {"sizes (jobs, GPUs)": SIZES, "GPU counts per job": GPU_COUNTS,
                        "batch sizes per GPU count": 2, "seeds per size": SEEDS,
                        "DP runs per instance": REPEATS, "HiGHS up to jobs": MILP_UP_TO},
          numbers)
