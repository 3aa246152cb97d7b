"""Fixed mode keeps the maths across resizes; elastic mode still trains digits to accuracy."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.jobs import DIGITS, agent_command, job_env, load_module, max_abs_diff, run_job

STEPS = 60
FLAGS = ["--steps", str(STEPS), "--batch-size", "24", "--max-micro-batch", "8", "--lr", "0.05"]
ELASTIC = ["--steps", "200", "--batch-size", "24", "--lr", "0.05"]


def interrupted(tmp: Path, before: int, after: int, mode: str = "fixed", flags: list[str] = FLAGS,
                **fleet: dict) -> Path:
    """Run with ``before`` workers, SIGTERM at a random step, finish with ``after`` workers."""
    ckpt, final = tmp / f"ckpt-{before}-{after}", tmp / f"final-{before}-{after}.pt"
    stop = random.randint(3, STEPS // 4)
    first = run_job(agent_command(*flags, "--batch-mode", mode, "--checkpoint-dir", str(ckpt)),
                    job_env(tmp, nproc=before, **fleet.get("first", {})), tmp, stop_at_step=stop)
    assert first.code == 75, first.output
    manifests = sorted(ckpt.glob("step-*/MANIFEST.json"))
    assert manifests, first.output
    saved = json.loads(manifests[-1].read_text())
    assert stop <= saved["step"] < STEPS and saved["world_size"] == before, saved
    second = run_job(agent_command(*flags, "--batch-mode", mode, "--checkpoint-dir", str(ckpt),
                                   "--save-final", str(final)),
                     job_env(tmp, nproc=after, **fleet.get("second", {})), tmp)
    assert second.code == 0, second.output
    assert f"resumed from step {saved['step']} (written by {before} ranks)" in second.output
    return final


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 workers, uninterrupted, under plain torchrun (the script needs no agent)."""
    tmp = tmp_path_factory.mktemp("reference")
    final = tmp / "final.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(DIGITS), *FLAGS, "--checkpoint-dir", str(tmp / "ckpt"), "--save-final", str(final)]
    env = job_env(tmp)
    run = run_job(cmd, env, tmp)
    assert run.code == 0, run.output
    return final


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 3)])
def test_fixed_mode_resize_gives_the_same_parameters(reference: Path, tmp_path: Path,
                                                     before: int, after: int) -> None:
    final = interrupted(tmp_path, before, after)
    assert max_abs_diff(reference, final) <= 1e-5


def test_elastic_mode_trains_digits_across_a_batch_change(tmp_path: Path) -> None:
    module = load_module(DIGITS)
    final = interrupted(tmp_path, 2, 1, mode="elastic", flags=ELASTIC,
                        first={"global_batch_size": 48}, second={"global_batch_size": 96})
    model = module.Net()
    model.load_state_dict(torch.load(final))
    # The resume step depends on when SIGTERM lands, so accuracy varies run to run (0.897-0.947
    # seen here); chance is 0.1. The bar says "it still learns", with room for that spread.
    assert module.accuracy(model, module.digits("test")) >= 0.85
