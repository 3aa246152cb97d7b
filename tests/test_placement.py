"""Region placement (price, preemption risk, checkpoint egress) and the throughput model (pure
policies)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.models import Accelerator, Market, Pool, SpotPolicy
from policies.placement import PlacementRequest, PlacementResult, PoolRisk, eligible, place
from policies.throughput import ThroughputModel, batch_candidates


def pool(region: str, market: Market, price: float, gpus: int, cloud: str = "aws") -> Pool:
    return Pool(cloud=cloud, region=region, accelerator=Accelerator.T4, market=market, nodes=1,
                gpus_per_node=gpus, price_per_gpu_hour=price)


SPOT_A = pool("a", Market.SPOT, 0.2, 4)
SPOT_B = pool("b", Market.SPOT, 0.3, 4, cloud="gcp")
OD_C = pool("c", Market.ON_DEMAND, 0.9, 4)


def test_cheapest_pool_then_current_pool_is_kept() -> None:
    got = place([PlacementRequest("j1", 2)], [SPOT_A, SPOT_B, OD_C])
    assert got == {"j1": PlacementResult(SPOT_A.id, 2)}
    got = place([PlacementRequest("j1", 2, current_pool=SPOT_B.id)], [SPOT_A, SPOT_B, OD_C])
    assert got["j1"] == PlacementResult(SPOT_B.id, 2)


def test_spot_never_and_region_globs() -> None:
    pools = [SPOT_A, SPOT_B, OD_C]
    assert place([PlacementRequest("j", 1, spot=SpotPolicy.NEVER)], pools)["j"].pool == OD_C.id
    denied = PlacementRequest("j", 1, deny=["aws:*"])
    assert place([denied], pools)["j"].pool == SPOT_B.id
    allowed = PlacementRequest("j", 1, allow=["aws:c"])
    assert place([allowed], pools)["j"].pool == OD_C.id
    assert place([PlacementRequest("j", 1, allow=["azure:*"])], pools)["j"] is None


def test_spot_preferred_beats_cheaper_on_demand() -> None:
    cheap_od = pool("d", Market.ON_DEMAND, 0.1, 4)
    got = place([PlacementRequest("j", 1, spot=SpotPolicy.PREFERRED)], [cheap_od, SPOT_B])
    assert got["j"].pool == SPOT_B.id
    assert place([PlacementRequest("j", 1)], [cheap_od, SPOT_B])["j"].pool == cheap_od.id


def test_gang_stays_in_one_pool_and_fragmentation_is_repaired() -> None:
    # 3 + 3 free GPUs in two pools: a 4-GPU job cannot be split, so it shrinks to 3.
    got = place([PlacementRequest("big", 4, fallbacks=[3, 2, 1])], [SPOT_A, SPOT_B],
                used={SPOT_A.id: 1, SPOT_B.id: 1})
    assert got["big"] == PlacementResult(SPOT_A.id, 3)
    full = place([PlacementRequest("x", 2)], [SPOT_A], used={SPOT_A.id: 3})
    assert full["x"] is None


def test_a_pool_takes_only_the_gpu_counts_its_instance_types_have() -> None:
    sizes = pool("cheap", Market.SPOT, 0.1, 8).model_copy(
        update={"gpu_prices": {1: 0.25, 4: 0.12, 8: 0.1}})
    anysize = pool("dear", Market.SPOT, 0.3, 8)
    placed = place([PlacementRequest("two", 2), PlacementRequest("four", 4)], [sizes, anysize])
    assert placed["two"] == PlacementResult(anysize.id, 2)  # no 2-GPU type in the cheap pool
    assert placed["four"] == PlacementResult(sizes.id, 4)
    alone = place([PlacementRequest("three", 3, fallbacks=(2, 1))], [sizes])
    assert alone["three"] == PlacementResult(sizes.id, 1)  # the largest launchable fallback
    # ranked at the price of the size launched: one GPU here ($0.25) loses to $0.20 elsewhere
    other = pool("flat", Market.SPOT, 0.2, 8)
    one = place([PlacementRequest("one", 1)], [sizes, other])
    assert one["one"] == PlacementResult(other.id, 1)
    assert sizes.price_for(1) == 0.25 and sizes.price_for(8) == 0.1 and other.price_for(3) == 0.2


def test_a_blocked_pool_is_used_when_no_other_pool_has_room() -> None:
    """A V100 job whose only spot pool was just reclaimed goes back there rather than waiting
    out the blocklist's decay (other spot locations of other accelerators keep it from
    resetting)."""
    v100 = pool("east", Market.SPOT, 0.3, 4).model_copy(update={"accelerator": Accelerator.V100})
    cheap = pool("west", Market.SPOT, 0.1, 4)
    placed = place([PlacementRequest("j", 2, blocked=frozenset({cheap.id}))], [cheap, v100])
    assert placed["j"] == PlacementResult(v100.id, 2)  # another pool has room: not the blocked
    alone = place([PlacementRequest("j", 2, blocked=frozenset({v100.id}))], [v100])
    assert alone["j"] == PlacementResult(v100.id, 2)


def test_a_refused_pool_takes_no_new_job_even_when_it_alone_has_room() -> None:
    """Unlike a reclaimed spot location, a pool where the cloud just refused a launch is not
    tried again while the mark lasts, at any size; a job running there stays."""
    v100 = pool("east", Market.ON_DEMAND, 0.3, 4).model_copy(
        update={"accelerator": Accelerator.V100})
    alone = place([PlacementRequest("j", 2, fallbacks=(1,), refused=frozenset({v100.id}))],
                  [v100])
    assert alone["j"] is None
    runs = place([PlacementRequest("j", 2, current_pool=v100.id, refused=frozenset({v100.id}))],
                 [v100])
    assert runs["j"] == PlacementResult(v100.id, 2)


def test_throughput_model_scales_sublinearly_and_calibrates() -> None:
    m = ThroughputModel()
    one, two, four = (m.throughput(g, 256) for g in (1, 2, 4))
    assert one < two < four < 4 * one
    # Gradient accumulation above per_gpu_max costs extra micro-steps.
    assert m.throughput(1, 256, per_gpu_max=64) < m.throughput(1, 256)
    cal = m.calibrated(2, 256, samples_per_sec=two / 2)
    assert abs(cal.throughput(2, 256) - two / 2) < 1e-9
    assert batch_candidates(48, 300, 4) == [48, 64, 128, 256, 300]
    assert batch_candidates(2, 8, 4) == [4, 8]


# ---- expected cost: preemption risk and checkpoint egress (policies.region_score) -------------

RISKY = pool("risky", Market.SPOT, 0.20, 4)
SAFE = pool("safe", Market.SPOT, 0.21, 4, cloud="gcp")
# five reclaims in ten node-hours: about one every seven hours, against none seen in SAFE
SEEN = {RISKY.id: PoolRisk(preemptions_seen=5, node_hours_seen=10)}


def test_risky_cheap_spot_pool_loses_to_a_safe_one_for_a_long_job_only() -> None:
    job = dict(checkpoint_interval_h=1.0, restart_h=0.1)
    long = PlacementRequest("long", 2, remaining_h=50, **job)
    short = PlacementRequest("short", 2, remaining_h=0.01, **job)
    assert place([long], [RISKY, SAFE], risk=SEEN)["long"].pool == SAFE.id
    # a short job is unlikely to meet a reclaim: the cheaper price wins
    assert place([short], [RISKY, SAFE], risk=SEEN)["short"].pool == RISKY.id
    # without what the broker saw, the long job takes the cheaper pool
    assert place([long], [RISKY, SAFE])["long"].pool == RISKY.id
    # a running job stays where it is: risk moves nobody for pennies
    stay = PlacementRequest("stay", 2, current_pool=RISKY.id, remaining_h=50, **job)
    assert place([stay], [RISKY, SAFE], risk=SEEN)["stay"].pool == RISKY.id
    # spot "preferred" still ranks every spot pool before on-demand, however risky
    od = pool("od", Market.ON_DEMAND, 0.1, 4)
    preferred = PlacementRequest("p", 2, spot=SpotPolicy.PREFERRED, remaining_h=50, **job)
    assert place([preferred], [RISKY, od], risk=SEEN)["p"].pool == RISKY.id
    assert place([long], [RISKY, od], risk=SEEN)["long"].pool == od.id


def test_a_large_checkpoint_keeps_the_job_in_its_region() -> None:
    east = pool("east", Market.SPOT, 0.2, 4)
    west = pool("west", Market.SPOT, 0.201, 4, cloud="gcp")
    home = dict(checkpoint_cloud="gcp", checkpoint_region="west", remaining_h=10)
    big = PlacementRequest("big", 2, checkpoint_gb=50, **home)  # 4.50 USD to leave gcp
    assert place([big], [east, west])["big"].pool == west.id
    small = PlacementRequest("small", 2, checkpoint_gb=0.01, **home)
    assert place([small], [east, west])["small"].pool == east.id


pools_st = st.lists(st.builds(
    pool, st.sampled_from(["r1", "r2", "r3"]), st.sampled_from(list(Market)),
    st.sampled_from([0.1, 0.2, 0.25, 0.9]), st.integers(1, 4),
    st.sampled_from(["aws", "gcp"])), min_size=1, max_size=6, unique_by=lambda p: p.id)


@given(pools_st, st.integers(1, 4), st.sampled_from(list(SpotPolicy)),
       st.floats(0.0, 1000.0), st.floats(0.0, 2.0))
def test_without_risk_or_checkpoint_the_order_is_the_price_order(
        pools: list[Pool], gpus: int, spot: SpotPolicy, remaining_h: float,
        restart_h: float) -> None:
    req = PlacementRequest("j", gpus, spot=spot, remaining_h=remaining_h, restart_h=restart_h)
    fits = [p for p in pools if p.capacity >= gpus and eligible(p, req)]
    want = min(fits, key=lambda p: (
        spot is not SpotPolicy.PREFERRED or p.market is not Market.SPOT,
        p.price_per_gpu_hour, p.market is Market.SPOT, p.id)).id if fits else None
    got = place([req], pools)["j"]
    assert (got and got.pool) == want


# ---- stickiness: a running job moves only past the margin (policies.region_score.Stickiness) ---

def test_a_running_job_moves_only_when_the_saving_beats_the_stickiness_margin() -> None:
    """Ten hours left on 2 GPUs: its pool became much dearer ($0.9 against $0.2: $14 saved, well
    past max($1, 10%)), so it moves; a saving of $0.2 (0.21 against 0.20) keeps it where it is;
    a job that must not be preempted never moves; a move never displaces another job."""
    dear = pool("dear", Market.SPOT, 0.9, 4)
    near = pool("near", Market.SPOT, 0.21, 4)
    cheap = pool("cheap", Market.SPOT, 0.2, 4)
    running = PlacementRequest("j", 2, current_pool=dear.id, remaining_h=10)
    assert place([running], [dear, cheap])["j"] == PlacementResult(cheap.id, 2)
    small = PlacementRequest("j", 2, current_pool=near.id, remaining_h=10)
    assert place([small], [near, cheap])["j"] == PlacementResult(near.id, 2)
    # the move's restart counts: 35 h of restart at $0.40/h eat the $14 saving
    slow = PlacementRequest("j", 2, current_pool=dear.id, remaining_h=10, restart_h=35)
    assert place([slow], [dear, cheap])["j"].pool == dear.id
    od_dear = pool("od", Market.ON_DEMAND, 3.0, 4)
    never = PlacementRequest("n", 2, current_pool=od_dear.id, remaining_h=10,
                             spot=SpotPolicy.NEVER)
    cheap_od = pool("od2", Market.ON_DEMAND, 0.5, 4)
    assert place([never], [od_dear, cheap_od])["n"].pool == od_dear.id
    # the cheap pool's room goes to the queued job first; the running job stays
    queued = PlacementRequest("q", 4, remaining_h=10)
    got = place([running, queued], [dear, cheap])
    assert got == {"j": PlacementResult(dear.id, 2), "q": PlacementResult(cheap.id, 4)}


def test_markets_narrow_the_eligible_pools() -> None:
    only_od = PlacementRequest("j", 1, markets=frozenset({Market.ON_DEMAND}))
    assert place([only_od], [SPOT_A, SPOT_B, OD_C])["j"].pool == OD_C.id
    only_spot = PlacementRequest("j", 1, markets=frozenset({Market.SPOT}))
    assert place([only_spot], [OD_C])["j"] is None
    # spot: never wins over a market list that allows spot
    never = PlacementRequest("j", 1, spot=SpotPolicy.NEVER, markets=frozenset({Market.SPOT}))
    assert place([never], [SPOT_A, OD_C])["j"] is None
