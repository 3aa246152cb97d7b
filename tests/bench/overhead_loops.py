"""The training loops ``bench_overhead`` compares, interleaved in one worker process per rank.

``python -m tests.bench.overhead_loops --loops plain,runtime --times FILE [...]`` trains
``examples/train_synthetic.py``'s transformer on its synthetic tokens with each loop, in turns
of a few steps (:func:`interleave`), and rank 0 writes every loop's step times (seconds, JSON:
loop -> list) to ``FILE``. A loop is a function ``(LoopConfig, on_step) -> None`` that runs
``config.steps`` optimizer steps and calls ``on_step()`` after each: a framework that owns its
loop (a Trainer) calls it from its own step-end callback. Adding an integration is one entry in
``LOOPS``.

Both loops start the process group the same way (gloo on CPU, NCCL on CUDA) when the launcher set
``WORLD_SIZE``, train the same model on the same data at the same global batch, and move each
batch to ``--device`` themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import broker.runtime as fleet
from tests.bench.bench_checkpoint import example

OnStep = Callable[[], None]


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    batch_size: int  # global
    size: str  # train_synthetic.SIZES
    context: int
    device: str
    seed: int = 0
    fsdp: bool = False  # shard with FSDP2 (``fully_shard`` on every block, then the model)


def _model(cfg: LoopConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """The model (DDP-wrapped in a group, or sharded), its optimizer and the data set, seeded
    alike."""
    ex = example()
    torch.manual_seed(cfg.seed)
    model = ex.build(cfg.size, cfg.context).to(cfg.device)
    if cfg.fsdp:
        for block in model.blocks.layers:
            fully_shard(block)
        fully_shard(model)
    elif dist.is_initialized():
        ids = [torch.device(cfg.device).index or 0] if cfg.device.startswith("cuda") else None
        model = DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = ex.synthetic(ex.SIZES[cfg.size][0], 4096, cfg.context, cfg.seed)
    return model, optimizer, data


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    device: str,
) -> None:
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()


def plain(cfg: LoopConfig, on_step: OnStep) -> None:
    """Without FleetBroker: a DataLoader (a DistributedSampler in a group) over the data."""
    model, optimizer, data = _model(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    sampler = DistributedSampler(data, seed=cfg.seed) if dist.is_initialized() else None
    loader = DataLoader(
        data,
        batch_size=cfg.batch_size // world,
        sampler=sampler,  # type: ignore[arg-type]
        shuffle=sampler is None,
        generator=torch.Generator().manual_seed(cfg.seed),
        drop_last=True,
    )
    done, epoch = 0, 0
    while done < cfg.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            _step(model, optimizer, x, y, cfg.device)
            on_step()
            done += 1
            if done == cfg.steps:
                return
        epoch += 1


def runtime(cfg: LoopConfig, on_step: OnStep) -> None:
    """FleetBroker's runtime: the same loop over ``fleet.elastic`` (fixed batch) instead."""
    model, optimizer, data = _model(cfg)
    loader = fleet.elastic(
        model,
        optimizer,
        data,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        batch_mode="fixed",
        seed=cfg.seed,
    )
    for x, y in loader:
        optimizer.zero_grad()
        _step(model, optimizer, x, y, cfg.device)
        on_step()


def sharded(loop: Callable[[LoopConfig, OnStep], None]) -> Callable[[LoopConfig, OnStep], None]:
    """``loop`` over the model sharded with FSDP2 instead of DDP."""
    return lambda cfg, on_step: loop(dataclasses.replace(cfg, fsdp=True), on_step)


# name -> loop; the bench's comparisons name these. An FSDP loop needs a process group, even of
# one process: ``main`` starts one for it.
LOOPS: dict[str, Callable[[LoopConfig, OnStep], None]] = {
    "plain": plain,
    "runtime": runtime,
    "plain-fsdp": sharded(plain),
    "runtime-fsdp": sharded(runtime),
}


def interleave(loops: dict[str, Callable[[OnStep], None]], block: int) -> dict[str, list[float]]:
    """Run ``loops`` in turns of ``block`` steps in this one process (each in its own thread,
    one at a time: a baton passes at every turn), in the order A B B A A B ... so that block
    ``j`` of every loop runs right next to block ``j`` of the others and a drift of the
    machine's speed hits them alike. Each loop's step times: from the moment it had the baton
    (or its last step ended) to the end of its step, never the time it waited."""
    names = list(loops)
    cycle = names + names[::-1]
    cond = threading.Condition()
    owner = {"k": 0}
    done: set[str] = set()
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: list[BaseException] = []

    def hand_on() -> None:  # with cond held: the next block's owner that still runs
        if len(done) < len(names):
            owner["k"] += 1
            while cycle[owner["k"] % len(cycle)] in done:
                owner["k"] += 1
        cond.notify_all()

    def mine(name: str) -> bool:
        return bool(failed) or cycle[owner["k"] % len(cycle)] == name

    def body(name: str) -> None:
        resumed = 0.0

        def on_step() -> None:
            nonlocal resumed
            times[name].append(time.perf_counter() - resumed)
            if len(times[name]) % block == 0:
                with cond:
                    hand_on()
                    cond.wait_for(lambda: mine(name))
            resumed = time.perf_counter()

        with cond:
            cond.wait_for(lambda: mine(name))
        resumed = time.perf_counter()
        try:
            loops[name](on_step)
        except BaseException as exc:  # the bench reports it; the other loop must not hang
            failed.append(exc)
        with cond:
            done.add(name)
            hand_on()

    threads = [threading.Thread(target=body, args=(n,), name=n) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--loops", default="plain,runtime", help="the loops to interleave")
    p.add_argument("--times", type=Path, required=True, help="rank 0's step times (JSON)")
    p.add_argument("--steps", type=int, default=70, help="steps of each loop")
    p.add_argument("--block", type=int, default=5, help="steps of a turn")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--size", default="tiny")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    names = args.loops.split(",")
    if unknown := set(names) - set(LOOPS):
        p.error(f"--loops: unknown {', '.join(sorted(unknown))}; known: {', '.join(LOOPS)}")
    torch.set_num_threads(args.threads)
    device = args.device
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    elif any(n.endswith("-fsdp") for n in names) and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    cfg = LoopConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        size=args.size,
        context=args.context,
        device=device,
    )

    def timed(loop: Callable[[LoopConfig, OnStep], None]) -> Callable[[OnStep], None]:
        def run(on_step: OnStep) -> None:
            if cuda:
                torch.cuda.set_device(device)  # the current device is per thread

            def step_end() -> None:
                if cuda:
                    torch.cuda.synchronize()  # a step is done when its kernels are
                on_step()

            loop(cfg, step_end)

        return run

    times = interleave({n: timed(LOOPS[n]) for n in names}, args.block)
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.times.write_text(json.dumps(times))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
