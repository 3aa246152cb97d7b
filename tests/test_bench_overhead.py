"""The overhead benchmark's pairing (no timing asserted): loops interleaved in turns A B B A,
the time a loop waits for its turn left out of its steps, a failing loop does not hang the
other, each pair of blocks that ran side by side gives one overhead, and so does each pair of
a framework's runs."""

from __future__ import annotations

import time

import pytest

from tests.bench.bench_overhead import block_overheads, bootstrap_ci, run_overheads
from tests.bench.overhead_loops import OnStep, interleave


def loop(name: str, steps: int, seen: list[str], pause: float = 0.0):
    def run(on_step: OnStep) -> None:
        for _ in range(steps):
            seen.append(name)
            time.sleep(pause)
            on_step()

    return run


def test_loops_take_turns_a_b_b_a_and_waiting_is_not_a_step() -> None:
    seen: list[str] = []
    # b's steps sleep 0.2 s, a's do nothing: a waited 0.4 s for its turn twice, uncounted
    times = interleave({"a": loop("a", 6, seen), "b": loop("b", 6, seen, pause=0.2)}, block=2)
    assert "".join(seen) == "aabbbbaaaabb"
    assert len(times["a"]) == len(times["b"]) == 6
    assert sum(times["a"]) < 0.2 <= min(times["b"])


def test_a_loop_that_runs_longer_finishes_alone() -> None:
    seen: list[str] = []
    interleave({"a": loop("a", 2, seen), "b": loop("b", 6, seen)}, block=2)
    assert "".join(seen) == "aabbbbbb"


def test_a_failing_loop_stops_the_run_instead_of_hanging_it() -> None:
    def broken(on_step: OnStep) -> None:
        on_step()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        interleave({"a": broken, "b": loop("b", 6, [])}, block=1)


def test_block_pairs_and_their_interval() -> None:
    without = [9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # two warm-up steps, three blocks of 2
    with_ = [9.0, 9.0, 1.1, 1.1, 1.0, 1.0, 1.2, 1.2]
    got = block_overheads(without, with_, warmup=2, block=2)
    assert got == pytest.approx([10.0, 0.0, 20.0])
    low, high = bootstrap_ci(got)
    assert 0.0 <= low <= 10.0 <= high <= 20.0


def test_each_pair_of_framework_runs_gives_one_overhead() -> None:
    # a framework's runs with and without its integration are separate trainings, paired in order
    without = [[9.0, 1.0, 1.0, 1.0], [9.0, 2.0, 2.0, 2.0]]
    with_ = [[9.0, 1.1, 1.1, 1.1], [9.0, 2.0, 2.0, 2.0]]
    assert run_overheads(without, with_, warmup=1) == pytest.approx([10.0, 0.0])
