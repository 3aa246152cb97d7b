"""The store's side of multi-node jobs against a real redis-server: the rendezvous (rank 0's
address for the job's current attempt and round) and per-node agent reports (exit codes and
preemption notices per rank and round)."""

from __future__ import annotations

import pytest

from broker.models import JobRecord, JobState
from broker.protocol import CHECKPOINT_EXIT, CONTINUE
from broker.store import RENDEZVOUS_TTL_S, JobNotFound, Plan, Store
from policies.models import Accelerator
from providers.base import replacement_key
from tests.test_store import spec

LAUNCH = "train-1:3:1"  # the launch's idempotency key (job:fence:attempt)


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


def test_rendezvous_names_the_master_once_every_rank_checked_in(store: Store) -> None:
    """A barrier: rank 0's address is handed out only once every node of the job's current
    attempt and round checked in, so no node starts torch's init while another still boots."""
    job = two_node_job(store)
    waiting = {"round": 0, "nnodes": 2, "master": None, "addrs": None, "action": CONTINUE}
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29500") == waiting  # rank 0 alone
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29500") == waiting
    assert store.rendezvous(job.id, 1, 1, 1, None) == waiting  # a round not yet begun
    assert store.rendezvous(job.id, 1, 0, 2, None) == waiting  # no rank 2 in a 2-node job
    stale = store.rendezvous(job.id, 0, 0, 1, None)
    assert stale == {**waiting, "action": CHECKPOINT_EXIT}  # an old attempt must stop
    key = f"{store.p}rdzv:{job.id}"
    assert store.r.hgetall(key) == {"1:0:0": "10.0.0.5:29500"}  # none of those checked in

    met = {**waiting, "master": "10.0.0.5:29500", "addrs": ["10.0.0.5:29500", ""]}
    assert store.rendezvous(job.id, 1, 0, 1, None) == met  # the last one in: the group formed
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29500") == met
    # every rank's address, by rank (SKYPILOT_NODE_IPS): another rank may give its own
    both = {**met, "addrs": ["10.0.0.5:29500", "10.0.0.6:1234"]}
    assert store.rendezvous(job.id, 1, 0, 1, "10.0.0.6:1234") == both
    assert store.rendezvous(job.id, 1, 0, 1, None) == both  # a visit without one keeps it
    assert store.rendezvous(job.id, 0, 0, 1, None)["master"] is None  # nothing for the stale
    assert 0 < store.r.ttl(key) <= RENDEZVOUS_TTL_S
    assert store.r.hgetall(key) == {"1:0:0": "10.0.0.5:29500", "1:0:1": "10.0.0.6:1234"}

    change(store, job.id, JobState.RUNNING, round=1)  # the broker replaced a lost node
    moved = {**waiting, "round": 1}
    assert store.rendezvous(job.id, 1, 0, 1, None) == moved  # round 0's master is no answer
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:29501") == moved  # late for round 0
    assert store.rendezvous(job.id, 1, 1, 0, "10.0.0.5:29502") == moved  # the stand-in is due
    assert store.rendezvous(job.id, 1, 1, 1, None) == {
        **moved, "master": "10.0.0.5:29502", "addrs": ["10.0.0.5:29502", ""]}

    change(store, job.id, round=2)  # rank 0 without an address has not checked in
    assert store.rendezvous(job.id, 1, 2, 0, None)["master"] is None
    assert store.rendezvous(job.id, 1, 2, 1, None)["master"] is None
    store.request_cancel(job.id)
    assert store.rendezvous(job.id, 1, 2, 1, None)["action"] == CHECKPOINT_EXIT
    with pytest.raises(JobNotFound):
        store.rendezvous("nope-9", 1, 0, 0, None)


def test_the_master_handed_out_never_changes(store: Store) -> None:
    """Before the barrier releases rank 0 may register again (a new port); once every rank
    checked in, its address is frozen: a second registration must not move the master that
    other nodes already got."""
    job = two_node_job(store)
    store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1000")
    store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1001")  # not yet handed out: it may move
    assert store.rendezvous(job.id, 1, 0, 1, None)["master"] == "10.0.0.5:1001"
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.9:2000")["master"] == "10.0.0.5:1001"
    assert store.rendezvous(job.id, 1, 0, 1, None)["master"] == "10.0.0.5:1001"
    assert store.r.hget(f"{store.p}rdzv:{job.id}", "1:0:0") == "10.0.0.5:1001"


def replaced_job(store: Store) -> JobRecord:
    """A running 2-node job whose rank 1 was replaced in round 2 (after a loss in round 1)."""
    job = two_node_job(store)
    return change(store, job.id, JobState.RUNNING, launch_key=LAUNCH, round=2,
                  stand_ins={1: 2})


