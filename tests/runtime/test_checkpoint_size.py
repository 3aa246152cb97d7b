"""Each checkpoint's size (every rank's files and the manifest) reaches the progress file and the
heartbeat, and equals the bytes of that checkpoint's folder on disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pytest_httpserver import HTTPServer
from torch import nn
from werkzeug import Request, Response

import broker.runtime as fleet
from broker.runtime.assignment import Assignment
from broker.runtime.checkpoint_stores import LocalStore, step_dir_name
from tests.runtime.jobs import agent_command, job_env, progress, run_job


def folder_bytes(root: Path, step: int) -> int:
    return sum(f.stat().st_size for f in (root / step_dir_name(step)).iterdir() if f.is_file())


def test_one_process_reports_each_checkpoint_size_and_the_resumed_one(tmp_path: Path) -> None:
    ckpt, prog = tmp_path / "ckpt", tmp_path / "progress.json"
    solo = Assignment(progress_file=str(prog), progress_interval=0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,)))

    def trainer() -> tuple[fleet.Trainer, nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return fleet.elastic(model, opt, data, batch_size=12, steps=8, checkpoint_dir=ckpt,
                             checkpoint_every_steps=3, keep_checkpoints=10,
                             async_checkpoint=False, assignment=solo), model, opt

    seen: dict[int, int] = {}
    loop, model, opt = trainer()
    for x, y in loop:
        p = json.loads(prog.read_text()) if prog.exists() else {}  # as of the last step
        if p.get("checkpoint_step") is not None:
            seen[p["checkpoint_step"]] = p["checkpoint_bytes"]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    final = json.loads(prog.read_text())
    seen[final["checkpoint_step"]] = final["checkpoint_bytes"]
    assert LocalStore(ckpt).steps() == ([3, 6, 8], [])
    assert seen == {s: folder_bytes(ckpt, s) for s in (3, 6, 8)}
    assert LocalStore(ckpt).manifest(8)["bytes"] < seen[8]  # the manifest counts too

    prog.unlink()
    again, _, _ = trainer()  # resumes the finished job: the loaded checkpoint's size
    assert list(again) == []
    assert json.loads(prog.read_text())["checkpoint_bytes"] == folder_bytes(ckpt, 8)


def test_two_ranks_sum_their_shards_into_the_heartbeat(httpserver: HTTPServer,
                                                        tmp_path: Path) -> None:
    beats: list[dict] = []

    def heartbeat(request: Request) -> Response:
        beats.append(request.get_json())
        return Response("{}", content_type="application/json")

    httpserver.expect_request("/v1/agent/heartbeat", method="POST").respond_with_handler(heartbeat)
    ckpt = tmp_path / "ckpt"
    env = job_env(tmp_path, nproc=2, heartbeat_interval=0.5, job_id="job-1", attempt=1,
                  broker_url=httpserver.url_for("/"))
    run = run_job(agent_command("--steps", "4", "--batch-size", "16",
                                "--checkpoint-dir", str(ckpt)), env, tmp_path)
    assert run.code == 0, run.output
    last = beats[-1]
    assert last["state"] == "finished" and last["checkpoint_step"] == 4
    folder = ckpt / step_dir_name(4)
    assert (folder / "rng-1.pt").exists() and list(folder.glob("__1_*"))  # rank 1's shard
    assert last["checkpoint_bytes"] == folder_bytes(ckpt, 4) == progress(tmp_path)[
        "checkpoint_bytes"]
