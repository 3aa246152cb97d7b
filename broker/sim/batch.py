"""Runs one classic simulation per workload file, optionally in parallel processes."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from broker.sim.engine import SimConfig, SimResult
from broker.sim.rounds import SimPool, simulate
from broker.sim.workload import read_workload


def run_file(path: Path, pools: Sequence[SimPool], cfg: SimConfig) -> SimResult:
    return simulate(read_workload(path), pools, cfg)


def run_files(paths: Sequence[Path], pools: Sequence[SimPool], cfg: SimConfig,
              workers: int = 1) -> list[tuple[str, SimResult]]:
    """(file name, result) per workload, in the order given."""
    names = [str(p) for p in paths]
    if workers <= 1 or len(paths) <= 1:
        return [(n, run_file(p, pools, cfg)) for n, p in zip(names, paths, strict=True)]
    with ProcessPoolExecutor(min(workers, len(paths))) as pool:
        futures = [pool.submit(run_file, p, pools, cfg) for p in paths]
        return [(n, f.result()) for n, f in zip(names, futures, strict=True)]