def test_a_replaced_rank_counts_only_with_its_stand_ins_key(store: Store) -> None:
    """The barrier counts machines, not ranks: rank 1's old node (given up on, yet holding the
    attempt's token) and its earlier stand-in are told to stop and record nothing; only the node
    holding rank 1's current key, the round-2 stand-in's, checks in and releases the master."""
    job = replaced_job(store)
    superseded = {"round": 2, "nnodes": 2, "master": None, "addrs": None,
                  "action": CHECKPOINT_EXIT}
    assert store.rendezvous(job.id, 1, 2, 0, "10.0.0.5:1", LAUNCH)["action"] == CONTINUE
    for old in (LAUNCH, replacement_key(LAUNCH, 1, 1), None):  # None: an agent before keys
        assert store.rendezvous(job.id, 1, 2, 1, None, old) == superseded, old
    # rank 0 is still the launch's own node: a stand-in's key is not its
    assert store.rendezvous(job.id, 1, 2, 0, "10.0.0.6:1", replacement_key(LAUNCH, 0, 2)
                            ) == superseded
    assert store.checked_in([job]) == {job.id: {0}}
    assert store.r.hgetall(f"{store.p}rdzv:{job.id}") == {"1:2:0": "10.0.0.5:1"}

    got = store.rendezvous(job.id, 1, 2, 1, None, replacement_key(LAUNCH, 1, 2))
    assert got == {**superseded, "master": "10.0.0.5:1", "addrs": ["10.0.0.5:1", ""],
                   "action": CONTINUE}
    assert store.rendezvous(job.id, 1, 2, 0, None, LAUNCH)["master"] == "10.0.0.5:1"
    assert store.rendezvous(job.id, 1, 2, 1, None, LAUNCH) == superseded  # still refused


def test_a_node_without_the_launch_key_is_told_to_stop(store: Store) -> None:
    """A job launched with a key takes only the nodes that hold it (or their stand-ins'): a
    report without a key, or with another, records nothing and is told to stop."""
    job = change(store, two_node_job(store).id, launch_key=LAUNCH)
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1", None)["action"] == CHECKPOINT_EXIT
    assert store.record_heartbeat(job.id, 1, node_rank=0, exit_code=0).action == CHECKPOINT_EXIT
    assert store.rendezvous(job.id, 1, 0, 1, None, "other-1:1:1")["action"] == CHECKPOINT_EXIT
    assert store.checked_in([job]) == {job.id: set()}
    assert store.r.hget(f"{store.p}progress:{job.id}", "exit:1:0:0") is None
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1", LAUNCH)["action"] == CONTINUE
    assert store.rendezvous(job.id, 1, 0, 1, None, LAUNCH)["master"] == "10.0.0.5:1"


def test_heartbeats_keep_the_rendezvous_record_while_the_gang_trains(store: Store) -> None:
    """Who checked in stays readable however long the gang trains after it formed: each
    heartbeat renews the record's expiry (the reconciler reads it to tell a silent node)."""
    job = change(store, two_node_job(store).id, launch_key=LAUNCH)
    store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1", LAUNCH)
    store.rendezvous(job.id, 1, 0, 1, None, LAUNCH)
    rdzv = f"{store.p}rdzv:{job.id}"
    store.r.expire(rdzv, 5)  # as a day after the group formed
    store.record_heartbeat(job.id, 1, node_rank=1, launch_key=LAUNCH)
    assert store.r.ttl(rdzv) > RENDEZVOUS_TTL_S - 60
    assert store.checked_in([job]) == {job.id: {0, 1}}


def test_a_replaced_node_reports_nothing(store: Store) -> None:
    """A replaced node's heartbeats, its final report included, record nothing (its exit code
    would pass for the stand-in's) and tell it to stop; the current nodes' are taken."""
    job = replaced_job(store)
    key = f"{store.p}progress:{job.id}"
    for old in (LAUNCH, replacement_key(LAUNCH, 1, 1), None):
        said = store.record_heartbeat(job.id, 1, node_rank=1, round=2, launch_key=old,
                                      exit_code=75, notice="gcp preempted")
        assert (said.action, said.round) == (CHECKPOINT_EXIT, 2), old
    said = store.record_heartbeat(job.id, 1, node_rank=0, round=2,
                                  launch_key=replacement_key(LAUNCH, 0, 2), samples_done=10)
    assert said.action == CHECKPOINT_EXIT
    assert store.r.hgetall(key) == {}  # not even liveness

    said = store.record_heartbeat(job.id, 1, node_rank=0, round=2, launch_key=LAUNCH,
                                  samples_done=500)
    assert (said.action, said.round) == (CONTINUE, 2)
    store.record_heartbeat(job.id, 1, node_rank=1, round=2,
                           launch_key=replacement_key(LAUNCH, 1, 2), exit_code=3)
    got = store.get_job(job.id)
    assert got is not None and got.samples_done == 500
    assert store.agent_reports([got])[got.id].exits == {1: 3}


