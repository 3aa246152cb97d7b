"""A small GPT-style transformer on synthetic tokens, for throughput and checkpoint benchmarks.

The data is a deterministic token stream with learnable structure (each token follows from the
previous two), so the loss falls. ``--size 100m`` builds a ~100M-parameter model (GPT-2 small
shape with a 16k vocabulary). A plain DDP script plus the same two lines as train_digits.py;
``--fsdp`` shards it with FSDP2 instead (``fully_shard`` on every block, then on the whole model).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import broker.runtime as fleet

SIZES = {  # name: (vocab, d_model, layers, heads)
    "tiny": (512, 128, 2, 4),
    "small": (4096, 256, 4, 4),
    "100m": (16384, 768, 12, 12),
}


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=dropout,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def build(size: str, context: int, dropout: float = 0.1) -> GPT:
    vocab, d_model, layers, heads = SIZES[size]
    return GPT(vocab, d_model, layers, heads, context, dropout)


def synthetic(vocab: int, sequences: int, context: int, seed: int = 0) -> TensorDataset:
    """Token t = (3 * t[-1] + t[-2] + 1) mod vocab after two random tokens: learnable, infinite."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(sequences, context + 1, dtype=torch.long)
    seq[:, :2] = torch.randint(0, vocab, (sequences, 2), generator=g)
    for t in range(2, context + 1):
        seq[:, t] = (3 * seq[:, t - 1] + seq[:, t - 2] + 1) % vocab
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-mode", choices=["fixed", "elastic"], default=None)
    p.add_argument("--checkpoint-dir", default=None, help="default: FLEET_CHECKPOINT_URI")
    p.add_argument("--checkpoint-every-steps", type=int, default=None)
    p.add_argument("--max-micro-batch", type=int, default=None, help="per-worker memory limit")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="sgd (momentum 0.9): no division by tiny second moments, so runs at "
                   "different world sizes agree to rounding")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    p.add_argument("--save-final", default=None, help="rank 0 writes the full state_dict here")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    elif args.fsdp:  # fully_shard needs a process group, even of one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build(args.size, args.context, args.dropout)
    if args.fsdp:
        for block in model.blocks.layers:
            fully_shard(block)
        ddp = fully_shard(model)
    else:
        ddp = DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = (torch.optim.AdamW(ddp.parameters(), lr=args.lr) if args.optimizer == "adamw"
                 else torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9))
    train = synthetic(SIZES[args.size][0], 4096, args.context, args.seed)
    loader = fleet.elastic(ddp, optimizer, train, **fleet.from_args(args))

    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"trained to step {loader.step} in {time.perf_counter() - start:.1f} s")
    if args.save_final:  # a collective under FSDP: every rank takes part, rank 0 writes
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(full, args.save_final)
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
