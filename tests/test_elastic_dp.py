"""The elastic DP allocator: exact against HiGHS, feasible, deterministic, and strict on input."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from policies.elastic_dp import Choice, InfeasibleAllocation, JobChoices, allocate, best_value
from policies.elastic_milp import allocate_milp


def total(alloc: dict[str, Choice | None]) -> float:
    return sum(c.value for c in alloc.values() if c is not None)


def used(alloc: dict[str, Choice | None]) -> int:
    return sum(c.gpus for c in alloc.values() if c is not None)


def random_instance(rng: random.Random, n_jobs: int, capacity: int,
                    concave: bool = False) -> list[JobChoices]:
    jobs = []
    for j in range(n_jobs):
        if concave:
            m = rng.randint(1, 8)
            gains = sorted((rng.uniform(0.01, 1.0) for _ in range(m)), reverse=True)
            values = [sum(gains[: g + 1]) for g in range(m)]
            choices = [Choice(g + 1, 32 * (g + 1), v) for g, v in enumerate(values)]
        else:
            counts = sorted(rng.sample([1, 2, 3, 4, 6, 8, 12, 16], rng.randint(1, 8)))
            choices = []
            for g in counts:
                for b in (64, 128, 256):  # several batch sizes per GPU count: only the best counts
                    choices.append(Choice(g, b, rng.uniform(-0.5, g ** rng.uniform(0.3, 1.0))))
        jobs.append(JobChoices(f"job-{j}", choices, required=rng.random() < 0.1))
    return jobs


def check_against_milp(jobs: list[JobChoices], capacity: int) -> None:
    try:
        best, _ = allocate_milp(jobs, capacity)
    except InfeasibleAllocation:
        with pytest.raises(InfeasibleAllocation):
            allocate(jobs, capacity)
        return
    alloc = allocate(jobs, capacity)
    assert used(alloc) <= capacity
    # HiGHS works to a tolerance of about 1e-6: it may skip a job worth less than that.
    assert math.isclose(total(alloc), best, rel_tol=1e-9, abs_tol=1e-6)
    for job in jobs:
        chosen = alloc[job.job_id]
        assert chosen is None or chosen in job.choices
        if job.required:
            assert chosen is not None


def test_exact_on_hundreds_of_random_instances_against_highs() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n_jobs = rng.randint(1, 25)
        capacity = rng.randint(0, 64)
        check_against_milp(random_instance(rng, n_jobs, capacity), capacity)


def test_concave_fast_path_is_exact_against_highs() -> None:
    rng = random.Random(11)
    for _ in range(100):
        jobs = [JobChoices(j.job_id, j.choices) for j in
                random_instance(rng, rng.randint(1, 30), 0, concave=True)]
        capacity = rng.randint(1, 80)
        check_against_milp(jobs, capacity)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(1, 12), st.floats(-5, 50, allow_nan=False)),
                     min_size=0, max_size=6),
            st.booleans(),
        ),
        max_size=12,
    ),
    st.integers(0, 40),
)
# found by this property: HiGHS at its default 1e-4 gap stopped at 20.0, the DP's 20.0019 is
# the optimum (the reference now runs at gap 0)
@example([([(1, 0.0019314604620152634), (10, 20.0)], False), ([(2, 20.0)], False),
          ([(7, 0.0)], True)], 18)
def test_property_feasible_and_optimal(spec: list, capacity: int) -> None:
    jobs = [JobChoices(f"j{i}", [Choice(g, 16, v) for g, v in cs], required=req and bool(cs))
            for i, (cs, req) in enumerate(spec)]
    check_against_milp(jobs, capacity)


def test_batch_dimension_folds_to_the_best_batch_per_gpu_count() -> None:
    job = JobChoices("a", [Choice(2, 64, 1.5), Choice(2, 256, 1.9), Choice(2, 128, 1.7)])
    assert allocate([job], 2)["a"] == Choice(2, 256, 1.9)


def test_required_job_always_placed_even_at_a_loss() -> None:
    jobs = [JobChoices("big", [Choice(4, 64, 10.0)]),
            JobChoices("must", [Choice(1, 32, 0.1)], required=True)]
    alloc = allocate(jobs, 4)
    assert alloc["must"] == Choice(1, 32, 0.1)
    assert alloc["big"] is None


def test_infeasible_required_jobs_are_named() -> None:
    jobs = [JobChoices("a", [Choice(3, 8, 1.0)], required=True),
            JobChoices("b", [Choice(2, 8, 1.0)], required=True)]
    with pytest.raises(InfeasibleAllocation, match=r"required jobs \[a, b\] need at least 5"):
        allocate(jobs, 4)


def test_deterministic_tie_breaking_prefers_earlier_jobs_and_fewer_gpus() -> None:
    jobs = [JobChoices(f"j{i}", [Choice(1, 8, 1.0), Choice(2, 8, 1.0)]) for i in range(4)]
    alloc = allocate(jobs, 2)
    assert alloc == {"j0": Choice(1, 8, 1.0), "j1": Choice(1, 8, 1.0), "j2": None, "j3": None}
    assert allocate(list(jobs), 2) == alloc


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Choice(-1, 8, 1.0), "gpus must be >= 1"),
        (lambda: Choice(1.5, 8, 1.0), "gpus must be an integer"),
        (lambda: Choice(1, 8, float("nan")), "value must be a finite number"),
        (lambda: Choice(1, 8, float("inf")), "value must be a finite number"),
        (lambda: Choice(1, 0, 1.0), "batch_size must be >= 1"),
        (lambda: JobChoices("a", [(1, 8, 1.0)]), "job 'a': choices must be Choice objects"),
        (lambda: allocate([JobChoices("a", []), JobChoices("a", [])], 4), "duplicate job id 'a'"),
        (lambda: allocate([], -1), "capacity must be >= 0"),
        (lambda: allocate([], 2.5), "capacity must be an integer"),
    ],
)
def test_invalid_input_is_rejected_with_a_clear_message(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_zero_capacity_and_empty_inputs() -> None:
    assert allocate([], 8) == {}
    assert allocate([JobChoices("a", [Choice(1, 8, 1.0)])], 0) == {"a": None}


def test_compiled_kernel_and_numpy_path_choose_identically(monkeypatch) -> None:
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    rng = random.Random(3)
    instances = [(random_instance(rng, rng.randint(1, 30), 0), rng.randint(1, 100))
                 for _ in range(60)]
    compiled = []
    for jobs, capacity in instances:
        try:
            compiled.append(allocate(jobs, capacity))
        except InfeasibleAllocation:
            compiled.append(None)
    monkeypatch.setattr(elastic_dp, "_maxplus", None)
    for (jobs, capacity), want in zip(instances, compiled, strict=True):
        if want is None:
            with pytest.raises(InfeasibleAllocation):
                allocate(jobs, capacity)
        else:
            assert allocate(jobs, capacity) == want


@pytest.mark.parametrize("compiled", [True, False])
def test_the_optimum_alone_is_the_allocations_sum_bit_for_bit(monkeypatch, compiled) -> None:
    """``best_value`` (the optimum, no choice recovered) adds the same numbers in the same order
    as summing ``allocate``'s answer, on concave and general instances, and refuses alike."""
    from policies import elastic_dp

    if not compiled:
        monkeypatch.setattr(elastic_dp, "_maxplus", None)
    elif elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    rng = random.Random(5)
    infeasible = 0
    for i in range(120):
        jobs = random_instance(rng, rng.randint(0, 40), 0, concave=i % 3 == 0)
        capacity = rng.randint(0, 120)
        try:
            want = total(allocate(jobs, capacity))
        except InfeasibleAllocation:
            infeasible += 1
            with pytest.raises(InfeasibleAllocation):
                best_value(jobs, capacity)
            continue
        assert best_value(jobs, capacity) == want
    assert 0 < infeasible < 120


