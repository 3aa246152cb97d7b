"""The trainer in one process: accumulation, resume and LR scaling give the expected maths."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import broker.runtime as fleet
from broker.runtime.assignment import Assignment
from broker.runtime.checkpoint_stores import LocalStore

DATA = TensorDataset(torch.randn(40, 6, generator=torch.Generator().manual_seed(0)),
                     torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1)))
SOLO = Assignment()  # one process, whatever the environment of the test run says


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def train(trainer: fleet.Trainer, model: nn.Module, opt: torch.optim.Optimizer, sched,
          sigterm_at: int | None = None) -> None:
    for x, y in trainer:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        if trainer.step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next step boundary


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run(**kw) -> torch.Tensor:
    model, opt, sched = build()
    trainer = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, scheduler=sched,
                            assignment=SOLO, **kw)
    train(trainer, model, opt, sched)
    assert trainer.step == 8 and trainer.samples_done == 96
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 2)  # stepped once per step
    return params(model)


def test_gradient_accumulation_does_not_change_the_maths() -> None:
    whole = run()
    for micro in (5, 3):
        torch.testing.assert_close(run(max_micro_batch=micro), whole, atol=1e-6, rtol=0)


def test_resume_restores_model_optimizer_scheduler_data_and_rng(tmp_path: Path) -> None:
    whole = run(checkpoint_dir=tmp_path / "a")
    model, opt, sched = build()
    first = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, scheduler=sched,
                          assignment=SOLO, checkpoint_dir=tmp_path / "b", max_micro_batch=5)
    with pytest.raises(SystemExit) as stopped:
        train(first, model, opt, sched, sigterm_at=3)
    assert stopped.value.code == 75 and LocalStore(tmp_path / "b").steps() == ([4], [])
    torch.manual_seed(123)  # a fresh process: every RNG elsewhere
    model, opt, sched = build()
    second = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, scheduler=sched,
                           assignment=SOLO, checkpoint_dir=tmp_path / "b")
    assert (second.step, second.samples_done) == (4, 48)
    train(second, model, opt, sched)
    torch.testing.assert_close(params(model), whole, atol=1e-6, rtol=0)


def test_elastic_mode_scales_the_learning_rate_only_inside_the_step() -> None:
    model, opt, _ = build()
    seen = []
    real = opt.step
    trainer = fleet.elastic(model, opt, DATA, batch_size=12, global_batch_size=24, steps=4,
                            batch_mode="elastic", lr_scaling="sqrt", assignment=SOLO)
    assert trainer._factor == pytest.approx(2 ** 0.5)
    for x, y in trainer:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
    assert trainer.step == 2 and seen == [0.01, 0.01] and opt.step is not real


def test_bad_arguments_are_named() -> None:
    model, opt, _ = build()
    with pytest.raises(ValueError, match="batch_mode='huge'"):
        fleet.elastic(model, opt, DATA, batch_size=4, steps=1, batch_mode="huge", assignment=SOLO)
    with pytest.raises(ValueError, match="give batch_size="):
        fleet.elastic(model, opt, DATA, steps=1, assignment=SOLO)


@pytest.mark.parametrize("after", [20, 23, 47])
def test_a_batch_change_ends_exactly_at_the_requested_work(tmp_path: Path, after: int) -> None:
    """8 steps of 12 = 96 samples; 4 steps run at 12, the rest at ``after``: the last step
    takes only what is left (20: 20+20+8; 23: 23+25, the 2 left folded in; 47: 48)."""
    model, opt, sched = build()
    first = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, scheduler=sched,
                          batch_mode="elastic", assignment=SOLO, checkpoint_dir=tmp_path)
    with pytest.raises(SystemExit):
        train(first, model, opt, sched, sigterm_at=3)
    model, opt, sched = build()
    second = fleet.elastic(model, opt, DATA, batch_size=12, global_batch_size=after, steps=8,
                           scheduler=sched, batch_mode="elastic", assignment=SOLO,
                           checkpoint_dir=tmp_path)
    assert second.samples_done == 48
    seen = []
    for x, y in second:
        seen.append(len(x))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert second.samples_done == 96 and sum(seen) == 48, seen
    assert min(seen) > 0 and max(seen) <= after + 1  # folding adds less than a world


RESUMED = r"""
import json, sys
import torch
import torch.nn.functional as F
import broker.runtime as fleet
from tests.runtime.test_trainer import DATA, build

model, opt, _ = build()
trainer = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, global_batch_size=47,
                        batch_mode="elastic", checkpoint_dir=sys.argv[1])
for x, y in trainer:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
if trainer.rank == 0:
    torch.save(model.state_dict(), sys.argv[2])
    with open(sys.argv[3], "w") as f:
        json.dump({"samples_done": trainer.samples_done, "step": trainer.step}, f)
"""


def test_a_resize_to_more_ranks_than_samples_left_ends_exactly(tmp_path: Path) -> None:
    """96 samples at a global batch of 47 on one rank: 47, 47, then a last step of 2 (the
    remainder is taken exactly, not a full batch). Stopped before that last step and resumed on
    3 ranks, 2 samples are left for 3 ranks: the step takes exactly those 2 (the third rank adds
    nothing to the gradient), and the result equals the last step run on one rank."""
    import shutil
    import subprocess
    import sys

    from tests.runtime.jobs import ROOT, job_env

    model, opt, sched = build()
    first = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, global_batch_size=47,
                          batch_mode="elastic", assignment=SOLO, checkpoint_dir=tmp_path / "a")
    with pytest.raises(SystemExit):
        train(first, model, opt, sched, sigterm_at=1)  # stops after the second step
    assert first.samples_done == 94
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    model, opt, _ = build()  # the reference: the last step on one rank
    solo = fleet.elastic(model, opt, DATA, batch_size=12, steps=8, global_batch_size=47,
                         batch_mode="elastic", assignment=SOLO, checkpoint_dir=tmp_path / "b")
    for x, y in solo:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert (solo.samples_done, solo.step) == (96, 3)

    (tmp_path / "resumed.py").write_text(RESUMED)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         str(tmp_path / "resumed.py"), str(tmp_path / "a"), str(tmp_path / "final.pt"),
         str(tmp_path / "done.json")],
        env=job_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    done = json.loads((tmp_path / "done.json").read_text())
    assert done == {"samples_done": 96, "step": 3}
    got = torch.load(tmp_path / "final.pt")
    want = model.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
