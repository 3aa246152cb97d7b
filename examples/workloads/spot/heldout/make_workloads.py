"""Writes the held-out workloads of ``tests/bench/bench_spot_heldout.py`` into this folder.

The deadline rule of ``../make_workload.py`` (``deadline_rows``: a factor times each job's isolated
run time plus one restart, cycling over three factors) at factors the policy was not tuned on, on
workloads it was not tuned on (Pollux's workloads 5-8; the tuning side is 1-4 at 1.5, 2 and 3),
and the issue's probe workloads: Pollux's first two 0.5x-load workloads (other jobs than the
full-load ones) with a 24 h deadline on every job.

- ``pollux-w5-tight.csv``, ``pollux-w6-tight.csv``: factors ``TIGHT``.
- ``pollux-w7-loose.csv``, ``pollux-w8-loose.csv``: factors ``LOOSE``.
- ``pollux-0.5-w1-24h.csv``, ``pollux-0.5-w2-24h.csv``: 86,400 s each.

Deterministic. Run from the repository root:
``python -m examples.workloads.spot.heldout.make_workloads``.
"""

from __future__ import annotations

from pathlib import Path

from examples.workloads.spot.make_workload import deadline_rows, write_rows

ROOT = Path(__file__).resolve().parents[4]
POLLUX = ROOT / "examples" / "workloads" / "pollux-osdi21"
HERE = Path(__file__).resolve().parent
TIGHT = (1.25, 1.5, 2.0)
LOOSE = (2.0, 3.0, 5.0)
DAY_S = 24 * 3600.0


def workloads() -> dict[Path, list[list]]:
    """Every held-out workload file's rows, by path."""
    out = {HERE / f"pollux-w{n}-{kind}.csv":
           deadline_rows(POLLUX / "workloads" / f"workload-{n}.csv", factors)
           for n, kind, factors in ((5, "tight", TIGHT), (6, "tight", TIGHT),
                                    (7, "loose", LOOSE), (8, "loose", LOOSE))}
    for n in (1, 2):
        out[HERE / f"pollux-0.5-w{n}-24h.csv"] = deadline_rows(
            POLLUX / "workloads-0.5" / f"workload-{n}.csv", fixed_s=DAY_S)
    return out


def main() -> None:
    for path, rows in workloads().items():
        write_rows(path, rows)

if __name__ == "__main__":
    main()
