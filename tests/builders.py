"""Builders the tests share, so that a test names only what matters to it and the rest stays at
plain defaults.

``spec()`` is a job spec in one line: one GPU, global batch 32-256, 10,000 samples of work,
``python train.py``. ``gpus`` and ``batch`` take a count (exactly that) or a ``(min, max)`` range;
any other ``JobSpec`` field goes by name (``spot=SpotPolicy.NEVER``, ``deadline_s=600``). A test
file whose jobs share other defaults binds them once with ``functools.partial``. ``record()`` is a
queued job's record and ``planned()`` one round over records and pools, pure (no Redis): what
planning decides is tested on it (``Planned.jobs`` are the records as the round leaves them, the
next round's input), and Redis-backed tests are kept for what needs the store.
``fleet()`` runs the CLI in this process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from typer.testing import CliRunner

from broker.cli import app
from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.scheduler import SchedulerConfig, plan_round
from broker.store import Snapshot
from policies.migration import Blocklist
from policies.models import BatchRange, GpuRange, JobSpec, Pool

NOW = 1_000_000.0  # the clock of a pure round


def _range(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else value


def spec(name: str = "train", *, run: str = "python train.py",
         gpus: int | tuple[int, int] = 1, batch: int | tuple[int, int] = (32, 256),
         samples: int = 10_000, **fields: Any) -> JobSpec:
    """A job spec named ``name``; see the module's docstring for the defaults."""
    (gmin, gmax), (bmin, bmax) = _range(gpus), _range(batch)
    return JobSpec(name=name, run=run, gpus=GpuRange(min=gmin, max=gmax),
                   batch_size=BatchRange(min=bmin, max=bmax), work_samples=samples, **fields)


def record(name: str, job_spec: JobSpec, **fields: Any) -> JobRecord:
    """A job's record, queued and submitted 10 s before ``NOW`` unless ``fields`` (any
    ``JobRecord`` field, by name) say otherwise."""
    return JobRecord(**{"id": f"{name}-1", "spec": job_spec, "team": "t",
                        "state": JobState.QUEUED, "submitted_at": NOW - 10, **fields})


@dataclass
class Planned:
    """What one round decided, per job: every intent it adds, the state it moves the job to,
    the reason it writes, the events it records, and the record as the round leaves it (every
    job's: the next round's input)."""

    intents: dict[str, list[Intent]]
    states: dict[str, JobState]
    reasons: dict[str, str | None]
    events: dict[str, list[str]]
    jobs: dict[str, JobRecord]

    @property
    def launches(self) -> dict[str, tuple[str, int]]:
        """Each launched job's pool and GPUs (CPU nodes in a CPU pool)."""
        return {i.job_id: (i.pool or "", i.gpus) for added in self.intents.values()
                for i in added if i.kind is IntentKind.LAUNCH}


def planned(jobs: list[JobRecord], pools: list[Pool], config: SchedulerConfig | None = None,
            now: float = NOW, blocklist: Blocklist | None = None) -> Planned:
    """One round over ``jobs`` and ``pools`` (no intents pending), as the leader plans it, with
    the pools ``blocklist`` marks."""
    plan = plan_round(Snapshot(jobs, pools, []), 1, config or SchedulerConfig(), now,
                      blocklist=blocklist).plan
    intents: dict[str, list[Intent]] = {}
    for raw in plan.intents_add:
        intent = Intent.model_validate_json(raw["json"])
        intents.setdefault(intent.job_id, []).append(intent)
    events: dict[str, list[str]] = {}
    for e in plan.events:
        events.setdefault(e["job"], []).append(e["type"])
    states = {s["job"]: JobState(s["state"]) for s in plan.sets if "state" in s}
    after = {j.id: j.model_copy(update={**plan.updates[j.id], "version": j.version + 1,
                                        "state": states.get(j.id, j.state)})
             if j.id in plan.updates else j for j in jobs}
    return Planned(intents, states,
                   {s["job"]: json.loads(s["fields"]["reason"]) for s in plan.sets}, events,
                   after)


def fleet(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """The ``fleet`` CLI in this process with ``env``: (exit code, stdout, stderr); an error
    that is not the CLI's own exit is raised."""
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr
