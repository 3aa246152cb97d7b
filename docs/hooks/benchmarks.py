"""MkDocs hook: one page per benchmark, generated at build time from what the benchmark wrote.

Every ``tests/bench/bench_*.py`` gets ``benchmarks/<name>.md``: its docstring (the setup), the
command that runs it, and, where it writes ``examples/results/<name>.json``, the date of that
result (the one it records, else its last commit) and its numbers as tables. Nothing here is
typed by hand, so a page cannot drift from its JSON. The spot tables and the goal lines come
from ``tests.bench.spot_common``, the functions the benchmark prints them with.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tests" / "bench"
RESULTS = ROOT / "examples" / "results"
PLOT = "jct_vs_load.png"


def _benches() -> dict[str, str]:
    """Bench name (``spot``) -> module docstring, for every ``bench_*.py``."""
    return {p.stem.removeprefix("bench_"): ast.get_docstring(ast.parse(p.read_text())) or ""
            for p in sorted(BENCH.glob("bench_*.py"))}


def _summary(doc: str) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _constant(name: str, module: str) -> Any:
    """A literal module-level constant of a bench module, read without importing it."""
    for node in ast.parse((BENCH / f"bench_{module}.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not in tests/bench/bench_{module}.py")


def _date(path: Path) -> str:
    """The day the result in ``path`` was measured: the date the benchmark wrote into it, else
    the day it was last committed, else (an uncommitted result) its modification day."""
    if isinstance(written := json.loads(path.read_text()), dict) and written.get("date"):
        return str(written["date"])
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%cs", "--",
                              str(path)], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    if out.strip() and not _dirty(path):
        return out.strip()
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC).date().isoformat()


def _dirty(path: Path) -> bool:
    try:
        return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                    str(path)], capture_output=True, text=True,
                                   check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return True


def _printed(fn: Callable[..., Any], *args: Any) -> str:
    """What a bench's print-a-table function prints."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue()


def _spot_modules() -> tuple[Any, Any]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.bench import bench_spot_heldout, spot_common
    return spot_common, bench_spot_heldout


def _goals(rows: dict[str, dict[str, Any]], prefix: str = "") -> str:
    """The goal line of each fleet row, as the bench prints them."""
    spot_common, _ = _spot_modules()
    return "".join(f"- {prefix}{spot_common.goal(rows, f)}\n" for f in spot_common.FLEET_ROWS)


def _spot_block(rows: dict[str, dict[str, Any]]) -> str:
    spot_common, _ = _spot_modules()
    return _printed(spot_common.table, rows) + "\n" + _goals(rows)


def simulator(data: dict[str, Any]) -> str:
    loads = data["loads"]
    xs = list(next(iter(loads.values())))
    published = _constant("PUBLISHED", "simulator")
    out = ["Average JCT (mean of the eight workloads' means) against load, 64 T4 (`t4:16x4`), "
           "60 s rounds, 30 s restarts, admission `queue`; wall: the four loads together.\n",
           "| policy | " + " | ".join(f"{x}x" for x in xs) + " | wall |",
           "|---|" + "---|" * (len(xs) + 1)]
    for label, by_load in loads.items():
        wall = sum(by_load[x]["wall_s"] for x in xs)
        out.append(f"| `{label}` | " + " | ".join(f"{by_load[x]['avg_jct_h']:.3f} h" for x in xs)
                   + f" | {wall:.0f} s |")
    for name, ref in published.items():
        out.append(f"| {name} | " + " | ".join(f"{ref[float(x)]} h" for x in xs) + " | |")
    out += ["", f"![average JCT vs load]({PLOT})", "",
            "Per load and policy (all workloads):", "",
            "| policy | load | jobs | completed | p99 JCT | makespan | GPU-h per job | rescales |",
            "|---|---|---|---|---|---|---|---|"]
    for label, by_load in loads.items():
        for x, r in by_load.items():
            out.append(f"| `{label}` | {x}x | {r['jobs']} | {r['completed']} | "
                       f"{r['p99_jct_h']:.2f} h | {r['makespan_h']:.2f} h | "
                       f"{r['gpu_hours_per_job']:.2f} | {r['rescales']:,} |")
    return "\n".join(out) + "\n"


def seed_claim(data: dict[str, Any]) -> str:
    out = ["`elastic` against `fixed-batch` under `--admission drop`, 64 T4; JCT over the "
           "completed jobs.\n",
           "| load | elastic completed | fixed-batch completed | ratio | elastic JCT | "
           "fixed-batch JCT | fixed / elastic JCT | wall |",
           "|---|---|---|---|---|---|---|---|"]
    for x, r in data.items():
        e, f = r["elastic"], r["fixed-batch"]
        out.append(f"| {x}x | {e['completed']} | {f['completed']} | "
                   f"{e['completed'] / f['completed']:.2f} | {e['avg_jct_h']:.3f} h | "
                   f"{f['avg_jct_h']:.3f} h | {f['avg_jct_h'] / e['avg_jct_h']:.2f} | "
                   f"{e['wall_s'] + f['wall_s']:.0f} s |")
    return "\n".join(out) + "\n"


