"""A check for a machine with a GPU (not part of ``make test``, which runs on CPUs): the
runtime under the agent trains ``tests/gpu/cuda_job.py`` on the GPU, is stopped by SIGTERM a
third of the way, resumes from its checkpoint, and ends with the parameters of an uninterrupted
run. ``python -m tests.gpu.check_runtime`` prints the largest parameter difference."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from tests.runtime.jobs import ROOT, job_env, run_job

JOB = str(Path(__file__).with_name("cuda_job.py"))


def agent(*args: str) -> list[str]:
    return [sys.executable, "-m", "broker.runtime.agent", "--nproc", "1", "--",
            sys.executable, JOB, *args]


def main() -> None:
    assert torch.cuda.is_available(), "this check needs a GPU"
    tmp = Path(tempfile.mkdtemp())
    env = job_env(tmp)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    steps = os.environ.get("STEPS", "200")

    def run(name: str, stop: int | None = None):
        flags = ["--steps", steps, "--checkpoint-dir", str(tmp / name),
                 "--save-final", str(tmp / f"{name}.pt")]
        return run_job(agent(*flags), env, tmp, stop_at_step=stop, timeout=400)

    whole = run("a")
    print("uninterrupted: exit", whole.code)
    stopped = run("b", stop=int(steps) // 3)
    print("stopped: exit", stopped.code, "(75 = checkpointed)")
    resumed = run("b")
    print("resumed: exit", resumed.code,
          [line for line in resumed.output.splitlines() if "resumed from" in line][-1:])
    a, b = torch.load(tmp / "a.pt"), torch.load(tmp / "b.pt")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |parameter difference| after the stop and resume: {diff:.3e}")


if __name__ == "__main__":
    main()
