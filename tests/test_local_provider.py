"""The local provider: idempotent launches, exit codes that survive a restarted provider,
preemption with a grace period, and fleet-file errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker.protocol import Env
from policies.models import Accelerator, Market
from providers.base import CapacityError, LaunchRequest, NodeState
from providers.local.provider import LocalFleet, LocalProvider

FLEET = LocalFleet.model_validate({"grace_period_s": 1.0, "regions": [
    {"cloud": "aws", "region": "east", "market": "spot", "price_per_gpu_hour": 0.3, "gpus": 2},
    {"cloud": "gcp", "region": "west", "market": "on-demand", "price_per_gpu_hour": 1.0,
     "gpus": 2},
]})


def req(key: str, script: str, region: str = "east", gpus: int = 1) -> LaunchRequest:
    market = Market.SPOT if region == "east" else Market.ON_DEMAND
    return LaunchRequest(idempotency_key=key, job_id=key.split(":")[0], region=region,
                         accelerator=Accelerator.T4, gpus_per_node=gpus, market=market,
                         command=["sh", "-c", script])


def wait_state(p: LocalProvider, node_id: str, state: NodeState, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if {n.node_id: n for n in p.nodes()}[node_id].state is state:
            return
        time.sleep(0.05)
    raise AssertionError(f"{node_id} never reached {state}")


def test_launch_is_idempotent_and_exit_code_is_recorded(tmp_path: Path) -> None:
    p = LocalProvider(FLEET, tmp_path)
    (a,) = p.launch(req("j-1:1:1", "echo hello; echo $FLEET_MASTER_PORT; exit 3"))
    (again,) = p.launch(req("j-1:1:1", "echo hello; exit 3"))
    assert a.node_id == again.node_id
    wait_state(p, a.node_id, NodeState.TERMINATED)
    fresh = LocalProvider(FLEET, tmp_path)  # a restarted broker's provider
    (node,) = fresh.nodes()
    assert node.exit_code == 3 and node.job_id == "j-1"
    lines, _ = fresh.read_log(node.node_id)
    assert lines[0] == "hello" and lines[1].isdigit()
    assert len((tmp_path / "launches.log").read_text().splitlines()) == 1
    fresh.forget(node.node_id)
    assert fresh.nodes() == []


def test_the_attempt_token_reaches_the_command_on_a_pipe_and_never_in_a_file(
        tmp_path: Path) -> None:
    """Another job on the machine, scanning the state dir while this node starts, finds nothing:
    the token goes from the provider to the supervisor's stdin, then on a pipe to the command."""
    token = "f0" * 32
    check = ('[ -z "${FLEET_AGENT_TOKEN:-}" ] || exit 4; '
             '[ "$(cat /proc/self/fd/$FLEET_AGENT_TOKEN_FD)" = "$WANT" ] || exit 5; exit 0')
    request = req("j-1:1:1", check).model_copy(
        update={"env": {Env.AGENT_TOKEN: token, "WANT": token}})
    p = LocalProvider(FLEET, tmp_path)

    def files_holding_it() -> list[Path]:
        return [f for f in tmp_path.rglob("*") if f.is_file() and token in f.read_text()]

    (node,) = p.launch(request)
    assert files_holding_it() == []  # at once: no file for a fast scanner to read first
    wait_state(p, node.node_id, NodeState.TERMINATED)
    assert {n.node_id: n for n in p.nodes()}[node.node_id].exit_code == 0
    assert files_holding_it() == []


def test_a_lost_node_takes_its_workers_in_their_own_sessions_along(tmp_path: Path) -> None:
    """As a machine that dies: the agent starts workers in sessions of their own, outside the
    node's process group, and they go too."""
    p = LocalProvider(FLEET, tmp_path)
    pid_file = tmp_path / "worker.pid"
    (a,) = p.launch(req("j-9:1:1", f"setsid sleep 300 & echo $! > {pid_file}; wait"))
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    p.lose(a.node_id)
    wait_state(p, a.node_id, NodeState.TERMINATED)
    while Path(f"/proc/{worker}").exists() and \
            Path(f"/proc/{worker}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the worker outlived its node"
        time.sleep(0.05)
    (node,) = p.nodes()
    assert node.exit_code is None  # no exit record: the node was lost, not ended


def test_capacity_is_enforced(tmp_path: Path) -> None:
    p = LocalProvider(FLEET, tmp_path)
    p.launch(req("a:1:1", "sleep 5", gpus=2))
    with pytest.raises(CapacityError):
        p.launch(req("b:1:1", "sleep 5"))
    assert p.capacity()["aws:east:spot:T4"] == 0
    for n in p.nodes():
        p.terminate(n.node_id)


def test_reclaim_sends_sigterm_then_kills_after_grace(tmp_path: Path) -> None:
    p = LocalProvider(FLEET, tmp_path)
    (polite,) = p.launch(req("a:1:1", "trap 'exit 75' TERM; while true; do sleep 0.1; done"))
    (stubborn,) = p.launch(req("b:1:1", "trap '' TERM; while true; do sleep 0.1; done"))
    time.sleep(0.3)
    assert p.reclaim("east", duration_s=30) == 2
    assert {n.node_id for n in p.notices()} == {polite.node_id, stubborn.node_id}
    assert next(x for x in p.pools() if x.region == "east").capacity == 0
    wait_state(p, polite.node_id, NodeState.TERMINATED)
    wait_state(p, stubborn.node_id, NodeState.TERMINATED, timeout=15)
    ended = {n.node_id: n.exit_code for n in p.nodes()}
    assert ended[polite.node_id] == 75
    assert ended[stubborn.node_id] in (None, 137)  # SIGKILLed with its supervisor
    with pytest.raises(CapacityError):
        p.launch(req("c:1:1", "true"))
    with pytest.raises(ValueError, match="on-demand"):
        p.reclaim("west")


def test_fleet_file_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("regions:\n  - {region: r1, price_per_gpu_hour: -1, gpus: 2}\n")
    with pytest.raises(ValueError, match=r"regions\.0\.price_per_gpu_hour"):
        LocalFleet.load(bad)
    bad.write_text("regions: [\n")
    with pytest.raises(ValueError, match="cannot read fleet file"):
        LocalFleet.load(bad)
    assert len(LocalFleet.load(Path("examples/fleets/local.yaml")).regions) == 3
