"""The Lightning integration: an unchanged Lightning script (examples/train_lightning.py, a small
MLP with AdamW and a per-step LR schedule) stopped by SIGTERM under the agent, resumed at another
world size, ends where the uninterrupted run ends (DDP with gloo on CPU, real processes)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from broker.protocol import EXIT_STOPPED, Env
from broker.runtime.data import sample_indices
from broker.runtime.integrations import lightning as lightning_integration
from tests.runtime.jobs import ROOT, job_env, progress, run_job

EXAMPLE = ROOT / "examples" / "train_lightning.py"
STEPS, BATCH = 12, 16
# --batch-size is a per-device cap: 16 samples a step are 2 x 4 per rank on 2 ranks, 4 x 4 on 1
FLAGS = f"--steps {STEPS} --batch-size 4 --samples 96 --width 32".split()


def agent(tmp: Path, nproc: int, *extra: str, stop_at_step: int | None = None):
    command = [
        sys.executable,
        "-m",
        "broker.runtime.agent",
        "--",
        sys.executable,
        str(EXAMPLE),
        *FLAGS,
        *extra,
    ]
    env = job_env(
        tmp,
        nproc=nproc,
        checkpoint_uri=tmp / "ckpt",
        global_batch_size=BATCH,
        checkpoint_every_steps=2,
    )
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
def test_a_stopped_lightning_job_resumes_at_another_size_exactly(
    reference: Path, tmp_path: Path, before: int, after: int
) -> None:
    first = agent(tmp_path, before, stop_at_step=3)
    assert first.code == 75, first.output
    manifests = [
        json.loads(p.read_text()) for p in (tmp_path / "ckpt").glob("step-*/MANIFEST.json")
    ]
    saved = max(manifests, key=lambda m: m["step"])
    assert 3 <= saved["step"] < STEPS and saved["world_size"] == before, saved
    assert any(m["step"] % 2 == 0 and m["step"] < saved["step"] for m in manifests)  # periodic
    assert saved["global_batch_size"] == BATCH, saved

    second = agent(tmp_path, after, "--save-final", str(tmp_path / "final.pt"))
    assert second.code == 0, second.output
    assert f"resumed from step {saved['step']} (written by {before} ranks)" in second.output
    diff = max_abs_diff(reference, tmp_path / "final.pt")
    assert diff <= 1e-5, diff
    report = progress(tmp_path)
    assert report["finished"] and report["step"] == STEPS and report["world_size"] == after
    assert report["samples_done"] == STEPS * BATCH and report["samples_per_sec"] > 0
    assert report["checkpoint_step"] == STEPS
    # what the agent reports from it: a resize restarts the workers, the batch splits evenly
    assert report["resize_generation"] is None and report["even_batch"] is True


# ---- in one process: what the integration sets up, and what it leaves alone -------------------
def example():
    spec = importlib.util.spec_from_file_location("train_lightning", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``lightning.pytorch`` with the integration installed, undone afterwards; one process."""
    import lightning.pytorch as module

    for name in [*os.environ]:
        if name.startswith("FLEET_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    for name, value in job_env(tmp_path, checkpoint_uri=tmp_path / "ckpt").items():
        if name.startswith("FLEET_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(module.Trainer, "__init__", module.Trainer.__init__)
    lightning_integration.install(module)
    return module


def tiny_fit(module, model, loader, steps: int, *callbacks, val=None) -> object:
    trainer = module.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(model, loader, val)
    return trainer


def test_the_job_batch_becomes_equal_micro_batches_in_the_runtimes_order(
    patched, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(Env.GLOBAL_BATCH_SIZE, "12")
    ex = example()
    patched.seed_everything(7)
    data = ex.synthetic(40, 4, 0)
    seen: list[torch.Tensor] = []

    class Seen(patched.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            seen.append(batch[0])

    steps = 5
    model = ex.Regressor(4, 8, 1e-2, steps)
    trainer = tiny_fit(patched, model, DataLoader(data, batch_size=5, shuffle=True), steps, Seen())
    # 12 samples a step on one rank: 3 micro-batches of 4 (none above the loader's 5)
    assert trainer.accumulate_grad_batches == 3 and [len(x) for x in seen] == [4] * 3 * steps
    order = sample_indices(7, len(data), 0, steps * 12)
    assert torch.equal(torch.cat(seen), data.tensors[0][torch.from_numpy(order)])
    report = progress(tmp_path)
    assert report["finished"] and report["step"] == steps and report["samples_done"] == 60
    assert report["checkpoint_step"] == steps and trainer.global_step == steps


def test_a_fit_the_integration_cannot_serve_runs_as_written(
    patched, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ex = example()

    class Manual(ex.Regressor):
        def __init__(self) -> None:
            super().__init__(4, 8, 1e-2, 3)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            opt.step()
            return loss

    trainer = tiny_fit(patched, Manual(), DataLoader(ex.synthetic(40, 4, 0), batch_size=5), 3)
    assert "manual optimization is not supported" in capsys.readouterr().err
    assert trainer.global_step == 3 and progress(tmp_path) == {}
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_stop_lightning_sees_before_the_runtime_exits_as_stopped(patched) -> None:
    ex = example()
    data = DataLoader(ex.synthetic(40, 4, 0), batch_size=5)

    class Validated(ex.Regressor):
        def validation_step(self, batch, batch_idx) -> None:
            pass

    class StopDuringSanityCheck(patched.Callback):
        def on_sanity_check_start(self, trainer, module) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler is the one installed

    with pytest.raises(SystemExit) as stopped:
        tiny_fit(patched, Validated(4, 8, 1e-2, 3), data, 3, StopDuringSanityCheck(), val=data)
    assert stopped.value.code == EXIT_STOPPED