def hetero(data: dict[str, Any]) -> str:
    cluster = next(iter(data.values()))["cluster"]
    out = [f"| policy on `{cluster}`, eight Philly traces | avg JCT | p99 | makespan | "
           "rescales | wall |", "|---|---|---|---|---|---|"]
    for label, r in data.items():
        out.append(f"| `{label}` | {r['avg_jct_h']:.3f} h | {r['p99_jct_h']:.2f} h | "
                   f"{r['makespan_h']:.2f} h | {r['rescales']:,} | {r['wall_s']:.0f} s |")
    out += ["| Sia / Pollux / Gavel (published) | 0.6 / 1.0 / 1.9 h | | | | |", "",
            "Average JCT per trace:", "",
            "| policy | " + " | ".join(Path(w["workload"]).stem
                                      for w in next(iter(data.values()))["per_workload"]) + " |",
            "|---|" + "---|" * len(next(iter(data.values()))["per_workload"])]
    for label, r in data.items():
        out.append(f"| `{label}` | " + " | ".join(f"{w['avg_jct_h']:.3f} h"
                                                 for w in r["per_workload"]) + " |")
    return "\n".join(out) + "\n"


def spot(data: dict[str, Any]) -> str:
    out = ["Per cluster and checkpoint interval, over the eight workloads: cost and GPU-hours "
           "summed, JCT the mean of the per-workload means; the saving is against the "
           "`ondemand` row's cost. Under each table, the goal for each fleet row, and in how many "
           "workloads each part holds alone.\n"]
    for cluster, by_ckpt in data.items():
        for ckpt, rows in by_ckpt.items():
            seconds = ckpt.removeprefix("checkpoint_").removesuffix("s")
            out += [f"## `{cluster}`, checkpoint every {seconds} s", "", _spot_block(rows)]
    return "\n".join(out)


def spot_heldout(data: dict[str, Any]) -> str:
    _, heldout = _spot_modules()
    ckpt = data["checkpoint_interval"]
    out = [f"Checkpoint every {ckpt:.0f} s. {data['wall_s']:.0f} s wall, {data['cpu_s']:.0f} s "
           "CPU for the whole run.\n"]
    for side, doc in data["sides"].items():
        out += [f"## {side}", "", "Workloads: " + ", ".join(
            f"`{Path(w).name}`" for w in doc["workloads"]) + ".", ""]
        for name, c in doc["clusters"].items():
            out += [f"### `{name}` (the cheapest spot price saves at most "
                    f"{c['spot_ceiling_saving_pct']:.0f}%)", "", _spot_block(c["variants"])]
    totals = {side: doc["totals"] for side, doc in data["sides"].items()}
    out += ["## Totals, side by side", "", _printed(heldout.side_by_side, totals)]
    out += [_goals(t, f"{side}, ") for side, t in totals.items()]
    out += ["", "## Held-out side by deadline set", ""]
    for k, rows in data["sides"]["held-out"]["by_deadlines"].items():
        out += [f"### {heldout.DEADLINE_SETS[k]}", "", _spot_block(rows)]
    return "\n".join(out)


def classic_heldout(data: dict[str, Any]) -> str:
    published = _constant("PUBLISHED", "simulator")["Pollux (published)"]
    out = ["| load | tuning (workloads 1-4) | held out (5-8) | all eight | Pollux (published) |",
           "|---|---|---|---|---|"]
    for load, row in data["pollux_t4"].items():
        out.append(f"| {load}x | {row['tuning']['avg_jct_h']:.3f} h | "
                   f"{row['held-out']['avg_jct_h']:.3f} h | {row['all_avg_jct_h']:.3f} h | "
                   f"{published[float(load)]} h |")
    het = data["hetero"]
    out += ["", f"Heterogeneous cluster, Sia's conventions (held out): {het['avg_jct_h']:.3f} h "
            "average JCT (Sia published 0.6 h, Pollux 1.0 h, Gavel 1.9 h); per trace: "
            + ", ".join(f"{x:.3f} h" for x in het["per_workload_h"]) + "."]
    return "\n".join(out) + "\n"


def dashboard(data: dict[str, Any]) -> str:
    states = ", ".join(f"{n} {s}" for s, n in data["states"].items())
    out = [f"{data['jobs']:,} jobs ({states}); Chromium {data['chromium']}; {data['cpus']} CPUs; "
           f"{data['loads_per_page']} loads per page after a first one.", "",
           "| page | first (wall) | median (wall) | max (wall) | median (in browser) |",
           "|---|---|---|---|---|"]
    for name, p in data["pages"].items():
        out.append(f"| {name} | {p['first_wall_ms']:.0f} ms | {p['median_wall_ms']:.0f} ms | "
                   f"{p['max_wall_ms']:.0f} ms | {p['median_in_browser_ms']:.0f} ms |")
    out += ["", f"Target under {data['target_ms']:.0f} ms: slowest median "
            f"{data['worst_median_wall_ms']:.0f} ms, slowest single load "
            f"{data['worst_wall_ms']:.0f} ms."]
    return "\n".join(out) + "\n"


