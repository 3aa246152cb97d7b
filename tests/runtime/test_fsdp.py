"""FSDP2 jobs keep the fixed-batch maths and reshard their checkpoints across world sizes.

The synthetic GPT sharded with ``fully_shard`` (gloo on CPU) runs 2 workers stopped by SIGTERM,
3 workers stopped again, and 1 worker to the end from the 3 workers' last asynchronous
checkpoint, against 1 worker uninterrupted. The global batch (10) splits unevenly over 3 ranks
and into micro-batches of at most 3, and the layers' rows split unevenly into shards. SGD: Adam
divides by tiny second moments, which makes rounding differences between world sizes grow (DDP
shows the same).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.runtime.jobs import (
    DCP_SCRIPT,
    SYNTHETIC,
    agent_command,
    job_env,
    load_module,
    max_abs_diff,
    run_job,
)

STEPS = 24
MODEL = ["--fsdp", "--size", "tiny", "--context", "16", "--dropout", "0"]
MATHS = ["--batch-size", "10", "--max-micro-batch", "3", "--optimizer", "sgd", "--lr", "0.05"]
FLAGS = [*MODEL, *MATHS, "--steps", str(STEPS)]


def latest(ckpt: Path) -> tuple[dict, Path]:
    manifest = sorted(ckpt.glob("step-*/MANIFEST.json"))[-1]
    return json.loads(manifest.read_text()), manifest.parent


def test_fsdp_job_resized_2_3_1_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    reference = tmp_path / "reference.pt"
    run = run_job(
        agent_command(*FLAGS, "--save-final", str(reference), script=SYNTHETIC),
        job_env(tmp_path, nproc=1),
        tmp_path,
    )
    assert run.code == 0, run.output

    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    every = ["--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "2"]
    resumed_from, stop = None, random.randint(2, 4)
    for nproc in (2, 3):
        run = run_job(
            agent_command(*FLAGS, *every, script=SYNTHETIC),
            job_env(tmp_path, nproc=nproc),
            tmp_path,
            stop_at_step=stop,
        )
        assert run.code == 75, run.output
        saved, folder = latest(ckpt)
        assert saved["world_size"] == nproc and stop <= saved["step"] < STEPS, saved
        if resumed_from is not None:
            assert f"resumed from step {resumed_from} (written by 2 ranks)" in run.output
        # every rank wrote its own shard of the sharded (DTensor) state
        writers = {int(f.name.split("_")[2]) for f in folder.glob("__*_*.distcp")}
        assert writers == set(range(nproc)), sorted(folder.iterdir())
        resumed_from, stop = saved["step"], saved["step"] + random.randint(4, 5)

    # Without the stop's own (synchronous) checkpoint the last run resumes from the newest
    # periodic one, which 3 ranks wrote in the background from their staged shards.
    shutil.rmtree(folder)
    periodic, _ = latest(ckpt)
    assert periodic["world_size"] == 3 and periodic["step"] < resumed_from, periodic
    run = run_job(
        agent_command(*FLAGS, *every, "--save-final", str(final), script=SYNTHETIC),
        job_env(tmp_path, nproc=1),
        tmp_path,
    )
    assert run.code == 0, run.output
    assert f"resumed from step {periodic['step']} (written by 3 ranks)" in run.output
    assert max_abs_diff(reference, final) <= 1e-5


def test_a_plain_dcp_script_resumes_at_another_world_size_under_the_agent(tmp_path: Path) -> None:
    """No FleetBroker import: the agent's SIGTERM ends it (a clean stop, exit 75), and it resumes
    from its own newest DCP checkpoint on 3 ranks, redoing the steps after it. The reference is
    the same training in this process, without FSDP or a process group."""
    script = load_module(DCP_SCRIPT)
    model = script.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(60):
        x, y = script.batch(step, 12)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    reference = tmp_path / "reference.pt"
    torch.save(model.state_dict(), reference)

    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    every = ["--checkpoint-every-steps", "5", "--checkpoint-dir", str(ckpt)]
    flags = ["--steps", "60", "--batch-size", "12", "--lr", "0.05", *every]
    run = run_job(
        agent_command(*flags, script=DCP_SCRIPT),
        job_env(tmp_path, nproc=2),
        tmp_path,
        stop_when=lambda: (ckpt / "step-10" / ".metadata").exists(),
    )
    assert run.code == 75, run.output
    saved = max(int(p.parent.name.split("-")[1]) for p in ckpt.glob("step-*/.metadata"))
    assert 10 <= saved < 60
    run = run_job(
        agent_command(*flags, "--save-final", str(final), script=DCP_SCRIPT),
        job_env(tmp_path, nproc=3),
        tmp_path,
    )
    assert run.code == 0, run.output
    assert f"resumed from step {saved} with 3 ranks" in run.output
    assert max_abs_diff(reference, final) <= 1e-5
