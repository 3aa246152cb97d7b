"""Issue 13, item 8, end to end: a real training job whose checkpoint directory is full (a tiny
tmpfs) or read-only fails with a reason that names the cause, not just "command exited 1": the
runtime names it, the agent reports it, the reconciler records it. Needs root (mount)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.api import build_app
from broker.auth import ApiConfig, Role
from broker.models import JobState
from broker.scheduler import SchedulerConfig
from broker.server import BrokerConfig, build_broker
from broker.spec import parse_spec_text
from broker.store import Store
from tests.api_server import ApiServer
from tests.redis_server import RedisServer

AGENT_KEY = "sec-agent-key-0123456789abcdef"
SPEC = """
name: {name}
run: python examples/train_synthetic.py --size tiny --steps 20 --batch-size 8
gpus: 1
batch_size: {{min: 8, max: 8}}
work: {{steps: 20}}
checkpoint: {{uri: {uri}, interval: 5steps}}
"""


def mount(path: Path, options: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[dict[str, Path]]:
    full, ro = tmp_path / "full", tmp_path / "ro"
    if not mount(full, "size=64k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        if not mount(ro, "size=64k,ro"):
            pytest.skip("cannot mount a read-only tmpfs here")
        yield {"full": full, "ro": ro}
    finally:
        for p in (full, ro):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


def test_a_full_or_read_only_checkpoint_dir_is_named_in_the_reason(
        redis_server: RedisServer, store: Store, tmp_path: Path, mounts: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    server = ApiServer(build_app(store, ApiConfig().with_token(AGENT_KEY, Role.AGENT)
                                 .with_attempt_key(AGENT_KEY))).start()
    broker = build_broker(BrokerConfig(
        state_dir=tmp_path / "state", redis_url=redis_server.url, broker_url=server.url,
        agent_token=AGENT_KEY, tick_s=0.3, heartbeat_interval_s=1.0,
        scheduler=SchedulerConfig(max_failures=0)))  # the first failure is final: its reason stays
    broker.provider.local.workdir = Path(__file__).resolve().parents[2]  # type: ignore[union-attr]
    broker.start()
    want = {"full": "checkpoint write failed: no space left on device (ENOSPC)",
            "ro": "checkpoint write failed: read-only file system (EROFS)"}
    try:
        ids = {name: store.submit(parse_spec_text(SPEC.format(name=name, uri=path)).spec,
                                  team="t").id for name, path in mounts.items()}
        deadline = time.monotonic() + 150
        reasons: dict[str, str] = {}
        while len(reasons) < len(ids):
            for name, job_id in ids.items():
                job = store.get_job(job_id)
                assert job is not None
                if job.state is JobState.FAILED and name not in reasons:
                    reasons[name] = job.reason or ""
            assert time.monotonic() < deadline, (reasons, [store.get_job(i) for i in ids.values()])
            time.sleep(0.3)
        for name, reason in reasons.items():
            assert reason.startswith(want[name]), reason
            assert "command exited 1" in reason and len(reason) <= 300
    finally:
        broker.stop()
        for node in broker.provider.nodes():
            broker.provider.terminate(node.node_id)
        server.stop()
