"""The launch request the actuator sends a provider: the job's assignment in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.actuator import ActuatorConfig, launch_request
from broker.models import Intent, IntentKind, JobRecord
from broker.spec import parse_spec_text
from policies.models import Accelerator, CheckpointSpec, Market, Pool

POOL = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100, market=Market.SPOT,
            nodes=1, gpus_per_node=4, price_per_gpu_hour=0.9)
SPEC = """
name: train
run: python train.py
gpus: 1:4
batch_size: {min: 32, max: 256, default: 64}
work: {steps: 100}
"""


def request(extra: str = "", tmp: Path = Path("/tmp")) -> dict[str, str]:
    spec = parse_spec_text(SPEC + extra).spec
    job = JobRecord(id="train-1", spec=spec, team="ml")
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=3, attempt=2, gpus=2,
                    batch_size=128, pool=POOL.id)
    return launch_request(job, intent, POOL, ActuatorConfig(checkpoint_root=tmp)).env


def test_assignment_and_the_specs_checkpoint_interval_reach_the_agent(tmp_path: Path) -> None:
    env = request(tmp=tmp_path)
    assert (env["FLEET_NPROC"], env["FLEET_GLOBAL_BATCH_SIZE"], env["FLEET_LAUNCH_KEY"]) == (
        "2", "128", "train-1:3:2")
    assert env["FLEET_CHECKPOINT_EVERY_SECONDS"] == "100"  # the spec's default
    assert "FLEET_CHECKPOINT_EVERY_STEPS" not in env
    env = request("checkpoint: {interval: 5m}\n", tmp_path)
    assert env["FLEET_CHECKPOINT_EVERY_SECONDS"] == "300"
    env = request("checkpoint: {interval: 500 steps}\n", tmp_path)
    assert env["FLEET_CHECKPOINT_EVERY_STEPS"] == "500"
    assert "FLEET_CHECKPOINT_EVERY_SECONDS" not in env


def test_a_stored_interval_is_canonical() -> None:
    assert CheckpointSpec(interval="500steps").every == (500, True)
    assert CheckpointSpec().every == (100, False)
    with pytest.raises(ValidationError, match="interval"):
        CheckpointSpec(interval="5m")  # the spec parser writes 300s
