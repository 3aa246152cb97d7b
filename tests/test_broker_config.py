"""One configuration for the broker: a YAML file, ``FLEET_<SECTION>__<KEY>`` overrides and the
flags of ``fleet up``, validated with errors that name the key and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from broker import config
from broker.config import BrokerConfigError
from broker.models import JobState
from broker.scheduler import Admission, Policy
from broker.server import Stack
from policies.models import BatchRange, GpuRange, JobSpec
from tests.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent
FLEET = """
grace_period_s: 2
regions:
  - {cloud: local, region: here, market: on-demand, price_per_gpu_hour: 1.0, gpus: 2}
"""
FILE = """
scheduler:
  policy: static
  admission: drop
  egress: {cross_cloud: 0.05}
broker:
  tick_s: 0.2
  heartbeat_interval_s: 2.5
  quick_reclaim_s: 45
  rendezvous_margin_s: 30
  refusal_decay_s: 90
"""


def wait_for(check: Callable[[], object], what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def test_file_env_and_flags_reach_the_running_round(
        tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broker.yaml").write_text(FILE)
    (tmp_path / "fleet.yaml").write_text(FLEET)
    monkeypatch.setenv("FLEET_SCHEDULER__RESTART_S", "123")  # the environment over the file
    settings = config.load(tmp_path / "broker.yaml", {"scheduler": {"admission": "queue"}})
    stack = Stack(settings.broker_config(state_dir=tmp_path / "state",
                                         redis_url=redis_server.url,
                                         fleet=tmp_path / "fleet.yaml"), port=0).start()
    try:
        broker = stack.broker
        assert broker is not None
        sched = broker.scheduler.config  # what each round plans with
        assert (sched.policy, sched.admission, sched.restart_s, sched.egress.cross_cloud) == \
            (Policy.STATIC, Admission.QUEUE, 123.0, 0.05)  # file, flag, env, nested file key
        assert (broker.config.tick_s, broker.reconciler.quick_reclaim_s,
                broker.actuator.config.rendezvous_margin_s) == (0.2, 45.0, 30.0)
        spec = JobSpec(name="knob", team="ml", run='echo "beat=$FLEET_HEARTBEAT_INTERVAL"',
                       gpus=GpuRange(min=1, max=2), batch_size=BatchRange(min=8, max=64),
                       work_samples=8)
        job = broker.store.submit(spec, team="ml")
        wait_for(lambda: broker.store.get_job(job.id).state is JobState.COMPLETED,  # type: ignore
                 "the job to complete")
        done = broker.store.get_job(job.id)
        assert done is not None
        # the static policy, from the file: gpus.min at the initial batch
        assert (done.gpus, done.batch_size) == (1, spec.batch_size.initial)
        lines, _ = broker.store.read_logs(job.id)
        assert any("beat=2.5" in line for line in lines), lines  # broker.heartbeat_interval_s
    finally:
        stack.stop()


@pytest.mark.parametrize(("text", "key", "fix"), [
    ("scheduler:\n  restrat_s: 5\n", "scheduler.restrat_s", "did you mean 'restart_s'"),
    ("broker:\n  tick_s: 0\n", "broker.tick_s", "greater than 0"),
    ("scheduler:\n  egress: {cross: 1}\n", "scheduler.egress.cross", "cross_cloud"),
    ("schedular: {}\n", "schedular", "did you mean 'scheduler'"),
    ("api:\n  tokens: 3\n", "api.tokens", "write a list"),
])
def test_a_bad_key_or_value_names_the_key_and_the_fix(tmp_path: Path, text: str, key: str,
                                                      fix: str) -> None:
    (tmp_path / "broker.yaml").write_text(text)
    with pytest.raises(BrokerConfigError) as err:
        config.load(tmp_path / "broker.yaml")
    said = " ".join([str(err.value), *map(str, err.value.problems)])
    assert key in said and fix in said, said


def test_a_bad_environment_value_names_the_variable_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_SCHEDULER__SPEEDUP_EXPONENT", "7")
    with pytest.raises(BrokerConfigError) as err:
        config.load()
    assert [p.field for p in err.value.problems] == ["scheduler.speedup_exponent"]
    assert "less than or equal to 1" in err.value.problems[0].message


def test_fleet_up_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "broker.yaml").write_text("broker:\n  lease_ttl: 5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    got = subprocess.run([sys.executable, "-m", "broker", "up", "--state-dir",
                          str(tmp_path / "state"), "--config", str(tmp_path / "broker.yaml")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    err = " ".join(got.stderr.split())
    assert got.returncode == 2, got.stderr
    assert "broker.lease_ttl" in err and "did you mean 'lease_ttl_s'" in err
    assert "Traceback" not in got.stderr and not (tmp_path / "state").exists()
