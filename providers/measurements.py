"""Reads the vendored Sia/Pollux measurement CSVs into the pure tables of ``policies``.

Files: ``providers/data/sia-sosp23/traces/<model>/{placements,scalability}-<suffix>.csv`` and
``validation-<global batch>.csv`` (see that folder's SOURCE.md).
"""

from __future__ import annotations

import csv
from functools import cache
from pathlib import Path

import numpy as np

from broker.errors import InvalidInput
from policies.apps import ACCELERATOR_TRACES, APP_SPECS, MAX_LOCAL_BSZ_OVERRIDES, Application
from policies.goodput import Efficiency, EfficiencyModel, ValidationTable
from policies.models import Accelerator
from policies.trace_throughput import StepTable, ThroughputModel, canonical

TRACES_DIR = Path(__file__).parent / "data" / "sia-sosp23" / "traces"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def load_step_table(model: str, accelerator: Accelerator, root: Path = TRACES_DIR) -> StepTable:
    suffix, per_node = ACCELERATOR_TRACES[accelerator]
    folder = root / model
    by_placement: dict[tuple[int, ...], list[tuple[float, float, float]]] = {}
    for r in _rows(folder / f"placements-{suffix}.csv"):
        p = canonical(tuple(int(ch) for ch in r["placement"]))
        by_placement.setdefault(p, []).append(
            (float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"]))
        )
    placements = {p: np.array(sorted(v)) for p, v in by_placement.items()}
    scal = np.array(
        [
            (float(r["num_nodes"]), float(r["num_replicas"]), float(r["local_bsz"]),
             float(r["step_time"]), float(r["sync_time"]))
            for r in _rows(folder / f"scalability-{suffix}.csv")
        ]
    )
    return StepTable(model, accelerator, per_node, placements, scal,
                     MAX_LOCAL_BSZ_OVERRIDES.get((model, accelerator)))


def load_validation(model: str, root: Path = TRACES_DIR) -> ValidationTable:
    runs = sorted(
        (int(p.stem.split("-")[-1]), _rows(p)) for p in (root / model).glob("validation-*.csv")
    )
    if not runs:
        raise FileNotFoundError(f"no validation-*.csv for model {model!r} under {root}")
    epochs = min(len(rows) for _, rows in runs)

    def col(name: str) -> np.ndarray:
        return np.array([[float(r[name]) for r in rows[:epochs]] for _, rows in runs])

    return ValidationTable(model, np.array([b for b, _ in runs]), col("progress"),
                           col("grad_sqr"), col("grad_var"))


@cache
def load_application(model: str, efficiency: EfficiencyModel = EfficiencyModel.GNS) -> Application:
    """The model with throughput tables for every accelerator type that has measurements."""
    if model not in APP_SPECS:
        raise InvalidInput(f"unknown application {model!r}; known: "
                           f"{', '.join(sorted(APP_SPECS))}")
    spec = APP_SPECS[model]
    app = Application(spec, Efficiency(load_validation(model), spec.max_epochs, efficiency))
    for acc, (suffix, _) in ACCELERATOR_TRACES.items():
        if (TRACES_DIR / model / f"placements-{suffix}.csv").exists():
            app.throughput[acc] = ThroughputModel(load_step_table(model, acc))
    return app
