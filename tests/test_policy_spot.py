"""Deadline-aware spot/on-demand: on pace, never late with slack, no-preempt jobs stay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.models import Market
from policies.spot import DeadlineJob, choose_market, holds_pace


def simulate(
    total: float, deadline: float, restart: float, avail: list[bool], must_not_preempt: bool = False
) -> tuple[float, float, float]:
    """Run the rule on a spot availability trace; return (finish time, spot hours, on-demand hours).

    Progress is checkpointed every step; a (re)start or a switch costs ``restart`` hours. The
    finish time is the moment the work completes (within its step)."""
    dt = restart / 2 if restart else 0.05
    t = progress = overhead = spot_h = od_h = 0.0
    current: Market | None = None
    step = 0
    while True:
        spot = avail[step % len(avail)]
        if current is Market.SPOT and not spot:
            current = None  # preempted
        job = DeadlineJob(
            total_h=total, progress_h=progress, elapsed_h=t, deadline_h=deadline,
            restart_h=restart, current=current, must_not_preempt=must_not_preempt,
        )  # fmt: skip
        market = choose_market(job, spot)
        assert market is not Market.SPOT or spot
        if market is not current:
            overhead = restart if market is not None else 0.0
            current = market
        if current is not None:
            lost = min(dt, overhead)
            overhead -= lost
            done = progress + dt - lost >= total  # completes within this step
            held = lost + (total - progress) if done else dt
            if current is Market.SPOT:
                spot_h += held
            else:
                od_h += held
            if done:
                return t + held, spot_h, od_h
            progress += dt - lost
        t += dt
        step += 1
        assert t < 10 * deadline, "the job never finishes"


traces = st.lists(st.booleans(), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    total=st.floats(1, 20),
    slack=st.floats(0, 20),
    restart=st.sampled_from([0.05, 0.1, 0.25]),
    avail=traces,
)
def test_deadline_is_met_when_the_slack_covers_the_restarts(
    total: float, slack: float, restart: float, avail: list[bool]
) -> None:
    deadline = total + 3 * restart + slack
    finish, _, _ = simulate(total, deadline, restart, avail)
    assert finish <= deadline + 1e-6


@given(total=st.floats(1, 10), restart=st.sampled_from([0.05, 0.1]))
def test_always_available_spot_uses_no_on_demand(total: float, restart: float) -> None:
    _, spot_h, od_h = simulate(total, total * 2 + 1, restart, [True])
    assert od_h == 0 and spot_h > 0


@given(total=st.floats(1, 10), avail=traces)
def test_must_not_preempt_stays_on_on_demand(total: float, avail: list[bool]) -> None:
    _, spot_h, od_h = simulate(total, total * 3, 0.1, avail, must_not_preempt=True)
    assert spot_h == 0 and od_h > 0


def test_waits_for_spot_when_ahead_and_falls_back_when_behind() -> None:
    ahead = DeadlineJob(total_h=10, progress_h=6, elapsed_h=5, deadline_h=20, restart_h=0.1)
    behind = ahead.model_copy(update={"progress_h": 1})
    assert choose_market(ahead, spot_available=False) is None
    assert choose_market(behind, spot_available=False) is Market.ON_DEMAND
    assert choose_market(behind, spot_available=True) is Market.SPOT


def test_no_deadline_never_buys_on_demand() -> None:
    job = DeadlineJob(total_h=10, progress_h=0, elapsed_h=100, restart_h=0.1)
    assert choose_market(job, True) is Market.SPOT and choose_market(job, False) is None


def test_without_slack_goes_on_demand_even_with_spot() -> None:
    tight = DeadlineJob(total_h=10, progress_h=5, elapsed_h=9.85, deadline_h=15, restart_h=0.1)
    assert tight.slack_h <= 0.2 and choose_market(tight, True) is Market.ON_DEMAND


def test_spot_only_saves_money_against_on_demand_on_a_trace() -> None:
    # 2 h of every 3 spot is there: most hours run on spot and the deadline holds.
    avail = [True] * 8 + [False] * 4
    finish, spot_h, od_h = simulate(10, 16, 0.1, avail)
    assert finish <= 16 and spot_h > od_h


def test_holds_pace_only_without_slack_to_give_away() -> None:
    job = DeadlineJob(total_h=10, progress_h=0, elapsed_h=0, deadline_h=10.25, restart_h=0.1)
    assert job.slack_h <= job.return_h and holds_pace(job)
    assert not holds_pace(job.model_copy(update={"deadline_h": 10.5}))
    assert not holds_pace(job.model_copy(update={"deadline_h": None}))


def test_on_demand_job_waits_for_spot_only_once_clearly_ahead_of_pace() -> None:
    # on on-demand, spot gone: a job just ahead of its pace keeps on-demand (leaving it to wait
    # would have it behind pace and relaunching a round later); one clearly ahead may wait
    on_od = DeadlineJob(total_h=10, progress_h=5.01, elapsed_h=10, deadline_h=20, restart_h=0.1,
                        current=Market.ON_DEMAND)
    assert not on_od.behind_pace and on_od.slack_h > on_od.return_h
    assert choose_market(on_od, spot_available=False) is Market.ON_DEMAND
    ahead = on_od.model_copy(update={"progress_h": 6})
    assert choose_market(ahead, spot_available=False) is None
    idle = on_od.model_copy(update={"current": None})
    assert choose_market(idle, spot_available=False) is None  # not on it: CBL's waiting rule


def test_an_elastic_recovery_keeps_a_job_on_spot_that_the_plain_net_sends_to_on_demand() -> None:
    # 0.15 h of slack at its own size: one preemption (0.1 h) plus the restart onto spot (0.1 h)
    # does not fit, so Can't Be Late's net sends it to on-demand; with on-demand room held
    # where its work left takes 2 h instead of 5, a preemption leaves it 3 h: spot is safe
    job = DeadlineJob(total_h=10, progress_h=5, elapsed_h=9.85, deadline_h=15, restart_h=0.1)
    assert job.recovery_slack_h == job.slack_h and choose_market(job, True) is Market.ON_DEMAND
    held = job.model_copy(update={"recover_h": 2.0})
    assert held.recovery_slack_h == pytest.approx(3.15) and held.recovery_slack_h > held.net_h
    assert choose_market(held, True) is Market.SPOT
    # the recovery covers no preemption once the deadline is closer than its hours plus a net
    late = held.model_copy(update={"elapsed_h": 12.9})
    assert choose_market(late, True) is Market.ON_DEMAND
    # spot gone, behind pace: on-demand as before; a recovery never outlasts the work left
    assert choose_market(held, False) is Market.ON_DEMAND
    assert job.model_copy(update={"recover_h": 9.0}).recovery_slack_h == job.slack_h
