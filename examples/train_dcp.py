"""A plain FSDP2 script that checkpoints with torch.distributed.checkpoint (DCP) itself.

It imports nothing from FleetBroker. Every ``--checkpoint-every-steps`` steps it saves model,
optimizer and step with ``dcp.save`` into ``--checkpoint-dir/step-N`` (default: the job's
``FLEET_CHECKPOINT_URI``, a local path, where the agent sees the commits and reports the job as
resumable), and at start it loads the newest complete one (DCP writes ``.metadata`` last), at any
world size: DCP reshards the sharded state. Each step's global batch is drawn from the step
number alone and split evenly over the ranks, and FSDP averages the ranks' mean losses, so the
maths do not depend on the world size (``--batch-size`` must be divisible by it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

FEATURES, OUTPUTS = 16, 4


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: inputs and a fixed nonlinear target of them."""
    target = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(step))
    return x, torch.tanh(x @ target)


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, OUTPUTS))


def newest(folder: Path) -> tuple[int, Path] | None:
    done = [
        (int(p.name.split("-")[1]), p) for p in folder.glob("step-*") if (p / ".metadata").exists()
    ]
    return max(done) if done else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=12, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    job_dir = os.environ.get("FLEET_CHECKPOINT_URI")  # the job's, under FleetBroker
    p.add_argument("--checkpoint-dir", default=job_dir, required=job_dir is None)
    p.add_argument("--checkpoint-every-steps", type=int, default=5)
    p.add_argument("--save-final", default=None, help="rank 0 writes the full state_dict here")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    folder, step = Path(args.checkpoint_dir), 0
    found = newest(folder)
    if found is not None:
        step, path = found
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if rank == 0:
            print(f"resumed from step {step} with {world} ranks")

    while step < args.steps:
        x, y = batch(step, args.batch_size)
        x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        step += 1
        if step % args.checkpoint_every_steps == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / f"step-{step}")

    if args.save_final:  # a collective: every rank takes part, rank 0 writes
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save(full, args.save_final)
    dist.barrier()  # ranks tear down together: gloo can abort a rank that leaves early
    dist.destroy_process_group()
    # Gloo's threads drop a finished collective's tensors a moment later; if the interpreter
    # is finalizing by then, the process aborts (SIGABRT) after a good run. Nothing is left
    # to release, so leave without finalizing.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
