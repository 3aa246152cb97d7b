"""FSDP2 jobs keep the fixed-batch maths and reshard their checkpoints across world sizes.

The synthetic GPT sharded with ``fully_shard`` (gloo on CPU) runs 2 workers stopped by SIGTERM,
3 workers stopped again, and 1 worker to the end, against 2 workers uninterrupted. The global
batch (10) splits unevenly over 3 ranks and into micro-batches of at most 3, and the layers'
rows split unevenly into shards. SGD: Adam divides by tiny second moments, which makes rounding
differences between world sizes grow (DDP shows the same).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.runtime.jobs import SYNTHETIC, agent_command, job_env, max_abs_diff, run_job

STEPS = 14
FLAGS = [
    "--fsdp",
    "--size",
    "tiny",
    "--context",
    "16",
    "--steps",
    str(STEPS),
    "--batch-size",
    "10",
    "--max-micro-batch",
    "3",
    "--dropout",
    "0",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
]


def latest(ckpt: Path) -> tuple[dict, Path]:
    manifest = sorted(ckpt.glob("step-*/MANIFEST.json"))[-1]
    return json.loads(manifest.read_text()), manifest.parent


def test_fsdp_job_resized_2_3_1_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    reference = tmp_path / "reference.pt"
    run = run_job(
        agent_command(*FLAGS, "--save-final", str(reference), script=SYNTHETIC),
        job_env(tmp_path, nproc=2),
        tmp_path,
    )
    assert run.code == 0, run.output

    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    resumed_from, stop = None, random.randint(2, 4)
    for nproc in (2, 3):
        run = run_job(
            agent_command(*FLAGS, "--checkpoint-dir", str(ckpt), script=SYNTHETIC),
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
        resumed_from, stop = saved["step"], saved["step"] + random.randint(2, 3)

    run = run_job(
        agent_command(
            *FLAGS, "--checkpoint-dir", str(ckpt), "--save-final", str(final), script=SYNTHETIC
        ),
        job_env(tmp_path, nproc=1),
        tmp_path,
    )
    assert run.code == 0, run.output
    assert f"resumed from step {resumed_from} (written by 3 ranks)" in run.output
    assert max_abs_diff(reference, final) <= 1e-5
