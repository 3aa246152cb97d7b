"""The live round's planning, pure (no Redis): a job that accepts several accelerator types gets
an idle one, allocation respects what one pool can host and leaves no GPU idle that a waiting
job could use, admission drop never suspends a running job for a newcomer, and a plain script
(which a move restarts from the beginning) is the last job the round moves; a round holds the
cyclic collector off while it runs."""

from __future__ import annotations

import gc

import pytest

from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.scheduler import Admission, Marks, SchedulerConfig, placement_request, plan_round
from broker.scheduler.round import paused_gc
from broker.store import Snapshot
from policies.elastic_dp import Choice
from policies.models import (
    Accelerator,
    BatchMode,
    BatchRange,
    GpuRange,
    JobSpec,
    Market,
    Pool,
)

NOW = 1_000_000.0


def pool(cloud: str, accel: Accelerator, gpus: int, market: Market = Market.ON_DEMAND,
         price: float = 1.0) -> Pool:
    return Pool(cloud=cloud, region="r1", accelerator=accel, market=market, nodes=1,
                gpus_per_node=gpus, price_per_gpu_hour=price)


def job(name: str, accels: list[Accelerator], gmin: int = 1, gmax: int = 8,
        state: JobState = JobState.QUEUED, at: Pool | None = None, gpus: int = 0,
        priority: int = 0, submitted: float = NOW - 100) -> JobRecord:
    spec = JobSpec(name=name, run="true", accelerators=accels, gpus=GpuRange(min=gmin, max=gmax),
                   batch_size=BatchRange(min=32, max=512), work_samples=10**7, priority=priority)
    running = state is JobState.RUNNING
    return JobRecord(id=f"{name}-1", spec=spec, team="t", state=state,
                     pool=at.id if running and at else None, gpus=gpus if running else 0,
                     batch_size=512 if running else None, attempt=int(running),
                     launched_at=NOW - 3600 if running else None, submitted_at=submitted)


def launches(jobs: list[JobRecord], pools: list[Pool],
             config: SchedulerConfig | None = None) -> dict[str, tuple[str, int]]:
    res = plan_round(Snapshot(jobs, pools, []), 1, config or SchedulerConfig(), NOW)
    return {i["job"]: (i["pool"], int(i["gpus"])) for i in (_intent(x) for x in
                                                             res.plan.intents_add)
            if i["kind"] == IntentKind.LAUNCH.value}


def _intent(entry: dict[str, str]) -> dict[str, str]:
    i = Intent.model_validate_json(entry["json"])
    return {"kind": i.kind.value, "job": i.job_id, "pool": i.pool or "", "gpus": str(i.gpus)}


def test_a_job_that_accepts_two_types_takes_the_idle_one() -> None:
    """A100 is full with a running job; 8 V100 are idle: the A100-or-V100 job runs on V100."""
    a100, v100 = pool("aws", Accelerator.A100, 8), pool("gcp", Accelerator.V100, 8)
    busy = job("busy", [Accelerator.A100], gmin=8, state=JobState.RUNNING, at=a100, gpus=8)
    either = job("either", [Accelerator.A100, Accelerator.V100])
    got = launches([busy, either], [a100, v100])
    assert got == {either.id: (v100.id, 8)}


def test_two_types_two_jobs_each_get_a_type() -> None:
    """Two jobs that accept both types and two idle 4-GPU pools of different types: both run."""
    t4, v100 = pool("aws", Accelerator.T4, 4), pool("gcp", Accelerator.V100, 4)
    both = [Accelerator.T4, Accelerator.V100]
    got = launches([job("a", both), job("b", both)], [t4, v100])
    assert sorted(got.values()) == sorted([(t4.id, 4), (v100.id, 4)])


def test_no_count_that_no_single_pool_hosts() -> None:
    """Two 4-GPU T4 pools in two clouds: a 1-8 GPU job is given 4 (one pool's), not 8 that
    placement then cuts down; a second such job gets the other pool, none idles."""
    east, west = pool("aws", Accelerator.T4, 4), pool("gcp", Accelerator.T4, 4, price=1.1)
    one = launches([job("a", [Accelerator.T4])], [east, west])
    assert one == {"a-1": (east.id, 4)}
    two = launches([job("a", [Accelerator.T4]), job("b", [Accelerator.T4])], [east, west])
    assert sorted(two.values()) == sorted([(east.id, 4), (west.id, 4)])


