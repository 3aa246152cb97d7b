"""The Lightning integration: an unchanged Lightning script (examples/train_lightning.py, a small
MLP with AdamW and a per-step LR schedule) stopped by SIGTERM under the agent, resumed at another
world size, ends where the uninterrupted run ends (DDP with gloo on CPU, real processes)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from broker.protocol import EXIT_STOPPED, Env
from broker.runtime.data import sample_indices
from broker.runtime.integrations import lightning as lightning_integration
from tests.runtime.jobs import (
    ROOT,
    check_resumed_at_another_size,
    final_state,
    framework_job,
    job_env,
    load_module,
    progress,
)

EXAMPLE = ROOT / "examples" / "train_lightning.py"
STEPS, BATCH = 12, 16
# --batch-size is a per-device cap: 16 samples a step are 2 x 4 per rank on 2 ranks, 4 x 4 on 1
FLAGS = f"--steps {STEPS} --batch-size 4 --samples 96 --width 32".split()
agent = framework_job(EXAMPLE, FLAGS, BATCH)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return final_state(agent, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_stopped_lightning_job_resumes_at_another_size_exactly(
    reference: Path, tmp_path: Path, before: int, after: int
) -> None:
    check_resumed_at_another_size(agent, reference, tmp_path, before, after, STEPS, BATCH)


# ---- in one process: what the integration sets up, and what it leaves alone -------------------
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
    ex = load_module(EXAMPLE)
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
    ex = load_module(EXAMPLE)

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
    ex = load_module(EXAMPLE)
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
