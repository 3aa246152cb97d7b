"""Agents of a 2-node job meet at a real broker API (uvicorn over redis-server on loopback): rank
0 registers the master, both run their workers with it, and a new round (a lost node replaced)
makes them run new workers with a fresh master; a crash, a cancel or no master ends them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.auth import attempt_token
from broker.models import JobRecord, JobState
from broker.store import Plan, Store
from providers.base import replacement_key
from tests.api_server import TOKENS, ApiServer, api_stack
from tests.runtime.jobs import ROOT, job_env
from tests.test_rendezvous import change
from tests.test_store import spec

# Writes what the agent told it to out/r<round>-rank<rank>.json, then acts out its mode in round
# 0: "exit" finishes, "fail" fails as workers do when a peer is lost, "hang" waits as they do on
# a collective with a dead peer, "crash" fails in every round (a bug in the script).
SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "FLEET_ROUND", "FLEET_NNODES")
    name = f"r{os.environ['FLEET_ROUND']}-rank{os.environ['RANK']}.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump({k: os.environ[k] for k in keys}, f)
    first = os.environ["FLEET_ROUND"] == "0"
    if mode == "crash" or (mode == "fail" and first):
        sys.exit(3)
    if mode == "hang" and first:
        time.sleep(60)
""")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ApiServer, Store]]:
    with api_stack(tmp_path) as got:
        yield got


def running_job(store: Store, nodes: int = 2, **fields: object) -> JobRecord:
    job = store.submit(spec(), team="t")
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, attempt=1, nodes=nodes)
    store.apply(plan)
    return change(store, job.id, state=JobState.RUNNING, **fields)