def test_fragmentation_repair_fills_the_room_left() -> None:
    """Pools of 6 and 2 GPUs, three jobs of 1-4 GPUs: whatever the allocator's first split, the
    waiting jobs are fitted into the room each pool has left: all 8 GPUs are given out."""
    big, small = pool("aws", Accelerator.T4, 6), pool("gcp", Accelerator.T4, 2, price=1.1)
    jobs = [job(n, [Accelerator.T4], gmax=4) for n in "abc"]
    got = launches(jobs, [big, small])
    assert len(got) == 3
    assert sum(g for _, g in got.values()) == 8


def test_admission_drop_never_suspends_a_running_job_for_a_newcomer() -> None:
    """Two jobs run on all 8 GPUs under admission drop. A priority-100 newcomer that needs 8
    GPUs does not fit beside them: it is dropped and they keep running. One that needs 4 fits
    beside their smallest sizes: it is admitted, and they shrink (elastic) but are never
    suspended."""
    t4 = pool("aws", Accelerator.T4, 8)
    running = [job(n, [Accelerator.T4], gmax=4, state=JobState.RUNNING, at=t4, gpus=4)
               for n in ("a", "b")]
    drop = SchedulerConfig(admission=Admission.DROP)
    big = job("big", [Accelerator.T4], gmin=8, gmax=8, priority=100)
    res = plan_round(Snapshot([*running, big], [t4], []), 1, drop, NOW)
    assert res.dropped == 1 and not res.plan.intents_add
    vip = job("vip", [Accelerator.T4], gmin=4, gmax=8, priority=100)
    res = plan_round(Snapshot([*running, vip], [t4], []), 1, drop, NOW)
    kinds = {_intent(i)["job"]: _intent(i)["kind"] for i in res.plan.intents_add}
    assert res.dropped == 0
    assert all(kinds.get(j.id) in (None, "resize") for j in running)
    assert kinds.get(vip.id) is None  # it launches once the shrinking jobs free their GPUs


def test_under_queue_admission_priority_still_preempts() -> None:
    """Admission queue keeps priority as a weight: the priority-100 job gets GPUs."""
    t4 = pool("aws", Accelerator.T4, 8)
    running = [job(n, [Accelerator.T4], gmax=4, state=JobState.RUNNING, at=t4, gpus=4)
               for n in ("a", "b")]
    vip = job("vip", [Accelerator.T4], gmin=4, gmax=8, priority=100)
    res = plan_round(Snapshot([*running, vip], [t4], []), 1, SchedulerConfig(), NOW)
    assert res.suspends + res.resizes >= 1


def test_a_plain_script_is_not_the_one_shrunk() -> None:
    """Two jobs run on all 8 GPUs for an hour and a 2-GPU newcomer arrives: one of them gives
    up 2 GPUs. Whichever is a plain script (a resize restarts it from step 0: an hour's work
    lost) keeps its GPUs; the resumable one (a resize costs a relaunch) shrinks."""
    t4 = pool("aws", Accelerator.T4, 8)
    newcomer = job("c", [Accelerator.T4], gmin=2, gmax=2)
    for plain in ("a-1", "b-1"):
        running = [job(n, [Accelerator.T4], gmax=4, state=JobState.RUNNING, at=t4, gpus=4)
                   .model_copy(update={"resumable": f"{n}-1" != plain}) for n in ("a", "b")]
        res = plan_round(Snapshot([*running, newcomer], [t4], []), 1, SchedulerConfig(), NOW)
        changed = {_intent(i)["job"]: _intent(i)["kind"] for i in res.plan.intents_add}
        other = ({"a-1", "b-1"} - {plain}).pop()
        assert changed == {other: "resize"}


