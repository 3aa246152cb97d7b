"""A live broker for end-to-end tests: its API on loopback, its loop over a local fleet file, the
job processes it starts on this machine, all stopped (and every node terminated) on exit."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.api import build_app
from broker.auth import ApiConfig, Role
from broker.files import BlobStore
from broker.scheduler import SchedulerConfig
from broker.sealed import Sealer
from broker.server import Broker, BrokerConfig, build_broker
from broker.store import Store
from tests.api_server import ApiServer
from tests.builders import fleet as run_fleet

ROOT = Path(__file__).resolve().parent.parent
AGENT_TOKEN = "e2e-agent-token-0123456789"
TEAM_TOKEN = "e2e-team-ml-token-0123456789"  # team ml's


@contextlib.contextmanager
def live_broker(redis_url: str, store: Store, tmp_path: Path, fleet: str,
                monkeypatch: pytest.MonkeyPatch,
                scheduler: SchedulerConfig | None = None) -> Iterator[Broker]:
    """The broker over ``fleet`` (a fleet file's text); jobs run this repository's code. Its
    API takes TEAM_TOKEN for team ``ml``, seals secrets with the key in its state dir and keeps
    packed files there. ``scheduler``: the round's policy (default: SchedulerConfig())."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    (tmp_path / "fleet.yaml").write_text(fleet)
    config = (ApiConfig().with_token(AGENT_TOKEN, Role.AGENT).with_attempt_key(AGENT_TOKEN)
              .with_token(TEAM_TOKEN, Role.TEAM, team="ml"))
    server = ApiServer(build_app(store, config, sealer=Sealer.load(tmp_path / "state"),
                                 blobs=BlobStore(tmp_path / "state" / "blobs"))).start()
    running = build_broker(BrokerConfig(
        state_dir=tmp_path / "state", redis_url=redis_url, broker_url=server.url,
        fleet=tmp_path / "fleet.yaml", agent_token=AGENT_TOKEN, tick_s=0.3,
        heartbeat_interval_s=0.5, scheduler=scheduler or SchedulerConfig())).start()
    try:
        yield running
    finally:
        running.stop()
        for node in running.provider.nodes():  # leave no job process behind
            running.provider.terminate(node.node_id)
        server.stop()


def cli_env(broker: Broker, tmp_path: Path) -> dict[str, str]:
    """The ``fleet`` CLI's environment for team ``ml`` against ``broker``'s API."""
    return {"FLEET_URL": broker.config.broker_url or "", "FLEET_TOKEN": TEAM_TOKEN,
            "FLEET_CONFIG": str(tmp_path / "c.yaml")}


def launch(env: dict[str, str], spec: Path) -> tuple[str, str]:
    """``fleet launch``: the job id and what it said, on one line."""
    code, out, err = run_fleet(env, "launch", str(spec))
    assert code == 0, err
    said = " ".join(out.split())
    return said.split("submitted ", 1)[1].split()[0], said
