"""Summaries of simulation runs: JCT means and tails, makespan, GPU-hours, rescales, drops.

Average JCT over several workloads is the mean of the per-workload means (Pollux/Sia convention);
the p99 pools every completed job; makespan is the mean over workloads of the last completion.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from broker.sim.engine import SimRecord, SimResult
from broker.sim.rounds import SpotResult


def _hours(x: float) -> float:
    return round(x / 3600.0, 4)


def workload_summary(name: str, result: SimResult) -> dict[str, Any]:
    recs = result.records
    jcts = np.array([r.jct for r in recs if r.jct is not None])
    done = len(jcts)
    last = max((r.completed for r in recs if r.completed is not None), default=0.0)
    return {
        "workload": name,
        "jobs": len(recs),
        "completed": done,
        "dropped": sum(r.dropped for r in recs),
        "unfinished": result.unfinished,
        "avg_jct_h": _hours(float(jcts.mean())) if done else None,
        "p99_jct_h": _hours(float(np.percentile(jcts, 99))) if done else None,
        "makespan_h": _hours(last),
        "gpu_hours_per_job": _hours(sum(r.gpu_seconds for r in recs) / done) if done else None,
        "rescales": sum(r.restarts for r in recs),
        "solve_ms_median": round(float(np.median(result.solve_seconds)) * 1e3, 3)
        if result.solve_seconds else 0.0,
    }


def summary(results: Sequence[tuple[str, SimResult]], settings: dict[str, Any]) -> dict[str, Any]:
    per = [workload_summary(name, r) for name, r in results]
    means = [p["avg_jct_h"] for p in per if p["avg_jct_h"] is not None]
    jcts = [r.jct for _, res in results for r in res.records if r.jct is not None]
    done = sum(p["completed"] for p in per)
    gpu_s = sum(r.gpu_seconds for _, res in results for r in res.records)
    return {
        **settings,
        "workloads": len(per),
        "jobs": sum(p["jobs"] for p in per),
        "completed": done,
        "dropped": sum(p["dropped"] for p in per),
        "unfinished": sum(p["unfinished"] for p in per),
        "avg_jct_h": round(float(np.mean(means)), 4) if means else None,
        "p99_jct_h": _hours(float(np.percentile(jcts, 99))) if jcts else None,
        "makespan_h": round(float(np.mean([p["makespan_h"] for p in per])), 4),
        "gpu_hours_per_job": _hours(gpu_s / done) if done else None,
        "rescales": sum(p["rescales"] for p in per),
        "per_workload": per,
    }


def spot_fields(results: Sequence[SpotResult]) -> dict[str, Any]:
    """Cost and spot counters summed over workloads; ``saving_pct`` is against
    ``ondemand_cost_usd`` (the same GPU time at on-demand prices)."""
    cost = sum(r.cost_usd for r in results)
    ondemand = sum(r.ondemand_cost_usd for r in results)
    return {
        "cost_usd": round(cost, 2),
        "ondemand_cost_usd": round(ondemand, 2),
        "saving_pct": round(100 * (1 - cost / ondemand), 1) if ondemand else 0.0,
        "deadline_misses": sum(r.deadline_misses for r in results),
        "migrations": sum(r.migrations for r in results),
        "preemptions": sum(r.preemptions for r in results),
        "lost_work_gpu_h": round(sum(r.lost_work_gpu_h for r in results), 3),
        "spot_gpu_h": round(sum(r.spot_gpu_h for r in results), 3),
        "ondemand_gpu_h": round(sum(r.ondemand_gpu_h for r in results), 3),
    }


def spot_summary(results: Sequence[tuple[str, SpotResult]],
                 settings: dict[str, Any]) -> dict[str, Any]:
    """``summary`` plus the spot fields, overall and per workload."""
    out = summary([(name, r.result) for name, r in results], settings)
    out.update(spot_fields([r for _, r in results]))
    for per, (_, r) in zip(out["per_workload"], results, strict=True):
        per.update(spot_fields([r]))
    return out


def write_jobs(path: Path, results: Sequence[tuple[str, SimResult]]) -> None:
    """One CSV row per job of every workload."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workload", "name", "application", "submitted_s", "completed_s", "jct_s",
                    "dropped", "restarts", "gpu_hours"])
        for name, res in results:
            for r in res.records:
                w.writerow(_row(name, r))


def _row(workload: str, r: SimRecord) -> list[Any]:
    return [workload, r.name, r.application, r.submitted,
            "" if r.completed is None else round(r.completed, 3),
            "" if r.jct is None else round(r.jct, 3), int(r.dropped), r.restarts,
            round(r.gpu_seconds / 3600, 4)]
