"""The framework trainings ``bench_overhead`` runs in pairs: a Lightning or Hugging Face Trainer.

``python -m tests.bench.overhead_frameworks --framework lightning --times FILE [...]`` trains
``examples/train_synthetic.py``'s transformer on its synthetic tokens with the framework's own
Trainer, and rank 0 writes its step times (seconds, JSON list) to ``FILE``: from one optimizer
step's end to the next, as a callback of the bench's own sees them. Started by the node agent,
the framework integration (``broker.runtime.integrations``) is injected into it unless
FLEET_INTEGRATIONS=off; the bench runs it both ways, one after the other.

The script names its cluster itself (DDP on every worker the launcher started, gloo on CPU), as a
script run under ``torchrun`` does, so it trains on every worker without the integration too, and
its per-device batch is the global batch over the workers, so the integration keeps one
micro-batch a step. No checkpoint falls in the measured steps (FLEET_CHECKPOINT_URI is unset).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from tests.bench.bench_checkpoint import example


class Tokens(Dataset):
    """The synthetic tokens as the frameworks take them: ``(x, y)`` pairs, or HF's dicts."""

    def __init__(self, data: Any, as_dict: bool) -> None:
        self.data, self.as_dict = data, as_dict

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        return {"input_ids": x, "labels": y} if self.as_dict else (x, y)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class Stamps:
    """Each optimizer step's end; the step times are the gaps."""

    def __init__(self) -> None:
        self.at: list[float] = [time.perf_counter()]

    def mark(self) -> None:
        self.at.append(time.perf_counter())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.at, self.at[1:], strict=False)]


def lightning(net: nn.Module, data: Any, args: argparse.Namespace, stamps: Stamps) -> bool:
    """Train with a Lightning Trainer; True on the global rank 0."""
    import lightning as L
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class Timing(L.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            stamps.mark()

    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=args.world // local,
        strategy="ddp" if args.world > 1 else "auto",
        plugins=[TorchElasticEnvironment()] if "WORLD_SIZE" in os.environ else None,
        max_steps=args.steps,
        callbacks=[Timing()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(Tokens(data, False), batch_size=args.batch_size // args.world)
    trainer.fit(Module(), loader)
    return trainer.is_global_zero


def hf(net: nn.Module, data: Any, args: argparse.Namespace, stamps: Stamps) -> bool:
    """Train with a Hugging Face Trainer; True on the global rank 0."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            return {"loss": _loss(self.net, input_ids, labels)}

    class Timing(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamps.mark()

    with_dir = Path(args.times).parent / "hf-output"
    training = TrainingArguments(
        output_dir=str(with_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size // args.world,
        learning_rate=3e-4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=Model(), args=training, train_dataset=Tokens(data, True), callbacks=[Timing()]
    )
    trainer.train()
    return trainer.is_world_process_zero()


FRAMEWORKS = {"lightning": lightning, "hf": hf}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    p.add_argument("--times", type=Path, required=True, help="rank 0's step times (JSON)")
    p.add_argument("--steps", type=int, default=130, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(args.threads)
    ex = example()
    torch.manual_seed(0)
    net = ex.build(args.size, args.context)
    data = ex.synthetic(ex.SIZES[args.size][0], 4096, args.context, 0)
    stamps = Stamps()
    if FRAMEWORKS[args.framework](net, data, args, stamps):
        args.times.write_text(json.dumps(stamps.times()))


if __name__ == "__main__":
    main()
