"""The result file of a benchmark that measures speed: ``examples/results/<name>.json``.

One shape for all of them, so ``docs/hooks/benchmarks.py`` renders each the same way: the command
that reproduces it, the date, the setup (what was measured on what), and the numbers, each
measured quantity as its median with its spread (min, max and the number of samples) and unit.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "examples" / "results"


def measured(samples: Sequence[float], unit: str, scale: float = 1.0) -> dict[str, Any]:
    """A quantity's median and spread over ``samples`` (each multiplied by ``scale``, e.g. 1e3
    for seconds shown as ms)."""
    if not samples:
        raise ValueError("measured: no samples")
    values = [v * scale for v in samples]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "unit": unit}


def single(value: float, unit: str) -> dict[str, Any]:
    """A figure measured once or derived from the samples (a count, a percentile, a ratio)."""
    return {"value": value, "unit": unit}


def write(name: str, setup: Mapping[str, Any], numbers: Mapping[str, Any],
          options: Sequence[str] = ()) -> Path:
    """Write ``examples/results/<name>.json``; ``numbers``: label -> ``measured(...)`` or
    ``single(...)``; ``options``: the command line's, so its command reproduces the run."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"command": " ".join(["python -m tests.bench", name, *options]),
           "date": datetime.now(UTC).date().isoformat(), "setup": dict(setup),
           "numbers": dict(numbers)}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return path
