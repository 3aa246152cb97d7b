"""The demo job: a small convnet on scikit-learn's digits; a plain DDP script plus two lines.

Runs as one process, under ``torchrun --standalone --nproc-per-node K``, or under the broker's
agent (``python -m broker.runtime.agent -- python examples/train_digits.py ...``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import broker.runtime as fleet


def digits(split: str) -> TensorDataset:
    """A fixed 80/20 train/test split of the 1,797 8x8 digit images, scaled to [0, 1]."""
    # scikit-learn's bundled copy, read directly: importing sklearn.datasets costs every worker
    # seconds of start-up (load_digits reads this same file).
    sklearn_dir = Path(importlib.util.find_spec("sklearn").origin).parent  # type: ignore[union-attr, arg-type]
    data = np.loadtxt(sklearn_dir / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    images = torch.tensor(data[:, :-1] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    labels = torch.tensor(data[:, -1], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    cut = int(0.8 * len(labels))
    idx = order[:cut] if split == "train" else order[cut:]
    return TensorDataset(images[idx], labels[idx])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-mode", choices=["fixed", "elastic"], default=None)
    p.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default=None,
                   help="elastic mode: how the LR follows the global batch (default linear)")
    p.add_argument("--checkpoint-dir", default=None, help="default: FLEET_CHECKPOINT_URI")
    p.add_argument("--checkpoint-every-steps", type=int, default=None)
    p.add_argument("--max-micro-batch", type=int, default=None, help="per-worker memory limit")
    p.add_argument("--save-final", default=None, help="rank 0 writes the final state_dict here")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    model = Net()
    ddp = DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    train = digits("train")
    loader = fleet.elastic(ddp, optimizer, train, scheduler=scheduler, **fleet.from_args(args))

    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"test accuracy {accuracy(model, digits('test')):.4f}")
        if args.save_final:
            torch.save(model.state_dict(), args.save_final)
    if dist.is_initialized():
        dist.barrier()  # ranks tear down together: gloo can abort a rank that leaves early
        dist.destroy_process_group()
        # Gloo's threads drop a finished collective's tensors a moment later; if the interpreter
        # is finalizing by then, the process aborts (SIGABRT) after a good run. Nothing is left
        # to release, so leave without finalizing.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
