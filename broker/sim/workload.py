"""Reads workload traces in the public format ``name,time,application,num_replicas,batch_size``.

An optional ``deadline`` column gives each job a deadline in seconds after its submission (an
empty cell: no deadline); only the spot simulation acts on it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from broker.errors import InvalidInput
from policies.apps import APP_SPECS

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


class WorkloadError(InvalidInput):
    """A malformed workload file; the message names the file, line and column."""


@dataclass(frozen=True)
class WorkloadJob:
    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int
    deadline: float | None = None  # seconds after submission


def read_workload(path: Path) -> list[WorkloadJob]:
    try:
        text = path.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read workload {path}: {e.strerror}") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        raise WorkloadError(f"{path}: empty file; expected a header {','.join(COLUMNS)}")
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise WorkloadError(f"{path} line 1: missing column(s) {', '.join(missing)}; "
                            f"expected a header {','.join(COLUMNS)}")
    idx = {c: header.index(c) for c in COLUMNS}
    jobs: list[WorkloadJob] = []
    seen: set[str] = set()
    for line, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise WorkloadError(f"{path} line {line}: {len(row)} fields, expected {len(header)}")
        cell = {c: row[i].strip() for c, i in idx.items()}

        def number(col: str, kind: type, minimum: float, line: int = line,
                   cell: dict = cell) -> float:
            try:
                val = kind(cell[col])
            except ValueError:
                raise WorkloadError(f"{path} line {line}, column {col!r}: {cell[col]!r} is not "
                                    f"{'an integer' if kind is int else 'a number'}") from None
            if not val >= minimum:
                raise WorkloadError(f"{path} line {line}, column {col!r}: {val} must be "
                                    f">= {minimum}")
            return val

        name = cell["name"]
        if not name:
            raise WorkloadError(f"{path} line {line}, column 'name': empty job name")
        if name in seen:
            raise WorkloadError(f"{path} line {line}, column 'name': duplicate job {name!r}")
        seen.add(name)
        app = cell["application"]
        if app not in APP_SPECS:
            raise WorkloadError(f"{path} line {line}, column 'application': unknown application "
                                f"{app!r}; known: {', '.join(sorted(APP_SPECS))}")
        deadline = None
        if "deadline" in header and row[header.index("deadline")].strip():
            cell["deadline"] = row[header.index("deadline")].strip()
            deadline = number("deadline", float, 0)
            if not 0 < deadline < float("inf"):
                raise WorkloadError(f"{path} line {line}, column 'deadline': {deadline} must be "
                                    "a positive number of seconds after submission")
        jobs.append(WorkloadJob(name, number("time", float, 0), app,
                                int(number("num_replicas", int, 1)),
                                int(number("batch_size", int, 1)), deadline))
    if not jobs:
        raise WorkloadError(f"{path}: no jobs after the header")
    return jobs
