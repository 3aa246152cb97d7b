"""Checkpoint speed against the raw disk, the async-save pause, and the runtime's steady-state cost.

1. A ~100M-parameter transformer with AdamW state (about 1.2 GB): sync save and restore times
   through the runtime (DCP + manifest) as a fraction of raw sequential write/read of the same
   bytes to the same folder, measured in the same run (page cache dropped with fadvise before
   every read; every write fsync'd, as DCP's are).
2. The pause training sees with an asynchronous save (copy into reused host buffers).
3. Steady state: median step time of the plain loop and of the same loop through
   ``fleet.elastic`` (a 4M-parameter transformer, batch 16 x 64 tokens, one thread, interleaved
   blocks of 20 steps), without and with an async checkpoint every 40 steps.

Knobs: FLEET_BENCH_DIR (where to write; default a temp folder), FLEET_BENCH_REPEATS (3),
FLEET_BENCH_STEPS (steps per variant for the overhead part, 160). Writes
``examples/results/checkpoint.json``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader

import broker.runtime as fleet
from broker.runtime.assignment import Assignment
from broker.runtime.checkpoint import Checkpointer
from broker.runtime.checkpoint_stores import LocalStore
from tests.bench.results import measured, single, write

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 20


def example():
    spec = importlib.util.spec_from_file_location(
        "train_synthetic", ROOT / "examples" / "train_synthetic.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def drop_cache(folder: Path) -> None:
    for f in folder.rglob("*") if folder.is_dir() else [folder]:
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(path: Path, nbytes: int) -> float:
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, CHUNK)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: Path) -> float:
    drop_cache(path)
    buf = bytearray(CHUNK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def checkpoint_speed(work: Path, repeats: int) -> dict:
    ex = example()
    torch.manual_seed(0)
    model = ex.build("100m", 128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = ex.synthetic(ex.SIZES["100m"][0], 1, 32)[:1]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()  # creates the optimizer state
    params = sum(p.numel() for p in model.parameters())
    ck = Checkpointer(LocalStore(work / "ckpt"), keep=2)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    shared, manifest = {"step": 0}, {"world_size": 1}

    saves, loads, writes, reads, pauses, async_totals = [], [], [], [], [], []
    step = itertools.count(1)
    for _ in range(repeats):
        s = next(step)
        start = time.perf_counter()
        ck.save(s, state, shared, manifest, asynchronous=False)
        saves.append(time.perf_counter() - start)
        nbytes = folder_bytes(ck.store.local_dir(s))
        raw = work / "raw.bin"
        writes.append(raw_write(raw, nbytes))
        reads.append(raw_read(raw))
        raw.unlink()
        drop_cache(ck.store.local_dir(s))
        start = time.perf_counter()
        ck.load(s, state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loads.append(time.perf_counter() - start)
        s = next(step)
        start = time.perf_counter()
        ck.save(s, state, shared, manifest, asynchronous=True)
        pauses.append(ck.last_pause_s)
        ck.wait()
        async_totals.append(time.perf_counter() - start)
    med = statistics.median
    gb = nbytes / 1e9
    return {
        "parameters": params,
        "checkpoint_bytes": nbytes,
        "raw write": measured(writes, "s"),
        "raw read": measured(reads, "s"),
        "sync save": measured(saves, "s"),
        "restore": measured(loads, "s"),
        "raw write rate": measured([gb / w for w in writes], "GB/s"),
        "raw read rate": measured([gb / r for r in reads], "GB/s"),
        "sync save rate": measured([gb / s for s in saves], "GB/s"),
        "restore rate": measured([gb / r for r in loads], "GB/s"),
        "sync save / raw write speed": single(med(writes) / med(saves), "x"),
        "restore / raw read speed": single(med(reads) / med(loads), "x"),
        "async save: training paused (after the first)": measured(pauses[1:] or pauses, "s"),
        "async save: first pause (buffers allocated)": single(pauses[0], "s"),
        "async save: total until written": measured(async_totals, "s"),
    }


def step_times(batches: Iterator, model, opt, n: int) -> list[float]:
    """Time ``n`` training steps fed by ``batches`` (loop body plus fetching the batch)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def overhead(work: Path, steps: int, block: int = 20) -> dict:
    ex = example()
    data = ex.synthetic(ex.SIZES["small"][0], 4096, 64)
    runs: dict[str, list[float]] = {}
    iters, models = {}, {}
    for name in ("plain", "fleet", "plain-2", "fleet-async-ckpt"):
        torch.manual_seed(0)
        model = ex.build("small", 64)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        if name.startswith("plain"):
            loader = DataLoader(
                data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
            )
            batches = itertools.chain.from_iterable(itertools.repeat(loader))
        else:
            ckpt = (
                {"checkpoint_dir": work / name, "checkpoint_every_steps": 40}
                if "ckpt" in name
                else {}
            )
            progress = Assignment(progress_file=str(work / f"{name}.json"), progress_interval=1.0)
            batches = iter(
                fleet.elastic(
                    model, opt, data, batch_size=16, steps=steps + 1, assignment=progress, **ckpt
                )
            )
        iters[name], models[name], runs[name] = batches, (model, opt), []
    step_times(iters["plain"], *models["plain"], 5)  # warm-up
    for _ in range(steps // block):  # interleaved, so load changes hit every variant alike
        for name in runs:
            runs[name] += step_times(iters[name], *models[name], block)
    med = {name: statistics.median(t) for name, t in runs.items()}
    mean = {name: statistics.fmean(t) for name, t in runs.items()}
    return {
        "steps_per_variant": len(runs["plain"]),
        **{f"step time: {name}": measured(t, "ms", 1e3) for name, t in runs.items()},
        "overhead of fleet.elastic (medians)": single(100 * (med["fleet"] / med["plain"] - 1),
                                                      "%"),
        "overhead with an async checkpoint every 40 steps (medians)": single(
            100 * (med["fleet-async-ckpt"] / med["plain-2"] - 1), "%"),
        "overhead with an async checkpoint every 40 steps (means)": single(
            100 * (mean["fleet-async-ckpt"] / mean["plain-2"] - 1), "%"),
    }


def main() -> None:
    repeats = int(os.environ.get("FLEET_BENCH_REPEATS", "3"))
    steps = int(os.environ.get("FLEET_BENCH_STEPS", "160"))
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-", dir=os.environ.get("FLEET_BENCH_DIR")))
    try:
        results = {"checkpoint": checkpoint_speed(work, repeats)}
        torch.set_num_threads(1)  # the comparison is about the runtime, not thread scheduling
        results["overhead"] = overhead(work, steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c, o = results["checkpoint"], results["overhead"]

    def m(key: str, part: dict = c) -> float:
        return part[key]["median"]

    lines = [
        f"model {c['parameters'] / 1e6:.1f}M parameters, "
        f"checkpoint {c['checkpoint_bytes'] / 1e9:.2f} GB",
        f"raw write {m('raw write rate'):.2f} GB/s, save {m('sync save rate'):.2f} GB/s "
        f"-> {100 * c['sync save / raw write speed']['value']:.0f}% of raw "
        f"({m('sync save'):.2f} s)",
        f"raw read {m('raw read rate'):.2f} GB/s, restore {m('restore rate'):.2f} GB/s "
        f"-> {100 * c['restore / raw read speed']['value']:.0f}% of raw ({m('restore'):.2f} s)",
        f"async save: training paused {m('async save: training paused (after the first)'):.2f} s "
        f"(first {c['async save: first pause (buffers allocated)']['value']:.2f} s) of "
        f"{m('async save: total until written'):.2f} s; sync save {m('sync save'):.2f} s",
        f"steady state ({o['steps_per_variant']} steps each, medians): "
        f"plain {m('step time: plain', o):.1f} ms, fleet {m('step time: fleet', o):.1f} ms "
        f"-> overhead {o['overhead of fleet.elastic (medians)']['value']:+.1f}%",
        "with async checkpoint every 40 steps: median "
        f"{o['overhead with an async checkpoint every 40 steps (medians)']['value']:+.1f}%, mean "
        f"{o['overhead with an async checkpoint every 40 steps (means)']['value']:+.1f}%",
    ]
    print("\n".join(lines))
    setup = {"model": f"{c.pop('parameters') / 1e6:.1f}M-parameter transformer with AdamW state",
             "checkpoint size": f"{c.pop('checkpoint_bytes') / 1e9:.2f} GB",
             "repeats": repeats, "overhead model": "4M-parameter transformer, batch 16 x 64 "
             "tokens, one thread, interleaved blocks of 20 steps",
             "steps per variant": o.pop("steps_per_variant")}
    write("checkpoint", setup, {**c, **o})
