"""The store's side of multi-node jobs against a real redis-server: the rendezvous (rank 0's
address for the job's current attempt and round) and per-node agent reports (exit codes and
preemption notices per rank and round)."""

from __future__ import annotations

import pytest

from broker.models import JobRecord, JobState
from broker.store import CHECKPOINT_EXIT, CONTINUE, RENDEZVOUS_TTL_S, JobNotFound, Plan, Store
from tests.test_store import spec


def change(store: Store, job_id: str, state: JobState | None = None, **fields: object,
           ) -> JobRecord:
    job = store.get_job(job_id)
    assert job is not None
    plan = Plan()
    plan.change(job, state, **fields)
    store.apply(plan)
    got = store.get_job(job_id)
    assert got is not None
    return got


def two_node_job(store: Store) -> JobRecord:
    """A launched 2-node job (attempt 1, round 0)."""
    job = store.submit(spec(), team="t")
    return change(store, job.id, JobState.LAUNCHING, attempt=1, nodes=2)


def test_rendezvous_names_rank_0s_address_of_the_current_attempt_and_round(
        store: Store) -> None:
    job = two_node_job(store)
    waiting = {"round": 0, "nnodes": 2, "master": None, "action": CONTINUE}
    assert store.rendezvous(job.id, 1, 0, 1, None) == waiting
    assert store.rendezvous(job.id, 1, 0, 1, "10.0.0.6:1234") == waiting  # not the master
    assert store.rendezvous(job.id, 1, 1, 0, "10.0.0.9:1") == waiting  # a round not yet begun
    stale = store.rendezvous(job.id, 0, 0, 0, "10.0.0.9:2")
    assert stale == {**waiting, "action": CHECKPOINT_EXIT}  # an old attempt must stop
    assert store.rendezvous(job.id, 1, 0, 1, None) == waiting  # neither was recorded

    met = {**waiting, "master": "10.0.0.5:29500"}
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29500") == met
    assert store.rendezvous(job.id, 1, 0, 1, None) == met
    key = f"{store.p}rdzv:{job.id}"
    assert 0 < store.r.ttl(key) <= RENDEZVOUS_TTL_S
    assert store.r.hgetall(key) == {"1:0:0": "10.0.0.5:29500", "1:0:1": "10.0.0.6:1234"}

    change(store, job.id, JobState.RUNNING, round=1)  # the broker replaced a lost node
    moved = {**waiting, "round": 1}
    assert store.rendezvous(job.id, 1, 0, 1, None) == moved  # round 0's master is no answer
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29501") == moved  # late for round 0
    assert store.rendezvous(job.id, 1, 1, 0, "10.0.0.5:29502") == {
        **moved, "master": "10.0.0.5:29502"}

    store.request_cancel(job.id)
    assert store.rendezvous(job.id, 1, 1, 1, None)["action"] == CHECKPOINT_EXIT
    with pytest.raises(JobNotFound):
        store.rendezvous("nope-9", 1, 0, 0, None)


def test_rendezvous_stops_nodes_of_a_job_being_stopped(store: Store) -> None:
    job = change(store, two_node_job(store).id, JobState.RUNNING)
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1")["action"] == CONTINUE
    change(store, job.id, JobState.SUSPENDING)
    assert store.rendezvous(job.id, 1, 0, 1, None) == {
        "round": 0, "nnodes": 2, "master": "10.0.0.5:1", "action": CHECKPOINT_EXIT}


def test_agent_reports_per_node_and_round(store: Store) -> None:
    job = two_node_job(store)
    said = store.record_heartbeat(job.id, 1, node_rank=0, samples_done=500, exit_code=0)
    assert (said.action, said.round) == (CONTINUE, 0)
    # Rank 1's worker measures nothing: its report must not reset rank 0's progress.
    store.record_heartbeat(job.id, 1, node_rank=1, samples_done=0, notice="gcp preempted")
    progress = store.r.hgetall(f"{store.p}progress:{job.id}")
    # rank 0 of round 0 keeps the single-node names, which agents from before write too
    assert progress["exit:1"] == "0" and progress["notice:1:0:1"] == '"gcp preempted"'
    job = store.get_job(job.id)
    assert job is not None and job.samples_done == 500
    report = store.agent_reports([job])[job.id]
    assert (report.exits, report.notices) == ({0: 0}, {1: "gcp preempted"})
    assert (report.exit_code, report.notice) == (0, "gcp preempted")

    store.record_heartbeat(job.id, 1, node_rank=1, exit_code=75)
    store.record_heartbeat(job.id, 1, node_rank=2, exit_code=9)  # no such node in the job
    assert store.agent_reports([job])[job.id].exits == {0: 0, 1: 75}

    job = change(store, job.id, round=1)
    report = store.agent_reports([job])[job.id]  # the new round starts without reports
    assert (report.exits, report.notices, report.exit_code, report.notice) == ({}, {}, None, None)
    assert report.first_beat is not None  # the attempt's agents did report
    said = store.record_heartbeat(job.id, 1, node_rank=1, round=1, exit_code=1,
                                  notice="aws spot instance-action")
    assert (said.action, said.round) == (CONTINUE, 1)
    store.record_heartbeat(job.id, 1, node_rank=0, round=0, exit_code=3)  # a late old round
    report = store.agent_reports([job])[job.id]
    assert (report.exits, report.exit_code) == ({1: 1}, None)
    assert report.notice == "aws spot instance-action"
    assert store.record_heartbeat(job.id, 0, node_rank=1, round=1).round == 1  # stale: told too
