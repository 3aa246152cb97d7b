"""A resize on the node the job holds keeps the workers' processes (the broker's ``resize``):
grow and shrink end where the uninterrupted run ends; a script without the runtime restarts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.runtime.jobs import DIGITS, agent_command, broker_asking, job_env, run_job
from tests.runtime.test_resize_exactness import max_abs_diff

# Short, as rounding differences between world sizes grow with the steps (1e-3 after 200
# steps here), yet one sample per forward pass keeps the job running past a joining worker's
# start-up (seconds of imports on a busy machine): the resize lands mid-run.
FLAGS = ["--steps", "60", "--batch-size", "24", "--max-micro-batch", "1", "--lr", "0.05"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, uninterrupted: fixed mode makes the result independent of the world size."""
    tmp = tmp_path_factory.mktemp("reference")
    final = tmp / "final.pt"
    run = run_job(
        [sys.executable, str(DIGITS), *FLAGS, "--save-final", str(final)],
        job_env(tmp),
        tmp,
        timeout=300,
    )
    assert run.code == 0, run.output
    return final


def resized(tmp: Path, before: int, after: int) -> tuple[Path, str]:
    final = tmp / "final.pt"
    # A grow is asked at once: the new worker starts up beside the first one.
    with broker_asking("resize", None if after > before else 1, nproc=after) as (url, _):
        env = job_env(tmp, nproc=before, heartbeat_interval=0.05, broker_url=url)
        run = run_job(
            agent_command(
                *FLAGS, "--checkpoint-dir", str(tmp / "ckpt"), "--save-final", str(final)
            ),
            env,
            tmp,
            timeout=300,
        )
    assert run.code == 0, run.output
    return final, run.output


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)])
def test_resize_in_place_gives_the_same_parameters(
    reference: Path, tmp_path: Path, before: int, after: int
) -> None:
    final, output = resized(tmp_path, before, after)
    assert f"resized in place {before} -> {after} ranks" in output, output
    assert f"resized in place to {after} workers" in output, output
    assert "resumed from step" not in output  # no checkpoint read: the processes stayed
    if after > before:
        assert "joined the group (resize 1)" in output, output
    else:
        assert "leaving the group (resize 2 -> 1)" in output, output
    assert max_abs_diff(reference, final) <= 1e-5


PLAIN = """
import os, signal, sys, time
world = os.environ["WORLD_SIZE"]
print("world", world, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
if world == "1":
    time.sleep(120)
"""


def test_a_script_without_the_runtime_is_restarted_at_the_new_size(tmp_path: Path) -> None:
    with broker_asking("resize", None, nproc=2) as (url, beats):
        env = job_env(tmp_path, nproc=1, heartbeat_interval=0.05, broker_url=url, resize_timeout=3)
        command = [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, "-c", PLAIN]
        run = run_job(command, env, tmp_path, timeout=120)
    assert run.code == 0, run.output
    # The new worker, a plain script, never says it is ready (it does not import the runtime):
    # the agent gives up on the in-place path and restarts both workers at the new size.
    assert (
        "resize to 2 workers: " in run.output
        and "; restarting them from a checkpoint" in run.output
    )
    assert "resized in place" not in run.output
    assert beats[-1]["state"] == "finished" and run.output.count("world 2") >= 2, run.output