def start_agent(server: ApiServer, job: JobRecord, rank: int, tmp: Path, mode: str,
                **fleet: object) -> subprocess.Popen[str]:
    """One node's agent (FLEET_NPROC=1) with the attempt's token, polling fast."""
    node = tmp / f"node{rank}"
    node.mkdir(exist_ok=True)
    script = tmp / "worker.py"
    script.write_text(SCRIPT)
    (tmp / "out").mkdir(exist_ok=True)
    settings = {"job_id": job.id, "attempt": job.attempt, "nnodes": 2, "node_rank": rank,
                "nproc": 1, "broker_url": server.url, "heartbeat_interval": 0.2,
                "rendezvous_poll": 0.1, "grace_period": 5,
                "agent_token": attempt_token(TOKENS["agent"], job.id, job.attempt), **fleet}
    return subprocess.Popen(
        [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, str(script),
         str(tmp / "out"), mode],
        env=job_env(node, **settings), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def finish(*agents: subprocess.Popen[str]) -> list[tuple[int, str]]:
    out = []
    for agent in agents:
        try:
            output, _ = agent.communicate(timeout=60)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        out.append((agent.returncode, output))
    return out


def seen(tmp: Path, round_: int, rank: int) -> dict[str, str]:
    return json.loads((tmp / "out" / f"r{round_}-rank{rank}.json").read_text())


def wait_for_files(tmp: Path, round_: int) -> None:
    deadline = time.monotonic() + 30
    while not all((tmp / "out" / f"r{round_}-rank{r}.json").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, f"round {round_} did not start on both nodes"
        time.sleep(0.02)


def test_two_agents_meet_at_the_broker(stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    server, store = stack
    job = running_job(store)
    # rank 1 first: it waits until rank 0 has registered
    agents = [start_agent(server, job, rank, tmp_path, "exit") for rank in (1, 0)]
    for code, output in finish(*agents):
        assert code == 0, output
    first, second = seen(tmp_path, 0, 0), seen(tmp_path, 0, 1)
    master = (first["MASTER_ADDR"], first["MASTER_PORT"])
    assert master == (second["MASTER_ADDR"], second["MASTER_PORT"])
    assert master[0] == "127.0.0.1"  # the address toward the broker, a loopback one here
    assert store.r.hget(f"{store.p}rdzv:{job.id}", "1:0:0") == ":".join(master)
    assert [(s["RANK"], s["WORLD_SIZE"], s["FLEET_ROUND"], s["FLEET_NNODES"])
            for s in (first, second)] == [("0", "2", "0", "2"), ("1", "2", "0", "2")]
    assert store.agent_reports([job])[job.id].exits == {0: 0, 1: 0}


def test_the_group_waits_for_its_last_node(stack: tuple[ApiServer, Store],
                                           tmp_path: Path) -> None:
    """Rank 0 registered first: its workers wait until rank 1 (a node still booting) checked
    in, then both start with the same master."""
    server, store = stack
    job = running_job(store)
    first = start_agent(server, job, 0, tmp_path, "exit")
    deadline = time.monotonic() + 30
    while store.checked_in([job])[job.id] != {0}:
        assert time.monotonic() < deadline and first.poll() is None, "rank 0 did not register"
        time.sleep(0.02)
    time.sleep(1.0)  # ten polls
    assert not (tmp_path / "out" / "r0-rank0.json").exists()  # no worker before the group
    last = start_agent(server, job, 1, tmp_path, "exit")
    (code, output), (code1, output1) = finish(first, last)
    assert code == code1 == 0, output + output1
    assert "round 0: waiting at the broker's rendezvous until all 2 nodes checked in" in output
    assert seen(tmp_path, 0, 0)["MASTER_PORT"] == seen(tmp_path, 0, 1)["MASTER_PORT"]


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_a_new_round_restarts_the_workers_with_a_fresh_master(
        stack: tuple[ApiServer, Store], tmp_path: Path, mode: str) -> None:
    """A lost node's replacement bumps the round: workers that failed (or hang) on the lost
    peer give way to new ones in the new round, on the same agents."""
    server, store = stack
    job = running_job(store)
    agents = [start_agent(server, job, rank, tmp_path, mode, node_addr="node0.internal")
              for rank in (0, 1)]
    wait_for_files(tmp_path, 0)
    job = change(store, job.id, round=1)
    results = finish(*agents)
    for code, output in results:
        assert code == 0, output
        assert "round 1: node" in output
    if mode == "hang":
        assert all("stopping: the broker started round 1" in out for _, out in results)
    old, new = seen(tmp_path, 0, 0), [seen(tmp_path, 1, rank) for rank in (0, 1)]
    assert new[0]["MASTER_PORT"] == new[1]["MASTER_PORT"] != old["MASTER_PORT"]
    assert new[0]["MASTER_ADDR"] == new[1]["MASTER_ADDR"] == "node0.internal"  # FLEET_NODE_ADDR
    assert [(s["RANK"], s["WORLD_SIZE"], s["FLEET_ROUND"]) for s in new] == [
        ("0", "2", "1"), ("1", "2", "1")]
    assert store.agent_reports([job])[job.id].exits == {0: 0, 1: 0}


def test_a_crash_without_a_new_round_ends_after_the_rejoin_wait(
        stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    server, store = stack
    job = running_job(store)
    agents = [start_agent(server, job, rank, tmp_path, "crash", rejoin_timeout=0.5)
              for rank in (0, 1)]
    for code, output in finish(*agents):
        assert code == 3, output
        assert "waiting up to 0.5 s (FLEET_REJOIN_TIMEOUT)" in output
        assert "no new round within 0.5 s" in output
    assert store.agent_reports([job])[job.id].exits == {0: 3, 1: 3}


def test_rank_0_alone_never_starts_and_a_cancel_stops(stack: tuple[ApiServer, Store],
                                                       tmp_path: Path) -> None:
    """Rank 0 registered, but the group never formed: it fails without running a worker."""
    server, store = stack
    job = running_job(store)
    alone = start_agent(server, job, 0, tmp_path, "exit", rendezvous_timeout=0.5)
    [(code, output)] = finish(alone)
    assert code == 1 and "the group of round 0 did not form at the broker's rendezvous within " \
        "0.5 s" in output, output
    assert store.checked_in([job]) == {job.id: {0}}
    assert not (tmp_path / "out" / "r0-rank0.json").exists()
    job = running_job(store)  # a new job: rank 0 of the first one did check in
    cancelled = start_agent(server, job, 1, tmp_path, "exit")
    time.sleep(0.5)  # it polls the rendezvous meanwhile
    store.request_cancel(job.id)
    [(code, output)] = finish(cancelled)
    assert code == 75 and "broker asked for checkpoint-exit" in output, output
    assert not (tmp_path / "out" / "r0-rank1.json").exists()  # no worker ever ran


def wait_checked_in(store: Store, job: JobRecord, ranks: set[int],
                    agent: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while store.checked_in([job])[job.id] != ranks:
        assert time.monotonic() < deadline and agent.poll() is None, f"{ranks} did not check in"
        time.sleep(0.02)


def test_a_replaced_node_stops_and_the_stand_in_meets(stack: tuple[ApiServer, Store],
                                                      tmp_path: Path) -> None:
    """Rank 1's old node (the broker gave up on it, yet it holds the attempt's token) comes to
    the rendezvous of the round its stand-in was launched for: it must not release the master
    to rank 0; it exits 75 without a worker and reports nothing. The stand-in, with its own
    key, forms the group with rank 0."""
    server, store = stack
    launch = "job:3:1"
    job = running_job(store, launch_key=launch, round=1, stand_ins={1: 1})
    first = start_agent(server, job, 0, tmp_path, "exit", round=1, launch_key=launch)
    wait_checked_in(store, job, {0}, first)
    old = start_agent(server, job, 1, tmp_path, "exit", round=1, launch_key=launch)
    [(code, output)] = finish(old)
    assert code == 75 and "broker asked for checkpoint-exit" in output, output
    assert store.checked_in([job]) == {job.id: {0}}
    assert not (tmp_path / "out" / "r1-rank0.json").exists()  # no master for rank 0 either
    reports = [f for f in store.r.hgetall(f"{store.p}progress:{job.id}")
               if f.startswith(("exit:", "notice:"))]
    assert reports == []  # its exit 75 must not pass for the stand-in's
    stand_in = start_agent(server, job, 1, tmp_path, "exit", round=1,
                           launch_key=replacement_key(launch, 1, 1))
    for code, output in finish(first, stand_in):
        assert code == 0, output
    assert store.agent_reports([job])[job.id].exits == {0: 0, 1: 0}


def test_a_new_round_gets_its_own_deadline_and_carries_the_reports(
        stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    """Rank 0 waits for a group that does not form; the broker moves on to round 1 (it replaced
    rank 1): the node waits FLEET_RENDEZVOUS_TIMEOUT anew there, and its exit, once that runs
    out, is filed under round 1, the round the broker reads, not under round 0."""
    server, store = stack
    job = running_job(store)
    alone = start_agent(server, job, 0, tmp_path, "exit", rendezvous_timeout=2.5)
    wait_checked_in(store, job, {0}, alone)
    time.sleep(1.5)
    job = change(store, job.id, round=1)
    moved = time.monotonic()
    while alone.poll() is None and time.monotonic() - moved < 30:
        time.sleep(0.02)
    waited = time.monotonic() - moved
    [(code, output)] = finish(alone)
    assert code == 1 and "the group of round 1 did not form" in output, output
    assert waited > 2.0, f"gave up {waited:.1f} s into round 1: the deadline was not reset"
    assert store.agent_reports([job])[job.id].exits == {0: 1}
    assert store.r.hget(f"{store.p}progress:{job.id}", "exit:1:0:0") is None  # not under round 0
