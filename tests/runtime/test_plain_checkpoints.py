"""A plain script's own DCP checkpoints, as the agent reports them: the real agent runs
``examples/train_dcp.py`` (plain FSDP2, no FleetBroker import) on 2 CPU workers with gloo under
a broker's heartbeat endpoint on loopback. Once the script's first ``dcp.save`` has committed
(its folder holds ``.metadata``), heartbeats say ``resumable: true`` with that checkpoint's step,
size and age; a folder without ``.metadata`` (a save that never finished) is not counted; a
plain script that commits no checkpoint stays ``resumable: false``."""

from __future__ import annotations

import sys
from pathlib import Path

from broker.protocol import EXIT_FINISHED
from broker.runtime.plain_checkpoints import newest_committed
from tests.runtime.jobs import DCP_SCRIPT, agent_command, broker_asking, job_env, run_job


def test_a_plain_dcp_script_is_reported_resumable_from_its_first_commit(tmp_path: Path) -> None:
    """5 steps, a save at step 5; beside it, an older run's step-10 folder whose save never
    wrote ``.metadata``. The script itself loads no checkpoint (none is complete) and the agent
    reports step 5, never 10; before the commit it does not say (the grace is long)."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-10").mkdir(parents=True)
    (ckpt / "step-10" / "__0_0.distcp").write_bytes(b"\0" * 64)  # an unfinished save
    with broker_asking("continue", None) as (url, beats):
        env = job_env(tmp_path, broker_url=url, heartbeat_interval=0.1, nproc=2,
                      checkpoint_uri=ckpt, progress_grace=600)
        run = run_job(agent_command("--steps", "5", "--checkpoint-every-steps", "5",
                                    script=DCP_SCRIPT), env, tmp_path)
    assert run.code == EXIT_FINISHED, run.output
    assert "resumed from" not in run.output  # the unfinished folder was not loaded either
    final = beats[-1]
    committed = ckpt / "step-5"
    assert (committed / ".metadata").exists()
    assert final["exit_code"] == EXIT_FINISHED and final["resumable"] is True
    assert final["checkpoint_step"] == 5
    assert final["checkpoint_bytes"] == sum(f.stat().st_size for f in committed.iterdir())
    assert 0 <= final["checkpoint_age_seconds"] < run.seconds
    said = [(b.get("resumable"), b.get("checkpoint_step")) for b in beats]
    assert set(said) <= {(None, None), (True, 5)}, said  # never step 10, never false


def test_a_plain_script_without_checkpoints_stays_not_resumable(tmp_path: Path) -> None:
    """The job has a checkpoint location, but the script writes neither progress nor a DCP
    checkpoint there: once the grace (0 here) passed it is a plain script, as before."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-3").mkdir(parents=True)  # a folder, but no committed checkpoint in it
    with broker_asking("continue", None) as (url, beats):
        env = job_env(tmp_path, broker_url=url, heartbeat_interval=0.1, checkpoint_uri=ckpt,
                      progress_grace=0)
        run = run_job([sys.executable, "-m", "broker.runtime.agent", "--", sys.executable,
                       "-c", "import time; time.sleep(0.5)"], env, tmp_path)
    assert run.code == EXIT_FINISHED, run.output
    assert beats and all(b.get("resumable") is False for b in beats)
    assert all("checkpoint_step" not in b and "checkpoint_age_seconds" not in b for b in beats)


def test_only_committed_folders_that_name_a_step_count() -> None:
    """The newest committed DCP folder by the step its name ends in; a folder without
    ``.metadata``, one whose name has no step, and the runtime's own layout (``step-`` and 10
    digits, reported through its progress file) are not counted."""
    assert newest_committed({}) is None
    assert newest_committed({
        "step-5": {".metadata": 10, "__0_0.distcp": 90},
        "checkpoint_40": {".metadata": 1, "__0_0.distcp": 2, "__1_0.distcp": 3},
        "step-90": {"__0_0.distcp": 90},  # not committed
        "latest": {".metadata": 1},  # no step in its name
        "step-0000000100": {".metadata": 1, "MANIFEST.json": 1},  # the runtime's
    }) == (40, 6)