def test_compiled_and_numpy_fold_agree_on_ties_and_odd_inputs(monkeypatch) -> None:
    """Equal values, equal batches, duplicates, numpy scalars and tuples of choices: the C fold
    and the Python fold keep the same frontier, so both paths pick the same objects."""
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    rng = random.Random(11)
    instances = []
    for _ in range(80):
        jobs = []
        for j in range(rng.randint(1, 12)):
            choices = [Choice(np.int64(rng.choice([1, 2, 3, 4, 8])), rng.choice([32, 64]),
                              np.float64(rng.randint(-2, 8) / 4))
                       for _ in range(rng.randint(0, 10))]
            jobs.append(JobChoices(f"j{j}", tuple(choices), required=rng.random() < 0.15))
        instances.append((jobs, rng.randint(0, 24)))

    def solve_all() -> list:
        out = []
        for jobs, capacity in instances:
            try:
                alloc = allocate(jobs, capacity)
            except InfeasibleAllocation:
                out.append(None)
                continue
            # by identity, not equality: the index of the very Choice object each job offered
            offered = {job.job_id: job.choices for job in jobs}
            out.append({k: None if c is None else [o is c for o in offered[k]].index(True)
                        for k, c in alloc.items()})
        return out

    compiled = solve_all()
    monkeypatch.setattr(elastic_dp, "_maxplus", None)
    assert solve_all() == compiled


