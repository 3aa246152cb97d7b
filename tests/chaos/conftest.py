"""The fault-and-attack suite's one summary: each case records, through the ``chaos`` fixture,
the faults it injected and what it found (jobs lost, duplicate launches, acknowledged
submissions lost, 5xx answers, broker secrets a job could see, the worst API latency under
attack); the session prints the totals, each with the number of cases that checked it
(``tests/conftest.py``, which also gathers the tallies of pytest-xdist's workers).
``duplicate_launches`` counts them from the local provider's spawn log."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

COUNTS = ("jobs_lost", "duplicate_launches", "acked_lost", "server_errors", "secrets_seen")


@dataclass
class Tally:
    faults: int = 0
    found: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    worst_latency_s: float | None = None

    def record(self, *, faults: int = 0, latency_s: float | None = None, **found: int) -> None:
        """``faults`` injected; ``found``: what the case checked, each count (0 when clean);
        ``latency_s``: the slowest answer it saw under attack."""
        self.faults += faults
        for name, n in found.items():
            if name not in self.found:
                raise ValueError(f"unknown chaos count {name!r}; one of {COUNTS}")
            self.found[name] += n
            self.checked[name] += 1
        if latency_s is not None:
            self.worst_latency_s = max(self.worst_latency_s or 0.0, latency_s)

    def merge(self, other: Tally) -> None:
        """Add ``other``'s cases (a pytest-xdist worker's) to these."""
        self.faults += other.faults
        for name in COUNTS:
            self.found[name] += other.found[name]
            self.checked[name] += other.checked[name]
        if other.worst_latency_s is not None:
            self.worst_latency_s = max(self.worst_latency_s or 0.0, other.worst_latency_s)


TALLY = Tally()  # this process's cases; tests/conftest.py prints the session's


def duplicate_launches(state_dir: Path) -> int:
    """Spawns beyond the first of one node of one job attempt, from the local provider's audit
    log (``STATE/provider/launches.log``: one line per real spawn, ``KEY NODE_DIR TIME``). A
    node is its job, attempt, rank and stand-in round; the leader's fence is left out, so a new
    leader that launched an attempt again counts too."""
    log = state_dir / "provider" / "launches.log"
    lines = log.read_text().splitlines() if log.exists() else []
    nodes = []
    for line in lines:
        key, node_dir, _ = line.split()
        launch, _, stand_in = key.partition("~")
        job, _fence, attempt = launch.rsplit(":", 2)
        rank = node_dir.removeprefix(key.replace(":", "_").replace("/", "_"))
        nodes.append((job, attempt, stand_in, rank))
    return sum(n - 1 for n in Counter(nodes).values())


@pytest.fixture
def chaos() -> Tally:
    return TALLY
