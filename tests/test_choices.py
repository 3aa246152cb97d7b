"""Choice tables, value functions, and the heterogeneous outer step against a joint MILP."""

import random

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

from policies.choices import (
    ChoiceTables,
    TypeCapacity,
    ValueConfig,
    ValueFunction,
    allowed_gpu_counts,
    batch_grid,
    job_choices,
    placement_for,
    values,
)
from policies.models import Accelerator
from policies.schedulers import ElasticPolicy, JobState
from providers.measurements import load_application

T4 = TypeCapacity(Accelerator.T4, 16, 4)


def test_allowed_counts_are_small_single_node_or_whole_nodes() -> None:
    assert allowed_gpu_counts(4, 3) == (1, 2, 4, 8, 12)
    assert allowed_gpu_counts(8, 2) == (1, 2, 4, 8, 16)


def test_table_picks_the_best_batch_of_the_grid_per_count() -> None:
    app = load_application("cifar10")
    table = ChoiceTables().table(app, T4, epoch=30)
    for n in (1, 4, 16):
        best_rate = max(
            r for b in batch_grid(app)
            if b >= n * app.on(Accelerator.T4).min_local_bsz
            for r in [app.rate(Accelerator.T4, placement_for(n, 4), int(b), 30)[0]] if r > 0
        )
        batch, rate = table.at(n)
        assert rate == pytest.approx(best_rate)
        assert app.init_batch_size <= batch <= app.spec.max_batch_size


def test_fixed_batch_table_keeps_the_batch() -> None:
    app = load_application("deepspeech2")
    table = ChoiceTables().table(app, T4, epoch=0, fixed_batch=320)
    runnable = table.rate > 0
    for n, b in zip(table.gpus[runnable], table.batch[runnable], strict=True):
        assert 320 <= b < 320 + n  # the batch is split evenly, per-GPU sizes rounded up
    assert table.gpus[runnable].max() <= 320 // app.on(Accelerator.T4).min_local_bsz


def test_value_functions_and_restart_discount() -> None:
    app = load_application("imagenet")
    table = ChoiceTables().table(app, T4, epoch=5)
    ref = table.at(1)[1]
    speed = values(table, ref, 1e5, ValueConfig())
    assert speed[0] == pytest.approx(1.0)
    fair = values(table, ref, 1e5, ValueConfig(ValueFunction.FAIR, 0.5))
    assert np.allclose(fair[speed > 0], np.sqrt(speed[speed > 0]))
    near = values(table, ref, 1e3, ValueConfig(ValueFunction.REMAINING))
    far = values(table, ref, 1e5, ValueConfig(ValueFunction.REMAINING))
    assert np.all(near[near > 0] > far[far > 0])  # closer to the end, worth more
    cfg = ValueConfig(restart_horizon_s=300)
    jc = job_choices("j", table, speed, current_gpus=4, restart_s=30, cfg=cfg)
    by_gpus = {c.gpus: c.value for c in jc.choices}
    assert by_gpus[4] == pytest.approx(table.at(4)[1] / ref)
    assert by_gpus[8] == pytest.approx(0.9 * table.at(8)[1] / ref)


def test_bad_value_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="fairness p"):
        ValueConfig(ValueFunction.FAIR, 1.5)


def _joint_milp(jobs: list[JobState], policy: ElasticPolicy) -> float:
    """max sum of speed-ups with each job on at most one (type, count): the exact joint problem."""
    cols, owner, gpus, acc_of, vals = [], [], [], [], []
    for j_idx, j in enumerate(jobs):
        tables = {a: policy._table(j, a) for a in policy.runnable_types(j)}
        ref = min(t.rate[0] for t in tables.values())
        for a, t in tables.items():
            for n, r in zip(t.gpus.tolist(), t.rate.tolist(), strict=True):
                if r > 0:
                    cols.append((j_idx, a, n))
                    owner.append(j_idx)
                    gpus.append(n)
                    acc_of.append(a)
                    vals.append(r / ref)
    rows = []
    for j_idx in range(len(jobs)):
        rows.append([1.0 if o == j_idx else 0.0 for o in owner])
    ub = [1.0] * len(jobs)
    for a, cap in policy.fleet.items():
        rows.append([float(g) if x is a else 0.0 for g, x in zip(gpus, acc_of, strict=True)])
        ub.append(cap.gpus)
    res = milp(-np.array(vals), integrality=np.ones(len(vals)), bounds=Bounds(0, 1),
               constraints=LinearConstraint(np.array(rows), -np.inf, np.array(ub)))
    return -res.fun


def test_per_type_dp_is_close_to_the_joint_milp_on_small_fleets() -> None:
    rng = random.Random(7)
    fleet = [TypeCapacity(Accelerator.T4, 2, 4), TypeCapacity(Accelerator.RTX2080TI, 1, 8),
             TypeCapacity(Accelerator.A100, 1, 8)]
    apps = ["cifar10", "imagenet", "deepspeech2", "bert", "yolov3"]
    ratios = []
    for case in range(12):
        policy = ElasticPolicy(fleet)
        jobs = []
        for i in range(rng.randint(3, 14)):
            app = load_application(rng.choice(apps))
            jobs.append(JobState(f"j{case}-{i}", app, submitted=i, workload_gpus=1,
                                 workload_batch=app.init_batch_size,
                                 progress=rng.random() * app.efficiency.target * 0.9))
        plan = policy.schedule(jobs, now=0.0)
        got = 0.0
        for j in jobs:
            a = plan[j.id]
            if a is not None:
                ref = min(policy._table(j, t).rate[0] for t in policy.runnable_types(j))
                got += policy._table(j, a.accelerator).at(a.gpus)[1] / ref
        used = {acc: sum(a.gpus for a in plan.values() if a and a.accelerator is acc)
                for acc in policy.fleet}
        assert all(used[acc] <= cap.gpus for acc, cap in policy.fleet.items())
        best = _joint_milp(jobs, policy)
        assert got <= best + 1e-6
        ratios.append(got / best)
    print(f"per-type DP / joint MILP: mean {np.mean(ratios):.3f}, min {min(ratios):.3f}")
    assert np.mean(ratios) >= 0.9


def test_without_accumulation_a_fixed_batch_needs_enough_gpus_to_hold_it() -> None:
    app = load_application("cifar10")
    limit = app.on(Accelerator.T4).max_local_bsz
    with_acc = ChoiceTables().table(app, T4, epoch=0, fixed_batch=4096)
    without = ChoiceTables().table(app, T4, epoch=0, fixed_batch=4096, accumulation=False)
    assert with_acc.rate[0] > 0  # one GPU accumulates 4 micro-batches
    runnable = without.gpus[without.rate > 0]
    assert runnable.min() == 4096 // limit


def test_running_jobs_keep_their_type_unless_migration_is_allowed() -> None:
    from policies.schedulers import Assignment

    fleet = [TypeCapacity(Accelerator.T4, 1, 4), TypeCapacity(Accelerator.A100, 1, 8)]
    app = load_application("cifar10")
    job = JobState("c", app, 0.0, 1, 128, progress=1000.0,
                   current=Assignment(Accelerator.T4, 1, 128, (1,)))
    assert ElasticPolicy(fleet).schedule([job], 60.0)["c"].accelerator is Accelerator.T4
    moved = ElasticPolicy(fleet, migrate=True).schedule([job], 60.0)["c"]
    assert moved.accelerator is Accelerator.A100  # alone, the A100s are worth the restart
