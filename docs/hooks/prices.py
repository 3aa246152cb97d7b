"""MkDocs hook: the cheapest on-demand and spot offer per accelerator, from the shipped catalog.

``clouds.md`` carries the marker below; this hook replaces it with the tables that
``fleet prices --json`` (and ``-c CLOUD``) prints for the vendored catalog snapshots, run at build
time with an empty config dir so no user catalog interferes. The numbers follow the snapshot files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- prices -->"


def prices(*args: str) -> list[dict[str, Any]]:
    """What ``fleet prices --json ARGS`` prints against the snapshot catalog."""
    with tempfile.TemporaryDirectory() as config_dir:
        env = {**os.environ, "FLEET_CONFIG_DIR": config_dir,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, "-m", "broker", "prices", "--json", *args],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _priced() -> tuple[str, ...]:
    """The clouds with a price catalog, from the registry (the one list of clouds)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from providers import registry

    return registry.priced()


def _where(o: dict[str, Any] | None) -> str:
    if not o:
        return "-"
    return (f"{o['cloud']} {o['zone'] or o['region']} {o['instance_type']} "
            f"({o['accelerator_count']}x {o['accelerator_name']})")


def _price(o: dict[str, Any] | None) -> str:
    return f"{o['price_per_gpu_hour']:.3f}" if o else "-"


def render() -> str:
    out = ["| GPU | cheapest on-demand (cloud, zone/region, instance) | $/GPU-h | cheapest spot "
           "(cloud, zone/region, instance) | $/GPU-h | spot saving |",
           "|---|---|---:|---|---:|---:|"]
    for r in prices():
        saving = f"{r['spot_saving_pct']:.1f}%" if r.get("spot_saving_pct") is not None else "-"
        out.append(f"| {r['accelerator']} | {_where(r['on_demand'])} | {_price(r['on_demand'])} "
                   f"| {_where(r['spot'])} | {_price(r['spot'])} | {saving} |")
    out += ["", "Per cloud (`fleet prices -c CLOUD --json`), $/GPU-h on-demand / spot:", "",
            "| cloud | accelerator | on-demand | spot |",
            "|---|---|---:|---:|"]
    for cloud in _priced():
        for r in prices("-c", cloud):
            out.append(f"| {cloud} | {r['accelerator']} | {_price(r['on_demand'])} | "
                       f"{_price(r['spot'])} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
