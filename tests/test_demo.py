"""The demo flow end to end, as `make demo` runs it: real PyTorch jobs under the runtime agent on
the three-region local fleet, with the HTTP API taking heartbeats, a real redis-server and broker.
"""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console

from broker.demo import DEMO_FLEET, DemoConfig, run_demo
from broker.store import Store


def test_demo_flow(tmp_path: Path) -> None:
    console = Console(record=True, width=120)
    logs: dict[str, list[str]] = {}
    preempted: set[str] = set()

    def inspect(store: Store) -> None:  # before the stack stops: read the jobs' logs
        for job in store.list_jobs():
            logs[job.id] = store.read_logs(job.id, limit=10_000)[0]
            if job.preemptions:
                preempted.add(job.id)

    summary = run_demo(DemoConfig(fleet=DEMO_FLEET, state_dir=tmp_path / "state",
                                  live=False, timeout_s=240), console, on_done=inspect)
    assert summary.finished == summary.jobs == 4, console.export_text()
    # The newcomer ran beside the others (whether they shrank for it depends on when they finish
    # on a loaded machine; shrinking for a newcomer is tested in tests/test_scheduler.py).
    after = next(p for p in summary.phases if p.startswith("GPUs after:"))
    assert "digits-d" in after, console.export_text()
    assert summary.preemptions >= 1 and summary.migrations >= 1  # the reclaimed region's jobs
    assert 0 < summary.cost < summary.on_demand_cost
    # No Python warning in what a user reads (`fleet logs`): the agent's and runtime's own
    # calls use no deprecated API, and the training script's output is not buried under any.
    warned = [line for lines in logs.values() for line in lines
              if re.search(r"\b\w+Warning: ", line)]
    assert len(logs) == 4 and not warned, warned
    # A preempted job resumed from its checkpoint, not from step 0.
    assert preempted
    for lines in (logs[j] for j in preempted):
        starts = [int(m.group(1)) for line in lines
                  if (m := re.search(r"rank 0/\d+: .*?, step (\d+),", line))]
        assert len(starts) >= 2 and max(starts[1:]) > 0, lines[-20:]
