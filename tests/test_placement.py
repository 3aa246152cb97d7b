"""Region placement and the throughput model (pure policies)."""

from __future__ import annotations

from policies.models import Accelerator, Market, Pool, SpotPolicy
from policies.placement import PlacementRequest, PlacementResult, place
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
