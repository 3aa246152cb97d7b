"""Spot availability traces in the JSON format of SkyPilot's spot-traces (Can't Be Late, NSDI'24).

A file is ``{"metadata": {"gap_seconds": G}, "data": [v0, v1, ...]}``: one sample every G seconds;
each value is how many spot instances could be held then (1 = available, 0 = unavailable). A pool
holds ``min(nodes, value)`` nodes at time t, with the sample ``t // G``; past the last sample the
trace wraps around (starts again at v0), so any workload length runs on any trace.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from broker.errors import InvalidInput


class TraceError(InvalidInput):
    """A trace file the simulator cannot use; the message names the file and what to fix."""


@dataclass(frozen=True)
class SpotTrace:
    path: str
    gap_s: float
    values: tuple[int, ...]

    def at(self, t: float) -> int:
        """Instances available at time ``t`` seconds (wraps past the end)."""
        return self.values[int(t // self.gap_s) % len(self.values)]


def read_trace(path: Path) -> SpotTrace:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise TraceError(f"trace file {path} is not readable JSON: {e}") from None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    if isinstance(gap, bool) or not isinstance(gap, int | float) or not (
            math.isfinite(gap) and gap > 0):
        raise TraceError(f"trace file {path}: needs metadata.gap_seconds > 0, as in "
                         '{"metadata": {"gap_seconds": 300}, "data": [1, 0, ...]}')
    data = doc.get("data")
    if not isinstance(data, list) or not data:
        raise TraceError(f"trace file {path}: needs a non-empty list 'data' of instance counts")
    for i, v in enumerate(data):
        # json reads Infinity and NaN as floats; int() of them raises, so test finiteness first
        if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                or v < 0 or v != int(v)):
            raise TraceError(f"trace file {path}: data[{i}] = {v!r} is not a count >= 0")
    return SpotTrace(str(path), float(gap), tuple(int(v) for v in data))
