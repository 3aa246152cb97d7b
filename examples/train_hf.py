"""A plain Hugging Face Trainer job: a small GPT-2, built from a config, on synthetic sequences.

Nothing in it knows FleetBroker. Run under the agent
(``python -m broker.runtime.agent --nproc 2 -- python examples/train_hf.py``) it checkpoints on
a stop, resumes at any world size and keeps the job's global batch (FLEET_GLOBAL_BATCH_SIZE, else
``--batch-size`` x ``--grad-accum`` x the first launch's workers); see docs/runtime.md. It also
runs as one process or under ``torchrun``, as any Trainer script does.

The sequences count up from a random start by a random stride (mod the vocabulary), so the
loss falls as the model learns to continue them. Dropout is off: a dropout mask depends on
which rank draws it, so only a model without one can end bit-for-bit alike at another size.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Counting(Dataset):
    """``n`` sequences of ``length`` tokens: ``start + i * stride`` mod ``vocab``."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="per-device batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--output-dir", default="hf-output")
    p.add_argument("--save-final", help="torch.save the final state_dict here (rank 0)")
    args = p.parse_args()

    vocab, length = 64, 16
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=max(1, args.steps // 10),
        seed=args.seed,
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=training, train_dataset=Counting(args.samples, length, vocab, args.seed)
    )
    trainer.train()
    if args.save_final and trainer.is_world_process_zero():
        torch.save(trainer.model.state_dict(), args.save_final)


if __name__ == "__main__":
    main()
