"""The Hugging Face Trainer integration: an unchanged Trainer script (examples/train_hf.py, a
one-layer GPT-2 built from a config) stopped by SIGTERM under the agent, resumed at another world
size, ends where the uninterrupted run ends (gloo on CPU, real processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.jobs import ROOT, job_env, progress, run_job

HF = ROOT / "examples" / "train_hf.py"
STEPS, BATCH = 16, 16
# --batch-size is a per-device cap: 16 samples a step are 2 x 4 per rank on 2 ranks, 4 x 4 on 1
FLAGS = f"--steps {STEPS} --batch-size 4 --grad-accum 2 --layers 1 --width 32 --samples 96".split()


def agent(tmp: Path, nproc: int, *extra: str, stop_at_step: int | None = None):
    command = [
        sys.executable,
        "-m",
        "broker.runtime.agent",
        "--",
        sys.executable,
        str(HF),
        *FLAGS,
        "--output-dir",
        str(tmp / "out"),
        *extra,
    ]
    env = job_env(tmp, nproc=nproc, checkpoint_uri=tmp / "ckpt", global_batch_size=BATCH)
    return run_job(command, env, tmp, stop_at_step=stop_at_step, timeout=180)


def max_abs_diff(a: Path, b: Path) -> float:
    sa, sb = torch.load(a), torch.load(b)
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    run = agent(tmp, 2, "--save-final", str(tmp / "final.pt"))
    assert run.code == 0, run.output
    return tmp / "final.pt"


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_stopped_trainer_resumes_at_another_size_exactly(
    reference: Path, tmp_path: Path, before: int, after: int
) -> None:
    first = agent(tmp_path, before, stop_at_step=5)
    assert first.code == 75, first.output
    saved = json.loads(sorted((tmp_path / "ckpt").glob("step-*/MANIFEST.json"))[-1].read_text())
    assert 5 <= saved["step"] < STEPS and saved["world_size"] == before, saved
    assert saved["global_batch_size"] == BATCH, saved

    second = agent(tmp_path, after, "--save-final", str(tmp_path / "final.pt"))
    assert second.code == 0, second.output
    assert f"resumed from step {saved['step']} (written by {before} ranks)" in second.output
    assert max_abs_diff(reference, tmp_path / "final.pt") <= 1e-5
    report = progress(tmp_path)
    assert report["finished"] and report["step"] == STEPS and report["world_size"] == after
    assert report["samples_done"] == STEPS * BATCH and report["samples_per_sec"] > 0
    assert report["checkpoint_step"] == STEPS