def _fold_buffers(n: int, jobs: int) -> dict:
    return {"gpus": np.empty(n, np.int64), "values": np.empty(n), "src": np.empty(n, np.int64),
            "offsets": np.empty(jobs + 1, np.int64), "required": np.empty(jobs, np.uint8),
            "concave": np.empty(jobs, np.uint8)}


@pytest.mark.parametrize("bad", [
    "short values",                              # the fold wrote past it into `big`
    {"src": np.empty(1, np.int64)},
    {"values": np.empty(3, np.int64)},           # right size, wrong type
    {"gpus": np.empty(3)},
    {"src": np.empty(6, np.int32)},              # same bytes, wrong itemsize
    {"required": np.empty(1, np.int64)},
])
def test_compiled_fold_refuses_buffers_of_the_wrong_length_or_type(bad: object) -> None:
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    big = np.full(4, -7.0)
    buffers = {**_fold_buffers(3, 1), **({"values": big[:1]} if bad == "short values" else bad)}
    jobs = [JobChoices("a", [Choice(1, 8, 1.0), Choice(2, 8, 2.0), Choice(3, 8, 3.0)])]
    with pytest.raises(ValueError, match="fold: "):
        elastic_dp._maxplus.fold(jobs, 8, buffers["gpus"], buffers["values"], buffers["src"],
                                 buffers["offsets"], buffers["required"], buffers["concave"])
    assert (big == -7.0).all()


def test_compiled_kernels_refuse_offsets_outside_the_choices() -> None:
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    rows = np.zeros((2, 5))
    offsets = np.array([0, 9], np.int64)  # job 1 claims 9 choices; there is one
    gpus, values, req = np.ones(1, np.int64), np.ones(1), b"\0"
    with pytest.raises(ValueError, match="forward: "):
        elastic_dp._maxplus.forward(rows, 5, offsets, gpus, values, req)
    with pytest.raises(ValueError, match="backtrack: "):
        elastic_dp._maxplus.backtrack(rows, 5, 0, offsets, gpus, values, req,
                                      np.empty(1, np.int64))
    with pytest.raises(ValueError, match="forward: "):  # a float table where int64 is expected
        elastic_dp._maxplus.forward(rows, 5, offsets.astype(float), gpus, values, req)
    with pytest.raises(ValueError, match="best: "):
        elastic_dp._maxplus.best(5, offsets, gpus, values, req)


def test_compiled_and_numpy_paths_agree_on_counts_beyond_int64(monkeypatch) -> None:
    """A choice with more GPUs than int64 holds is skipped as larger than the capacity, and a
    fitting choice with such a batch size still wins its tie by the smaller batch, in both paths."""
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")
    jobs = [JobChoices("a", [Choice(2**70, 8, 9.0), Choice(2, 8, 1.0)]),
            JobChoices("b", [Choice(1, 2**71, 2.0), Choice(1, 2**70, 2.0), Choice(1, 8, 1.0)])]
    compiled = allocate(jobs, 4)
    monkeypatch.setattr(elastic_dp, "_maxplus", None)
    assert allocate(jobs, 4) == compiled
    assert compiled["a"] is jobs[0].choices[1]
    assert compiled["b"] is jobs[1].choices[1]


def test_compiled_fold_survives_lists_mutated_while_read() -> None:
    """Reading an attribute may run Python code that empties the list being read; the fold stops
    at the list's new end (choices) or refuses (jobs: its buffers are sized for them)."""
    from policies import elastic_dp

    if elastic_dp._maxplus is None:
        pytest.skip("the C kernel is not built in this checkout")

    class Emptying:
        def __init__(self, victim: list) -> None:
            self.victim, self.batch_size, self.value, self.choices = victim, 8, 1.0, ()

        @property
        def gpus(self) -> int:
            self.victim.clear()
            return 1

        @property
        def required(self) -> bool:
            self.victim.clear()
            return False

    choices: list = []
    choices += [Emptying(choices) for _ in range(3)]
    b = _fold_buffers(3, 1)
    job = JobChoices.__new__(JobChoices)
    object.__setattr__(job, "choices", choices)
    object.__setattr__(job, "required", False)
    elastic_dp._maxplus.fold([job], 8, *b.values())
    assert b["offsets"].tolist() == [0, 1] and b["gpus"][0] == 1
    jobs: list = []
    jobs += [Emptying(jobs) for _ in range(2)]
    with pytest.raises(RuntimeError, match="jobs list changed"):
        elastic_dp._maxplus.fold(jobs, 8, *_fold_buffers(0, 2).values())
