"""The summary's duplicate-launch count: spawns beyond the first of one node of one attempt,
whichever leader (fence) made them; a new attempt, another rank or a stand-in is not one."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.conftest import duplicate_launches


def test_duplicate_launches_counts_a_node_of_an_attempt_spawned_again(tmp_path: Path) -> None:
    log = tmp_path / "provider" / "launches.log"
    assert duplicate_launches(tmp_path) == 0  # nothing launched yet
    log.parent.mkdir()
    log.write_text(
        "a-1:3:1 a-1_3_1 1.0\n"  # attempt 1 of a-1
        "a-1:3:2 a-1_3_2 2.0\n"  # its attempt 2
        "g-2:3:1 g-2_3_1-n0 3.0\n"  # a gang: rank 0 and rank 1
        "g-2:3:1 g-2_3_1-n1 3.0\n"
        "g-2:3:1~r1.1 g-2_3_1~r1.1 4.0\n"  # a stand-in for rank 1, round 1
    )
    assert duplicate_launches(tmp_path) == 0
    with log.open("a") as f:
        f.write("a-1:4:2 a-1_4_2 5.0\n")  # a new leader launched attempt 2 again
        f.write("g-2:3:1 g-2_3_1-n1 6.0\n")  # rank 1 spawned twice
    assert duplicate_launches(tmp_path) == 2
