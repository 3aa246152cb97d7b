"""The synthetic GPT of ``examples/train_synthetic.py`` trained on the GPU through the runtime
(the runtime starts the process group: NCCL, as the model is on the GPU). Deterministic kernels,
so that a stopped and resumed run can be compared with an uninterrupted one bit for bit."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_synthetic import SIZES, build, synthetic

import broker.runtime as fleet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--save-final")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    model = build(args.size, 64).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    train = synthetic(SIZES[args.size][0], 4096, 64, 0)
    loader = fleet.elastic(model, opt, train, batch_size=args.batch_size, steps=args.steps,
                           checkpoint_dir=args.checkpoint_dir)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for x, y in loader:
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        n += 1
    torch.cuda.synchronize()
    backend = dist.get_backend() if dist.is_initialized() else "none"
    print(f"RESULT steps={n} seconds={time.perf_counter() - start:.3f} backend={backend}")
    if args.save_final:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save_final)


if __name__ == "__main__":
    main()
