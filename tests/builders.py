"""Builders the tests share, so that a test names only what matters to it and the rest stays at
plain defaults.

``spec()`` is a job spec in one line: one GPU, global batch 32-256, 10,000 samples of work,
``python train.py``. ``gpus`` and ``batch`` take a count (exactly that) or a ``(min, max)`` range;
any other ``JobSpec`` field goes by name (``spot=SpotPolicy.NEVER``, ``deadline_s=600``). A test
file whose jobs share other defaults binds them once with ``functools.partial``. ``fleet()`` runs
the CLI in this process.
"""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from broker.cli import app
from policies.models import BatchRange, GpuRange, JobSpec


def _range(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else value


def spec(name: str = "train", *, run: str = "python train.py",
         gpus: int | tuple[int, int] = 1, batch: int | tuple[int, int] = (32, 256),
         samples: int = 10_000, **fields: Any) -> JobSpec:
    """A job spec named ``name``; see the module's docstring for the defaults."""
    (gmin, gmax), (bmin, bmax) = _range(gpus), _range(batch)
    return JobSpec(name=name, run=run, gpus=GpuRange(min=gmin, max=gmax),
                   batch_size=BatchRange(min=bmin, max=bmax), work_samples=samples, **fields)


def fleet(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """The ``fleet`` CLI in this process with ``env``: (exit code, stdout, stderr); an error
    that is not the CLI's own exit is raised."""
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr
