"""FleetBroker's steady-state overhead: step time of one training with and without it, side by side.

Each comparison trains one model two ways, its loop ``without`` FleetBroker and ``with`` it, in
the same worker processes, in turns of a few steps (``tests/bench/overhead_loops.py``: A B B A
A B ..., so each block of steps of one loop runs right next to the same block of the other and a
change in the machine's load hits both alike; the time a loop waits for its turn is not
counted). Each pair of blocks gives one overhead: the median step time with FleetBroker over
that without. Reported per world size and launcher: the median overhead over every block pair
of every run, with its spread, interquartile range and a 95% bootstrap confidence interval, and
each loop's step time. The workers are started ``bare`` (as ``torchrun`` starts them) and by
FleetBroker's node agent (``python -m broker.runtime.agent``, heartbeats to a loopback stand-in
for the broker, the runtime writing its progress file), runs of the two alternating; the
agent's own cost, a separate process beside the workers, is its CPU time over theirs.

Comparison ``runtime``: the script's loop over ``fleet.elastic`` (fixed batch) against the same
model and loop over a plain ``DataLoader`` (a ``DistributedSampler`` in a group); comparison
``fsdp`` the same two loops over the model sharded with FSDP2 instead of DDP. Model:
``examples/train_synthetic.py``'s ``tiny`` transformer, global batch 16 x 64 tokens, one thread
per worker, gloo on CPU (NCCL with ``--device cuda``), world sizes 1 and 2 on one machine. No
periodic checkpoint falls in the measured steps (the checkpoint benchmark measures those).

Comparisons ``lightning`` and ``hf``: the same model trained by a Lightning or a Hugging Face
Trainer (``tests/bench/overhead_frameworks.py``), under the agent with the integration it injects
and with FLEET_INTEGRATIONS=off. An integration patches the framework for the whole process, so
the two cannot share one: they run as separate trainings one right after the other (without,
with, with, without, ...), and each pair of runs gives one overhead, the median step time with
the integration over that without.

Options: ``--repeats`` (runs per launcher and world size, 4), ``--steps`` (measured per loop and
run, 120), ``--warmup`` (10), ``--block`` (2), ``--world-sizes`` (1,2), ``--size`` (tiny),
``--device`` (cpu; ``cuda`` on a GPU machine; the framework comparisons run on the CPU),
``--only NAME`` (runtime, fsdp, lightning, hf). Writes
``examples/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from broker.protocol import Env
from broker.runtime.agent import free_port
from tests.bench.overhead_frameworks import FRAMEWORKS
from tests.bench.results import ROOT, measured, single, write
from tests.http_stub import serve

TARGET_PCT = 3.0  # Singularity's steady-state overhead
BOOTSTRAP = 10_000
LAUNCHERS = ("bare", "agent")


@dataclass(frozen=True)
class Comparison:
    """One script two ways: loop ``without`` FleetBroker and loop ``with_`` it (both of
    ``overhead_loops.LOOPS``), interleaved in the same worker processes."""

    name: str
    without: str
    with_: str


COMPARISONS = (
    Comparison("runtime", "plain", "runtime"),
    Comparison("fsdp", "plain-fsdp", "runtime-fsdp"),
)


class Broker(BaseHTTPRequestHandler):
    """A stand-in for the broker's heartbeat endpoint: takes every report, says go on."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"action": null, "round": 0, "brokers": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def _env(threads: int) -> dict[str, str]:
    """The workers' environment: this checkout's code, no FleetBroker assignment inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` itself used so far, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    times: dict[str, list[float]]  # loop -> rank 0's step times (s)
    agent_cpu_share: float | None  # the agent's CPU time over its workers' (under the agent)


def launch(
    worker: list[str],
    launcher: str,
    world: int,
    args: argparse.Namespace,
    broker_url: str,
    folder: Path,
    label: str,
    env: dict[str, str] | None = None,
) -> float | None:
    """Start ``world`` processes of ``worker``, ``bare`` (as torchrun starts workers) or by the
    ``agent``, and wait for them; the agent's CPU time over its workers' (under the agent)."""
    env = {**_env(args.threads), **(env or {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    agent_cpu: list[float] = []
    if launcher == "agent":
        env.update(
            {
                Env.JOB_ID: "overhead",
                Env.ATTEMPT: "1",
                Env.BROKER_URL: broker_url,
                Env.PROGRESS_FILE: str(folder / "progress.json"),
            }
        )
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker.runtime.agent",
                    "--nproc",
                    str(world),
                    "--",
                    *worker,
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        ]
        while procs[0].poll() is None:  # its own CPU time, read until it exits
            if (used := _cpu_s(procs[0].pid)) is not None:
                agent_cpu.append(used)
            time.sleep(0.1)
    else:
        port = free_port()
        procs = [
            subprocess.Popen(
                worker,
                cwd=ROOT,
                env={
                    **env,
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for r in range(world)
        ]
    errors = [p.communicate(timeout=args.timeout)[1] for p in procs]
    failed = [(p.returncode, e) for p, e in zip(procs, errors, strict=True) if p.returncode]
    if failed:
        code, err = failed[0]
        raise RuntimeError(
            f"{label}, {launcher}, world size {world}: exit {code}: "
            f"{err.decode(errors='replace')[-2000:]}"
        )
    if not agent_cpu:
        return None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return agent_cpu[-1] / max(total - agent_cpu[-1], 1e-9)


def run(
    comparison: Comparison,
    launcher: str,
    world: int,
    args: argparse.Namespace,
    broker_url: str,
    folder: Path,
) -> Run:
    """One run of ``comparison``'s two loops, interleaved, at world size ``world``, started
    ``bare`` (as torchrun starts workers) or by the ``agent``."""
    times = folder / "times.json"
    times.unlink(missing_ok=True)
    worker = [
        sys.executable,
        "-m",
        "tests.bench.overhead_loops",
        "--loops",
        f"{comparison.without},{comparison.with_}",
        "--times",
        str(times),
        "--steps",
        str(args.steps + args.warmup),
        "--block",
        str(args.block),
        "--size",
        args.size,
        "--batch-size",
        str(args.batch_size),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
    ]
    share = launch(worker, launcher, world, args, broker_url, folder, comparison.name)
    return Run(json.loads(times.read_text()), share)


def run_framework(
    framework: str,
    integrated: bool,
    world: int,
    args: argparse.Namespace,
    broker_url: str,
    folder: Path,
) -> list[float]:
    """Rank 0's step times of one ``framework`` training under the agent, with its integration
    injected or (FLEET_INTEGRATIONS=off) without."""
    times = folder / "times.json"
    times.unlink(missing_ok=True)
    worker = [
        sys.executable,
        "-m",
        "tests.bench.overhead_frameworks",
        "--framework",
        framework,
        "--times",
        str(times),
        "--steps",
        str(args.steps + args.warmup),
        "--size",
        args.size,
        "--batch-size",
        str(args.batch_size),
        "--threads",
        str(args.threads),
    ]
    env = {} if integrated else {Env.INTEGRATIONS: "off"}
    launch(worker, "agent", world, args, broker_url, folder, framework, env)
    return json.loads(times.read_text())


def run_overheads(without: list[list[float]], with_: list[list[float]], warmup: int) -> list[float]:
    """Overhead (%) of each pair of runs made one after the other: medians of their step times,
    the warm-up left out."""
    return [
        100 * (statistics.median(b[warmup:]) / statistics.median(a[warmup:]) - 1)
        for a, b in zip(without, with_, strict=True)
    ]


def block_overheads(
    without: list[float], with_: list[float], warmup: int, block: int
) -> list[float]:
    """Overhead (%) of each pair of blocks that ran side by side: block ``j`` of both loops
    (``overhead_loops.interleave``), medians of their step times, the warm-up left out."""
    a, b = without[warmup:], with_[warmup:]
    return [
        100 * (statistics.median(b[i : i + block]) / statistics.median(a[i : i + block]) - 1)
        for i in range(0, min(len(a), len(b)) - block + 1, block)
    ]


def bootstrap_ci(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return meds[int(0.025 * BOOTSTRAP)], meds[int(0.975 * BOOTSTRAP) - 1]


def summarise(
    key: str,
    runs: list[Run],
    c: Comparison,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One comparison, launcher and world size over its runs: each side's step time, and the
    overhead of every pair of blocks: median, spread, interquartile range, 95% CI."""
    pcts = [
        x
        for r in runs
        for x in block_overheads(r.times[c.without], r.times[c.with_], args.warmup, args.block)
    ]
    low, high = bootstrap_ci(pcts)
    q = statistics.quantiles(pcts, n=4)
    steps = {
        side: [t for r in runs for t in r.times[side][args.warmup :]]
        for side in (c.without, c.with_)
    }
    return {
        f"{key}: step time, {c.without} loop": measured(steps[c.without], "ms", 1e3),
        f"{key}: step time, {c.with_} loop": measured(steps[c.with_], "ms", 1e3),
        f"{key}: overhead (block pairs)": measured(pcts, "%"),
        f"{key}: overhead, interquartile range": single(q[2] - q[0], "%"),
        f"{key}: overhead, 95% CI low": single(low, "%"),
        f"{key}: overhead, 95% CI high": single(high, "%"),
    }


@contextlib.contextmanager
def workspace() -> Iterator[tuple[str, Path]]:
    with serve(Broker) as url, tempfile.TemporaryDirectory(prefix="fleet-overhead-") as tmp:
        yield url, Path(tmp)


def summarise_framework(
    key: str, without: list[list[float]], with_: list[list[float]], args: argparse.Namespace
) -> dict[str, Any]:
    """One framework and world size over its pairs of runs: each side's step time, and the
    overhead of every pair: median, spread, interquartile range, 95% CI."""
    pcts = run_overheads(without, with_, args.warmup)
    low, high = bootstrap_ci(pcts)
    q = statistics.quantiles(pcts, n=4) if len(pcts) > 1 else [pcts[0]] * 3
    return {
        f"{key}: step time, without the integration": measured(
            [t for r in without for t in r[args.warmup :]], "ms", 1e3
        ),
        f"{key}: step time, with it": measured(
            [t for r in with_ for t in r[args.warmup :]], "ms", 1e3
        ),
        f"{key}: overhead (run pairs)": measured(pcts, "%"),
        f"{key}: overhead, interquartile range": single(q[2] - q[0], "%"),
        f"{key}: overhead, 95% CI low": single(low, "%"),
        f"{key}: overhead, 95% CI high": single(high, "%"),
    }


def _report(key: str, part: dict[str, Any], pairs: str) -> None:
    o = part[f"{key}: overhead ({pairs})"]
    lo, hi = (part[f"{key}: overhead, 95% CI {e}"]["value"] for e in ("low", "high"))
    print(
        f"  {key}: median overhead {o['median']:+.2f}% over {o['n']} {pairs} (95% CI "
        f"{lo:+.2f}% .. {hi:+.2f}%): target under {TARGET_PCT:g}% "
        f"{'met' if hi < TARGET_PCT else 'not shown'}",
        flush=True,
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    names = [c.name for c in COMPARISONS] + list(FRAMEWORKS)
    if args.only and not set(args.only) <= set(names):
        raise SystemExit("--only: no such comparison; choose from " + ", ".join(names))
    comparisons = [c for c in COMPARISONS if not args.only or c.name in args.only]
    frameworks = [f for f in FRAMEWORKS if not args.only or f in args.only]
    numbers: dict[str, Any] = {}
    with workspace() as (url, folder):
        for world in args.world_sizes:
            for c in comparisons:
                got: dict[str, list[Run]] = {x: [] for x in LAUNCHERS}
                for rep in range(args.repeats):  # bare, agent, agent, bare, ...
                    for launcher in LAUNCHERS[:: 1 if rep % 2 == 0 else -1]:
                        got[launcher].append(run(c, launcher, world, args, url, folder))
                    print(
                        f"{c.name}, world size {world}: repetition {rep + 1}/{args.repeats}",
                        flush=True,
                    )
                for launcher, runs in got.items():
                    key = f"{c.name}, world size {world}, {launcher}"
                    part = summarise(key, runs, c, args)
                    numbers.update(part)
                    _report(key, part, "block pairs")
                shares = [
                    100 * r.agent_cpu_share for r in got["agent"] if r.agent_cpu_share is not None
                ]
                if shares:
                    key = f"{c.name}, world size {world}: the agent's CPU time over its workers'"
                    numbers[key] = measured(shares, "%")
                    print(f"  {key}: median {statistics.median(shares):.2f}%", flush=True)
            for f in frameworks:
                sides: dict[bool, list[list[float]]] = {False: [], True: []}
                for rep in range(args.repeats):  # without, with, with, without, ...
                    for integrated in (False, True)[:: 1 if rep % 2 == 0 else -1]:
                        sides[integrated].append(
                            run_framework(f, integrated, world, args, url, folder)
                        )
                    print(
                        f"{f}, world size {world}: repetition {rep + 1}/{args.repeats}", flush=True
                    )
                key = f"{f}, world size {world}, agent"
                part = summarise_framework(key, sides[False], sides[True], args)
                numbers.update(part)
                _report(key, part, "run pairs")
    return numbers


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.bench overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--repeats", type=int, default=4, help="runs per launcher")
    p.add_argument("--steps", type=int, default=120, help="steps of each loop measured per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps of each loop left out")
    p.add_argument("--block", type=int, default=2, help="steps of one turn of a loop")
    p.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--only", action="append", help="only this comparison (repeatable)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 * args.block or args.warmup % args.block:
        p.error(
            "--repeats must be at least 1, --steps at least two blocks, and --warmup a "
            "multiple of --block (block pairs stay aligned)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """``argv``: the options; by default the command line's, after the benchmark names
    (``python -m tests.bench overhead --repeats 4``)."""
    if argv is None:
        argv = list(itertools.dropwhile(lambda a: not a.startswith("-"), sys.argv[1:]))
    args = parse(argv)
    numbers = measure(args)
    setup = {
        "model": f"examples/train_synthetic.py {args.size} transformer, global batch "
        f"{args.batch_size} x 64 tokens",
        "device": args.device,
        "threads per worker": args.threads,
        "world sizes": args.world_sizes,
        "runs per launcher (bare, agent) or framework side, and world size": args.repeats,
        "steps measured per loop and run": args.steps,
        "warm-up steps left out": args.warmup,
        "steps per turn (block)": args.block,
        "comparisons": [
            f"{c.name}: {c.with_} loop vs {c.without} loop"
            for c in COMPARISONS
            if not args.only or c.name in args.only
        ]
        + [
            f"{f}: its Trainer under the agent with the integration vs FLEET_INTEGRATIONS=off"
            for f in FRAMEWORKS
            if not args.only or f in args.only
        ],
        "target": f"overhead under {TARGET_PCT:g}% (upper end of the 95% CI)",
    }
    write("overhead", setup, numbers, argv)


if __name__ == "__main__":
    main()