def test_checked_in_names_the_ranks_of_the_current_attempt_and_round(store: Store) -> None:
    job, solo = two_node_job(store), change(store, store.submit(spec(), team="t").id,
                                            JobState.LAUNCHING, attempt=1)
    assert store.checked_in([job, solo]) == {job.id: set(), solo.id: set()}
    store.rendezvous(job.id, 1, 0, 1, None)
    store.rendezvous(job.id, 1, 1, 0, "10.0.0.5:1")  # a round not yet begun
    store.rendezvous(job.id, 1, 0, 3, None)  # a rank the job lacks
    assert store.checked_in([job]) == {job.id: {1}}
    store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1")
    assert store.checked_in([job, solo]) == {job.id: {0, 1}, solo.id: set()}

    job = change(store, job.id, round=1)  # rank 1 lost: its stand-in must check in anew
    store.rendezvous(job.id, 1, 1, 0, "10.0.0.5:2")
    assert store.checked_in([job]) == {job.id: {0}}
    store.rendezvous(job.id, 1, 1, 1, None)
    assert store.checked_in([job]) == {job.id: {0, 1}}
    job = change(store, job.id, attempt=2, round=0)  # a new attempt starts with no one
    assert store.checked_in([job]) == {job.id: set()}
    assert store.checked_in([]) == {}


def test_rendezvous_stops_nodes_of_a_job_being_stopped(store: Store) -> None:
    job = change(store, two_node_job(store).id, JobState.RUNNING)
    assert store.rendezvous(job.id, 1, 0, 0, "10.0.0.5:1")["action"] == CONTINUE
    change(store, job.id, JobState.SUSPENDING)
    assert store.rendezvous(job.id, 1, 0, 1, None) == {
        "round": 0, "nnodes": 2, "master": "10.0.0.5:1", "addrs": ["10.0.0.5:1", ""],
        "action": CHECKPOINT_EXIT}


def test_agent_reports_per_node_and_round(store: Store) -> None:
    job = two_node_job(store)
    said = store.record_heartbeat(job.id, 1, node_rank=0, samples_done=500, exit_code=0)
    assert (said.action, said.round) == (CONTINUE, 0)
    # Rank 1's worker measures nothing: its report must not reset rank 0's progress.
    store.record_heartbeat(job.id, 1, node_rank=1, samples_done=0, notice="gcp preempted")
    progress = store.r.hgetall(f"{store.p}progress:{job.id}")
    assert progress["exit:1:0:0"] == "0" and progress["notice:1:0:1"] == '"gcp preempted"'
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


def test_heartbeats_of_a_round_or_rank_the_job_lacks_record_nothing(store: Store) -> None:
    """A report naming a later round or a rank beyond the job's nodes is dropped; progress comes
    from rank 0 of the current round only (an older round's rank 0 must not reset it)."""
    job = change(store, two_node_job(store).id, JobState.RUNNING, round=1)
    key = f"{store.p}progress:{job.id}"
    said = store.record_heartbeat(job.id, 1, node_rank=1, round=2, exit_code=1, notice="gcp")
    assert (said.action, said.round) == (CONTINUE, 1)  # told the round, nothing recorded
    store.record_heartbeat(job.id, 1, node_rank=2, round=1, exit_code=9, notice="aws")
    assert not [f for f in store.r.hgetall(key) if f.startswith(("exit:", "notice:"))]

    store.record_heartbeat(job.id, 1, node_rank=0, round=1, samples_done=500,
                           samples_per_sec=40.0, world_size=2, global_batch_size=64,
                           checkpoint_step=7, checkpoint_bytes=1000, accelerator=Accelerator.T4)
    # rank 0 of round 0 (the survivor before it re-forms the group) and rank 1: no progress
    for rank, round_ in ((0, 0), (1, 1)):
        store.record_heartbeat(job.id, 1, node_rank=rank, round=round_, samples_done=20,
                               samples_per_sec=5.0, world_size=1, global_batch_size=8,
                               checkpoint_step=1, checkpoint_bytes=10, exit_code=75)
    got = store.get_job(job.id)
    assert got is not None
    assert (got.samples_done, got.samples_per_sec, got.checkpoint_step, got.checkpoint_bytes,
            got.measured_gpus, got.measured) == (500, 40.0, 7, 1000, 2, {"T4:2x64": 40.0})
    # their exit codes count: rank 0's in round 0, rank 1's in the current round
    assert store.r.hget(key, "exit:1:0:0") == "75"
    assert store.agent_reports([got])[got.id].exits == {1: 75}
    store.record_heartbeat(job.id, 1, node_rank=0, round=2, samples_done=900)  # a later round
    assert store.get_job(job.id).samples_done == 500  # type: ignore[union-attr]
