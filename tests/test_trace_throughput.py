"""Throughput and goodput models against the vendored measurement CSVs."""

import csv
import math

import numpy as np
import pytest

from policies.goodput import EfficiencyModel
from policies.models import Accelerator
from policies.trace_throughput import canonical, packed_placement
from providers.measurements import TRACES_DIR, load_application


def _csv(name: str) -> list[dict[str, str]]:
    with (TRACES_DIR / name).open() as f:
        return list(csv.DictReader(f))


def test_placements_are_rotated_to_the_smallest_and_packed() -> None:
    assert canonical((2, 1, 0, 1)) == (1, 1, 2)
    assert canonical((4, 2)) == (2, 4)
    assert packed_placement(12, 8) == (8, 4)
    assert packed_placement(3, 4) == (3,)


@pytest.mark.parametrize(("acc", "suffix"),
                         [(Accelerator.T4, "aws"), (Accelerator.A100, "dgx-ext")])
def test_measured_placement_is_exact_and_linear_between_batches(acc: Accelerator,
                                                                suffix: str) -> None:
    model = load_application("cifar10").on(acc)
    rows = [r for r in _csv(f"cifar10/placements-{suffix}.csv") if r["placement"] == "2"]
    rows.sort(key=lambda r: float(r["local_bsz"]))
    a, b = rows[1], rows[2]
    step, sync = model.step_sync((2,), int(float(a["local_bsz"])))
    assert step == pytest.approx(float(a["step_time"]))
    assert sync == pytest.approx(float(a["sync_time"]))
    lo, hi = float(a["local_bsz"]), float(b["local_bsz"])
    mid = int((lo + hi) // 2)
    w = (mid - lo) / (hi - lo)
    want = (1 - w) * float(a["step_time"]) + w * float(b["step_time"])
    assert model.step_sync((2,), mid)[0] == pytest.approx(want)


def test_unmeasured_placement_interpolates_the_scalability_rows() -> None:
    model = load_application("cifar10").on(Accelerator.T4)
    measured = {tuple(int(c) for c in p) for p in (r["placement"] for r in
                                                   _csv("cifar10/placements-aws.csv"))}
    row = next(r for r in _csv("cifar10/scalability-aws.csv")
               if packed_placement(int(r["num_replicas"]), 4) not in measured
               and int(r["num_replicas"]) == 4 * int(r["num_nodes"]))
    p = packed_placement(int(row["num_replicas"]), 4)
    step, sync = model.step_sync(p, int(row["local_bsz"]))
    assert step == pytest.approx(float(row["step_time"]), rel=1e-6)
    assert sync == pytest.approx(float(row["sync_time"]), rel=1e-6)


def test_gradient_accumulation_beyond_the_per_gpu_limit() -> None:
    model = load_application("imagenet").on(Accelerator.T4)
    limit = model.local_bsz_limit((1,))
    seconds, atomic, accum = model.iteration((1,), 4 * limit)
    assert (atomic, accum) == (limit, 3)
    step, sync = model.step_sync((1,), limit)
    assert seconds == pytest.approx(step + 3 * (step - sync))
    assert model.throughput((1,), 4 * limit) == pytest.approx(4 * limit / seconds)


def test_yolov3_on_t4_keeps_pollux_memory_limit() -> None:
    assert load_application("yolov3").on(Accelerator.T4).max_local_bsz == 8


def test_too_small_batch_per_gpu_is_not_runnable() -> None:
    model = load_application("bert").on(Accelerator.T4)
    assert math.isnan(model.iteration((4, 4), 16)[0])  # 1 sample per GPU < measured minimum


@pytest.mark.parametrize(("model", "target"), [("cifar10", 39063), ("imagenet", 576526),
                                               ("deepspeech2", 28536), ("bert", 14774),
                                               ("yolov3", 103444), ("ncf", 194174)])
def test_completion_targets_are_the_published_ones(model: str, target: int) -> None:
    assert round(load_application(model).efficiency.target) == target


def test_gain_is_one_at_m0_below_linear_and_growing() -> None:
    eff = load_application("cifar10").efficiency
    bsz = np.array([128, 256, 1024, 4096])
    gain = eff.gain(bsz, epoch=10)
    assert gain[0] == pytest.approx(1.0)
    assert np.all(np.diff(gain) > 0)
    assert np.all(gain <= bsz / 128 + 1e-9)
    none = load_application("cifar10", EfficiencyModel.NONE).efficiency
    assert np.allclose(none.gain(bsz, epoch=10), bsz / 128)


def test_epochs_follow_the_progress_boundaries() -> None:
    eff = load_application("ncf").efficiency
    b = eff.boundaries
    assert eff.epoch(0.0) == 0
    assert eff.epoch(b[1] - 1e-6) == 0
    assert eff.epoch(b[1]) == 1
    assert eff.epoch(b[-1] + 10) == eff.max_epochs - 1


def test_unknown_application_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown application 'gpt'.*cifar10"):
        load_application("gpt")
