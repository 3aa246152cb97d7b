"""The README's headline results are the published benchmark results: each figure is formatted
here from the JSON its benchmark wrote to ``examples/results/`` and must appear in the README as
written, so a new run that changes a number fails until the README says it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def result(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "examples" / "results" / f"{name}.json").read_text())


def median(name: str, key: str) -> float:
    return result(name)["numbers"][key]["median"]


def value(name: str, key: str) -> float:
    return result(name)["numbers"][key]["value"]


def spot_row(side: str, policy: str) -> dict[str, Any]:
    return result("spot_heldout")["sides"][side]["totals"][policy]


def spot_cell(side: str, policy: str, jct: bool = True) -> str:
    row = spot_row(side, policy)
    beyond = row["misses_beyond_ondemand"]
    misses = row["deadline_misses"]
    return (f"${row['cost_usd']:,.0f}, {misses:,} miss{'' if misses == 1 else 'es'}"
            + (f" ({beyond:,} beyond)" if beyond else "")
            + (f", {row['avg_jct_h']:.3f} h" if jct else ""))


def claims() -> list[str]:
    dp, small, highs = ("1000 jobs x 2048 GPUs: DP", "256 jobs x 512 GPUs: DP",
                        "256 jobs x 512 GPUs: HiGHS MILP")
    classic = result("classic_heldout")
    one = classic["pollux_t4"]["1.0"]
    ws1 = "runtime, world size 1, agent: overhead"
    return [
        f"1,000 jobs x 2,048 GPUs in {median('allocator', dp):.1f} ms",
        f"{median('allocator', highs) / median('allocator', small):.0f}x faster than HiGHS at "
        "256 x 512",
        f"average JCT {one['tuning']['avg_jct_h']:.3f} h tuning (1-4), "
        f"{one['held-out']['avg_jct_h']:.3f} h held out (5-8)",
        f"| {classic['hetero']['avg_jct_h']:.3f} h; Sia published 0.6 h",
        f"{median('scheduler', 'first round: total'):,.0f} ms for a broker that just started, "
        f"{median('scheduler', 'next round of the same broker: total'):,.0f} ms for its next round",
        f"(median {median('scheduler', 'next round of the same broker: total'):,.0f} ms, slowest "
        "of 3: "
        f"{result('scheduler')['numbers']['next round of the same broker: total']['max']:,.0f} ms)",
        f"{median('resize', 'lost training, grow 1->2 in place'):.2f} s of training lost against "
        f"{median('resize', 'lost training, grow 1->2 checkpoint'):.1f} s",
        f"{median('overhead', ws1 + ' (block pairs)'):+.1f}% "
        f"({value('overhead', ws1 + ', 95% CI low'):+.1f}% to "
        f"{value('overhead', ws1 + ', 95% CI high'):+.1f}%)",
        f"{result('metrics')['scrape_ms']['median']:.0f} ms median scrape",
        f"{result('dashboard')['worst_median_wall_ms']:.0f} ms median load",
        *(f"| {side.replace('-', ' ')} | {spot_cell(side, 'fleet')} | "
          f"{spot_cell(side, 'skypilot-eager')} | {spot_cell(side, 'ondemand', jct=False)} |"
          for side in ("tuning", "held-out")),
    ]


@pytest.mark.parametrize("claim", claims())
def test_the_readme_states_the_published_number(claim: str) -> None:
    assert claim in README, f"README.md should say {claim!r} (from examples/results/)"
