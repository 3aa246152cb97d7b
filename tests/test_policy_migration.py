"""SpotHedge-style blocklist: block, cheapest free active location, reset, decay, JSON."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.migration import (
    Blocklist,
    Recovery,
    choose_location,
    expire,
    location_keys,
    mark_launched,
    mark_preempted,
    recover_lost_nodes,
    register,
)
from policies.models import Accelerator, Market, Pool

LOCS = ["aws:us-east-1", "aws:us-west-2", "gcp:us-central1", "azure:eastus"]
PRICES = {"aws:us-east-1": 1.0, "aws:us-west-2": 1.2, "gcp:us-central1": 0.9, "azure:eastus": 1.5}


def test_preempted_location_is_skipped_until_it_decays() -> None:
    s = register(Blocklist(decay_s=600), LOCS)
    assert choose_location(s, PRICES, now=0) == "gcp:us-central1"
    s = mark_preempted(s, "gcp:us-central1", now=10)
    assert choose_location(s, PRICES, now=20) == "aws:us-east-1"
    assert choose_location(s, PRICES, now=700) == "gcp:us-central1"  # the mark decayed
    assert expire(s, now=700).preempted == {}


def test_cheapest_location_not_in_use() -> None:
    s = register(Blocklist(), LOCS)
    assert choose_location(s, PRICES, in_use=["gcp:us-central1"]) == "aws:us-east-1"
    assert choose_location(s, PRICES, in_use=LOCS) == "gcp:us-central1"


def test_reset_when_fewer_than_two_remain_active() -> None:
    s = register(Blocklist(), LOCS)
    for loc in LOCS[:2]:
        s = mark_preempted(s, loc, now=1)
    assert len(s.active(1)) == 2
    s = mark_preempted(s, LOCS[2], now=2)
    assert s.preempted == {} and s.active(2) == LOCS


def test_successful_launch_reactivates() -> None:
    s = mark_preempted(register(Blocklist(), LOCS), "aws:us-east-1", now=0)
    assert mark_launched(s, "aws:us-east-1").active(0) == LOCS


def test_state_round_trips_through_json() -> None:
    s = mark_preempted(register(Blocklist(decay_s=120), LOCS), "azure:eastus", now=5)
    assert Blocklist.model_validate_json(s.model_dump_json()) == s


def test_zone_pools_fall_under_region_and_zone_keys() -> None:
    pool = Pool(
        cloud="gcp",
        region="us-central1",
        zone="us-central1-a",
        accelerator=Accelerator.A100,
        market=Market.SPOT,
        nodes=1,
        gpus_per_node=8,
    )
    assert location_keys(pool) == ["gcp:us-central1", "gcp:us-central1/us-central1-a"]


events = st.lists(st.tuples(st.sampled_from(LOCS), st.floats(0, 10_000)), max_size=30)


@given(events)
def test_at_least_two_active_after_any_preemptions(ev: list[tuple[str, float]]) -> None:
    s = register(Blocklist(decay_s=1_000), LOCS)
    now = 0.0
    for loc, dt in ev:
        now += dt
        s = mark_preempted(s, loc, now)
        assert len(s.active(now)) >= 2
        chosen = choose_location(s, PRICES, now=now)
        assert chosen is not None and not s.is_blocked(chosen, now)


def test_lost_node_is_replaced_without_restarting_the_job() -> None:
    kw = {"can_rejoin": True, "elastic": False, "replacement_available": True}
    assert recover_lost_nodes(4, 1, location_blocked=False, **kw) is Recovery.REPLACE
    # The location was just reclaimed: an elastic job carries on with its survivors instead.
    elastic = {**kw, "elastic": True}
    assert (
        recover_lost_nodes(4, 1, location_blocked=True, min_nodes=2, **elastic) is Recovery.SHRINK
    )
    assert (
        recover_lost_nodes(4, 3, location_blocked=True, min_nodes=2, **elastic) is Recovery.REPLACE
    )
    no_room = {**kw, "replacement_available": False}
    assert recover_lost_nodes(4, 1, location_blocked=False, **no_room) is Recovery.MIGRATE
    rigid = {**kw, "can_rejoin": False}
    assert recover_lost_nodes(4, 1, location_blocked=False, **rigid) is Recovery.MIGRATE
    assert recover_lost_nodes(2, 2, location_blocked=False, **kw) is Recovery.MIGRATE


@given(
    st.integers(1, 16), st.integers(1, 16), st.booleans(), st.booleans(), st.booleans(),
    st.booleans(), st.integers(1, 16),
)  # fmt: skip
def test_recovery_never_keeps_a_job_below_its_minimum(
    nodes: int, lost: int, rejoin: bool, elastic: bool, room: bool, blocked: bool, min_nodes: int
) -> None:
    lost = min(lost, nodes)
    got = recover_lost_nodes(nodes, lost, can_rejoin=rejoin, elastic=elastic, min_nodes=min_nodes,
                             replacement_available=room, location_blocked=blocked)  # fmt: skip
    if got is Recovery.SHRINK:
        assert elastic and nodes - lost >= min_nodes
    if got is Recovery.REPLACE:
        assert rejoin and room and nodes > lost
    if not rejoin:
        assert got is Recovery.MIGRATE
