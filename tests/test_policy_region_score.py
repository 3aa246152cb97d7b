"""Region-aware scoring: price, risk (prior + observed), egress, constraints and stickiness."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.migration import Blocklist, mark_preempted, register
from policies.models import Accelerator, Market, Pool
from policies.region_score import (
    Candidate,
    JobNeeds,
    Stickiness,
    eligible,
    expected_cost,
    hazard_per_hour,
)


def cand(cloud: str, region: str, price: float, market: Market = Market.SPOT, **kw) -> Candidate:
    pool = Pool(cloud=cloud, region=region, accelerator=Accelerator.V100, market=market,
                nodes=2, gpus_per_node=8, price_per_gpu_hour=price)  # fmt: skip
    return Candidate(pool=pool, **kw)


def test_observed_preemptions_outweigh_a_good_prior() -> None:
    calm = cand("aws", "us-east-1", 1.0, prior_monthly_rate=0.025)
    seen = calm.model_copy(update={"preemptions_seen": 5, "node_hours_seen": 10})
    assert hazard_per_hour(seen) > 10 * hazard_per_hour(calm)
    assert hazard_per_hour(cand("aws", "us-east-1", 1, Market.ON_DEMAND, preemptions_seen=9)) == 0


@given(st.integers(0, 50), st.integers(0, 50), st.floats(0, 100))
def test_hazard_grows_with_preemptions(a: int, b: int, hours: float) -> None:
    lo, hi = sorted((a, b))
    base = cand("aws", "r", 1.0, prior_monthly_rate=0.1, node_hours_seen=hours)
    assert hazard_per_hour(base.model_copy(update={"preemptions_seen": lo})) <= hazard_per_hour(
        base.model_copy(update={"preemptions_seen": hi})
    )


def test_risky_cheap_spot_loses_to_a_calm_one() -> None:
    needs = JobNeeds(gpus=8, remaining_h=10, restart_h=0.5, checkpoint_interval_h=1)
    risky = cand("aws", "us-east-1", 0.9, preemptions_seen=20, node_hours_seen=10)
    calm = cand("aws", "us-west-2", 1.0, prior_monthly_rate=0.025)
    assert expected_cost(needs, calm) < expected_cost(needs, risky)


def test_egress_keeps_a_big_checkpoint_near_home() -> None:
    home = cand("aws", "us-east-1", 1.00)
    away = cand("gcp", "us-central1", 0.99)
    small = JobNeeds(gpus=8, remaining_h=10, checkpoint_cloud="aws", checkpoint_region="us-east-1")
    big = small.model_copy(update={"checkpoint_gb": 500})
    assert expected_cost(small, away) < expected_cost(small, home)
    assert expected_cost(big, home) < expected_cost(big, away)
    assert expected_cost(big, away) - expected_cost(small, away) == pytest.approx(500 * 0.09)


def test_a_fixed_bucket_prices_every_checkpoint_written_from_elsewhere() -> None:
    """No checkpoint to restore yet, but each one written from gcp crosses to the aws bucket:
    20 writes of 2 GB at $0.09 outweigh the cent per GPU-hour gcp saves."""
    home = cand("aws", "us-east-1", 1.00)
    away = cand("gcp", "us-central1", 0.99)
    anywhere = JobNeeds(gpus=8, remaining_h=10, checkpoint_interval_h=0.5, checkpoint_gb=2)
    pinned = anywhere.model_copy(update={"bucket_cloud": "aws", "bucket_region": "us-east-1"})
    assert expected_cost(anywhere, away) < expected_cost(anywhere, home)
    assert expected_cost(pinned, home) < expected_cost(pinned, away)
    assert expected_cost(pinned, away) - expected_cost(anywhere, away) == pytest.approx(
        10 / 0.5 * 2 * 0.09)
    assert expected_cost(pinned, home) == expected_cost(anywhere, home)  # same region: free


def test_constraints_filter_pools() -> None:
    pools = [
        cand("aws", "us-east-1", 1.0),
        cand("gcp", "europe-west4", 0.5),
        cand("azure", "eastus", 0.7, free_gpus=4),
        cand("aws", "us-west-2", 2.0, Market.ON_DEMAND),
    ]

    def ok(needs: JobNeeds, blocklist: Blocklist | None = None) -> list[Candidate]:
        return [c for c in pools if eligible(needs, c, blocklist, 0.0)]

    needs = JobNeeds(gpus=8, remaining_h=1, deny=["gcp:*"])
    assert ok(needs) == [pools[0], pools[3]]
    assert ok(needs.model_copy(update={"markets": frozenset({Market.ON_DEMAND})})) == [pools[3]]
    assert ok(needs.model_copy(update={"gpus": 17})) == []
    blocked = mark_preempted(register(Blocklist(), ["aws:us-east-1", "aws:us-west-2", "x:y"]),
                             "aws:us-east-1", now=0)  # fmt: skip
    assert ok(needs, blocked) == [pools[3]]


def test_sticky_for_pennies_moves_for_dollars() -> None:
    here, there = cand("aws", "us-east-1", 1.00), cand("aws", "us-west-2", 0.99)
    needs = JobNeeds(gpus=8, remaining_h=2, current_pool=here.pool.id)
    stick = Stickiness()
    assert stick.keeps(expected_cost(needs, here), expected_cost(needs, there))
    cheap = cand("aws", "us-west-2", 0.5)
    assert not stick.keeps(expected_cost(needs, here), expected_cost(needs, cheap))


@given(st.floats(0.1, 1000), st.floats(0, 1000), st.floats(0, 10), st.floats(0, 0.5))
def test_a_move_always_saves_more_than_the_margin(
    stay: float, best: float, usd: float, frac: float
) -> None:
    stick = Stickiness(min_saving_usd=usd, min_saving_fraction=frac)
    if not stick.keeps(stay, best):
        assert stay - best >= stick.threshold(stay)
