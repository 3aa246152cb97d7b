"""A plain PyTorch Lightning job: a small MLP regressing a fixed random function of its input.

Nothing in it knows FleetBroker. Run under the agent
(``python -m broker.runtime.agent --nproc 2 -- python examples/train_lightning.py``) it
checkpoints on a stop, resumes at any world size and keeps the job's global batch
(FLEET_GLOBAL_BATCH_SIZE, else ``--batch-size`` x ``--accumulate`` x the first launch's workers);
see docs/runtime.md. It also runs as one process, as any Lightning script does.

No dropout: a dropout mask depends on which rank draws it, so only a model without one can end
bit-for-bit alike at another world size.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def synthetic(n: int, dim: int, seed: int) -> TensorDataset:
    """``n`` inputs and the outputs of a fixed random two-layer network on them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, dim, generator=g) / dim**0.5
    y = torch.tanh(x @ teacher).sum(dim=1, keepdim=True)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    def __init__(self, dim: int, width: int, lr: float, steps: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, width), nn.Tanh(), nn.Linear(width, 1))
        self.lr, self.steps = lr, steps

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (self.steps + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="samples per device and forward")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-final", help="write the final parameters here (rank 0)")
    args = p.parse_args()

    L.seed_everything(args.seed)
    data = synthetic(args.samples, args.dim, args.seed)
    model = Regressor(args.dim, args.width, args.lr, args.steps)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f}")
        if args.save_final:
            torch.save(model.state_dict(), args.save_final)


if __name__ == "__main__":
    main()