def metrics(data: dict[str, Any]) -> str:
    ms = data["scrape_ms"]
    states = ", ".join(f"{n:,} {s}" for s, n in data["states"].items())
    return "\n".join([
        f"{data['jobs']:,} jobs ({states}), {data['teams']} teams, {data['pools']} pools; "
        f"{data['series']} series, {data['response_bytes']:,} bytes per scrape, "
        f"{data['cpus']} CPUs.\n",
        "| scrape | time |", "|---|---|",
        f"| first (the API read every job as it started) | {data['first_scrape_ms']:,.0f} ms |",
        f"| next {data['scrapes']}: median | {ms['median']:.1f} ms |",
        f"| p10 / p90 | {ms['p10']:.1f} / {ms['p90']:.1f} ms |",
        f"| min / max | {ms['min']:.1f} / {ms['max']:.1f} ms |",
        f"| target | {data['target_ms']} ms |", "",
        "CPU time of one scrape (the mean over the scrapes after the first): "
        f"{data['cpu_ms_per_scrape']['api_process']:.1f} ms in the API process, "
        f"{data['cpu_ms_per_scrape']['redis_server']:.1f} ms in redis-server."]) + "\n"


def _figure(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def measured(data: dict[str, Any]) -> str:
    """A speed benchmark's file (``tests.bench.results``): its setup, then each quantity's
    median and spread."""
    out = ["Setup:", "", *(f"- {k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                           for k, v in data["setup"].items()),
           "", "| measurement | median | spread (min - max) | samples |", "|---|---|---|---|"]
    for label, m in data["numbers"].items():
        if "median" in m:
            out.append(f"| {label} | {_figure(m['median'])} {m['unit']} | "
                       f"{_figure(m['min'])} - {_figure(m['max'])} | {m['n']} |")
        else:
            out.append(f"| {label} | {_figure(m['value'])} {m['unit']} | | |")
    return "\n".join(out) + "\n"


def _renderer(name: str, data: dict[str, Any]) -> Callable[[dict[str, Any]], str] | None:
    """How a result file is rendered: its bench's own table, else the one shape every speed
    benchmark writes."""
    if name in RENDER:
        return RENDER[name]
    return measured if {"command", "date", "setup", "numbers"} <= set(data) else None


RENDER: dict[str, Callable[[dict[str, Any]], str]] = {
    "simulator": simulator, "seed_claim": seed_claim, "hetero": hetero, "spot": spot,
    "spot_heldout": spot_heldout, "classic_heldout": classic_heldout, "dashboard": dashboard,
    "metrics": metrics}


def page(name: str, doc: str) -> str:
    """The markdown of one benchmark's page."""
    summary, _, setup = doc.partition("\n\n")
    result = RESULTS / f"{name}.json"
    data = json.loads(result.read_text()) if result.exists() else {}
    # the published numbers' own command line, options included, where the file records one
    command = data.get("command", f"python -m tests.bench {name}")
    out = [f"# Benchmark: {name}", "", " ".join(summary.split()), "", setup.strip(), "",
           "## Command", "", "```bash", f"{command}        # or: make bench (every benchmark)",
           "```", ""]
    render = _renderer(name, data)
    if render is not None:
        out += ["## Numbers", "",
                f"From `examples/results/{name}.json`, measured {_date(result)} by the command "
                "above; this page is generated from that file at every docs build.", "",
                render(data)]
    else:
        out += ["## Numbers", "",
                f"This benchmark writes no result file under `examples/results/`, so no numbers "
                f"are published here: run `{command}` to measure them on your machine (it prints "
                "its tables)."]
    return "\n".join(out) + "\n"


def index(benches: dict[str, str]) -> str:
    def published(name: str) -> str:
        result = RESULTS / f"{name}.json"
        return f"yes, {_date(result)}" if result.exists() else "no"

    rows = [f"| [{name}]({name}.md) | {_summary(doc)} | {published(name)} |"
            for name, doc in benches.items()]
    return "\n".join([
        "# Benchmarks", "",
        "Every benchmark is a module in `tests/bench/`; `make bench` runs them all, "
        "`python -m tests.bench NAME` one. Each page below is generated at docs build time from "
        "the module's docstring and, where the benchmark writes one, its JSON in "
        "`examples/results/`.", "",
        "| benchmark | what it measures | published numbers |", "|---|---|---|", *rows]) + "\n"


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Fill the nav's Benchmarks section with every benchmark's page."""
    pages = ["benchmarks/index.md", *(f"benchmarks/{n}.md" for n in _benches())]
    for item in config.nav or []:
        if isinstance(item, dict) and item.get("Benchmarks") == "benchmarks/index.md":
            item["Benchmarks"] = pages
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated benchmark pages and the simulator's plot."""
    benches = _benches()
    files.append(File.generated(config, "benchmarks/index.md", content=index(benches)))
    for name, doc in benches.items():
        files.append(File.generated(config, f"benchmarks/{name}.md", content=page(name, doc)))
    files.append(File.generated(config, f"benchmarks/{PLOT}", abs_src_path=str(RESULTS / PLOT)))
    return files
