"""The Hugging Face Trainer integration: an unchanged Trainer script (examples/train_hf.py, a
one-layer GPT-2 built from a config) stopped by SIGTERM under the agent, resumed at another world
size, ends where the uninterrupted run ends (gloo on CPU, real processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import TrainerCallback

from broker.protocol import Env
from broker.runtime.assignment import AssignmentError
from broker.runtime.integrations import hf
from tests.runtime.jobs import (
    ROOT,
    Run,
    check_resumed_at_another_size,
    final_state,
    framework_job,
    load_module,
    progress,
)

HF = ROOT / "examples" / "train_hf.py"
STEPS, BATCH = 16, 16
# --batch-size is a per-device cap: 16 samples a step are 2 x 4 per rank on 2 ranks, 4 x 4 on 1
FLAGS = f"--steps {STEPS} --batch-size 4 --grad-accum 2 --layers 1 --width 32 --samples 96".split()
_agent = framework_job(HF, FLAGS, BATCH)


def agent(tmp: Path, nproc: int, *extra: str, stop_at_step: int | None = None) -> Run:
    return _agent(tmp, nproc, "--output-dir", str(tmp / "out"), *extra,
                  stop_at_step=stop_at_step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return final_state(agent, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_stopped_trainer_resumes_at_another_size_exactly(
    reference: Path, tmp_path: Path, before: int, after: int
) -> None:
    check_resumed_at_another_size(agent, reference, tmp_path, before, after, STEPS, BATCH)


# ---- in one process: the arguments the integration rewrites, and what it leaves alone --------
@pytest.fixture
def patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``transformers.trainer`` with the integration installed, undone afterwards; one process."""
    import transformers.trainer as module

    for name in [*os.environ]:
        if name.startswith("FLEET_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    for name in ("__init__", "get_train_dataloader", "train"):
        monkeypatch.setattr(module.Trainer, name, getattr(module.Trainer, name))
    hf.install(module)
    return module


def tiny_trainer(module, tmp: Path, trainer_cls=None, **args):
    ex = load_module(HF)
    config = ex.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    training = module.TrainingArguments(
        output_dir=str(tmp / "out"), report_to="none", save_strategy="no", disable_tqdm=True, **args
    )
    return (trainer_cls or module.Trainer)(
        model=ex.GPT2LMHeadModel(config), args=training, train_dataset=ex.Counting(30, 16, 64, 0)
    )


def test_micro_batches_are_equal_and_within_the_cap() -> None:
    assert [hf.split(s, 4) for s in (16, 8, 6, 7, 3)] == [(4, 4), (4, 2), (3, 2), (1, 7), (3, 1)]


def test_the_batch_arguments_follow_the_jobs_global_batch(
    patched, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(Env.GLOBAL_BATCH_SIZE, "12")
    trainer = tiny_trainer(patched, tmp_path, per_device_train_batch_size=4, num_train_epochs=2)
    args = trainer.args
    # 12 samples a step on one worker: 3 micro-batches of 4; 2 epochs of 30 samples: 5 steps
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    assert args.max_steps == 5
    assert any(isinstance(c, hf.FleetCallback) for c in trainer.callback_handler.callbacks)
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(AssignmentError, match="global batch 12 does not split evenly over 5"):
        hf.attach(trainer)


@pytest.mark.parametrize("case", ["own loader", "auto batch"])
def test_a_trainer_the_integration_cannot_serve_runs_as_written(
    patched,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    class Own(patched.Trainer):
        def get_train_dataloader(self):
            return super().get_train_dataloader()

    monkeypatch.setenv(Env.GLOBAL_BATCH_SIZE, "12")
    cls, auto = (Own, False) if case == "own loader" else (None, True)
    trainer = tiny_trainer(
        patched,
        tmp_path,
        cls,
        per_device_train_batch_size=4,
        max_steps=3,
        auto_find_batch_size=auto,
    )
    assert trainer.args.gradient_accumulation_steps == 1
    assert not any(isinstance(c, hf.FleetCallback) for c in trainer.callback_handler.callbacks)
    expected = "Own builds its own" if cls else "auto_find_batch_size changes the batch"
    assert expected in capsys.readouterr().err


def test_the_jobs_checkpoint_wins_over_the_scripts_resume(
    patched, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(Env.CHECKPOINT_URI, str(tmp_path / "ckpt"))
    monkeypatch.setenv(Env.PROGRESS_FILE, str(tmp_path / "progress.json"))
    tiny_trainer(patched, tmp_path, per_device_train_batch_size=4, max_steps=2).train()
    trainer = tiny_trainer(patched, tmp_path, per_device_train_batch_size=4, max_steps=4)
    steps = []
    counter = TrainerCallback()
    counter.on_step_end = lambda args, state, control, **_: steps.append(state.global_step)
    trainer.add_callback(counter)
    trainer.train(resume_from_checkpoint=str(tmp_path / "no-such-checkpoint"))
    assert steps == [3, 4]  # steps 1 and 2 came from the first Trainer's checkpoint
    assert "is ignored: the job resumes from its latest checkpoint" in capsys.readouterr().err
    assert trainer.state.global_step == 4
    assert progress(tmp_path)["samples_done"] == 4 * 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-0000000002",
        "step-0000000004",
    ]