def test_a_plain_script_stays_where_a_resumable_job_would_move() -> None:
    """A cheaper pool opens while a job has run an hour and has 1.6 hours left: a resumable
    job moves (its relaunch costs less than the saving), a plain script stays (moving loses
    the hour it ran, which placement prices into the move)."""
    dear, cheap = pool("aws", Accelerator.T4, 4, price=1.2), pool("gcp", Accelerator.T4, 4)
    moved = {}
    for resumable in (True, False):
        running = job("a", [Accelerator.T4], gmin=4, gmax=4, state=JobState.RUNNING, at=dear,
                      gpus=4).model_copy(update={"resumable": resumable})
        req = placement_request(running, Choice(4, 512, 1.0), [], Marks(), {}, SchedulerConfig(),
                                now=NOW)
        assert req.restart_h == (60 + 3600 * (not resumable)) / 3600  # the attempt ran 1 h
        res = plan_round(Snapshot([running], [dear, cheap], []), 1, SchedulerConfig(), NOW)
        moved[resumable] = [(_intent(i)["kind"], _intent(i)["pool"]) for i in
                            res.plan.intents_add]
    assert moved == {True: [("migrate", cheap.id)], False: []}


def test_a_script_with_its_own_checkpoints_is_priced_as_losing_the_work_since_the_newest(
        ) -> None:
    """A job has run an hour. Committing its own DCP checkpoints (its agent saw the newest 10
    minutes ago), a restart loses those 10 minutes, not the hour a plain script loses; one it
    resumed from, older than the attempt, leaves the attempt's hour to lose; a job on the
    runtime (no commit time: it checkpoints at the stop) loses nothing. A preemption adds no
    checkpoint interval on top for the script: the spec's is the runtime's, not the script's."""
    dear = pool("aws", Accelerator.T4, 4, price=1.2)
    running = job("a", [Accelerator.T4], gmin=4, gmax=4, state=JobState.RUNNING, at=dear, gpus=4)
    config = SchedulerConfig(checkpoint_on_notice=False)

    def priced(**update: object) -> tuple[float, float]:
        req = placement_request(running.model_copy(update=update), Choice(4, 512, 1.0), [],
                                Marks(), {}, config, now=NOW)
        return req.restart_h * 3600, req.checkpoint_interval_h * 3600

    own = priced(resumable=True, checkpoint_step=40, checkpoint_at=NOW - 600)
    assert own == (pytest.approx(config.restart_s + 600), 0.0)
    assert priced(resumable=True, checkpoint_at=NOW - 7200)[0] == \
        pytest.approx(config.restart_s + 3600)
    assert priced(resumable=False)[0] == pytest.approx(config.restart_s + 3600)
    runtime = priced(resumable=True, checkpoint_step=40)
    assert runtime[0] == config.restart_s and runtime[1] > 0


def test_only_a_job_that_resizes_in_place_is_priced_at_the_in_place_cost() -> None:
    """A job runs on 4 of its one node's 8 GPUs at a fixed batch; the others are idle. With a
    restart worth a third of the plan's horizon (restart_s 600 of 1800), the grow to 8 is a
    smaller gain than that (at most 2 ** 0.25): a job whose agent said its workers re-form in
    place grows on its node (it costs resize_in_place_s), one whose agent said they restart (a
    framework integration, FSDP), or that has not said yet, keeps its 4 GPUs."""
    node = pool("aws", Accelerator.T4, 8)
    spec = job("a", [Accelerator.T4]).spec.model_copy(update={
        "batch_size": BatchRange(min=32, max=512, default=512), "batch_mode": BatchMode.FIXED})
    config = SchedulerConfig(restart_s=600.0)
    assert config.resize_in_place_s < 1  # the measured figure, not the restart
    grown = {}
    for in_place in (True, False, None):
        running = job("a", [Accelerator.T4], state=JobState.RUNNING, at=node, gpus=4).model_copy(
            update={"spec": spec, "samples_done": 5120, "resize_in_place": in_place})
        res = plan_round(Snapshot([running], [node], []), 1, config, NOW)
        grown[in_place] = [(_intent(i)["kind"], _intent(i)["gpus"]) for i in
                           res.plan.intents_add]
    assert grown == {True: [("resize-in-place", "8")], False: [], None: []}


def test_a_round_holds_the_collector_off_and_gives_it_back() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError("a round that fails still resumes collection")
    assert gc.isenabled()
    gc.disable()  # a process that keeps it off keeps it off
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
