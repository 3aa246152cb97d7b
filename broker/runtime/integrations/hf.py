"""The Hugging Face ``transformers`` Trainer, made stoppable and resizable without a code change.

Installed when a worker imports ``transformers.trainer``: ``Trainer.__init__`` is wrapped so that
each Trainer gets a :class:`FleetCallback` and its arguments are rewritten for the job's fixed
global batch ``B`` (the latest checkpoint's; else FLEET_GLOBAL_BATCH_SIZE; else the script's
``per_device_train_batch_size x gradient_accumulation_steps x world size``). Each of the ``W``
ranks takes ``B / W`` samples a step as ``G`` equal micro-batches no larger than the script's
per-device batch; the Trainer's own accumulation (mean loss / ``G``, DDP's mean over ranks, or
its token count over the global batch) then gives the mean-loss gradient of the same ``B``
samples at any world size. The micro-batch (the largest divisor of ``B / W`` within the cap) is
the same at every ``W`` that divides ``B`` by it, which keeps even a model whose loss ignores the
Trainer's ``num_items_in_batch`` (the Trainer then scales its gradient by ``W x G``) exact.

The state lives in the runtime's own :class:`broker.runtime.trainer.Trainer`, built when training
begins: data order from (seed, epoch, sample index) only, sharded checkpoints in
FLEET_CHECKPOINT_URI (model, optimizer, LR scheduler, step, data position, RNGs), restore at any
world size, the agreement on stops and periodic checkpoints between steps (SIGTERM: checkpoint,
exit 75), and the progress file. The Trainer iterates the runtime's micro-batches from the
restored position, so it never skips batches itself; the runtime's own gradient accumulation
stays idle, as it acts only inside its own iteration.

A ``resume_from_checkpoint`` the script passes to ``train`` is ignored, with a warning: the
job's position is its latest checkpoint in FLEET_CHECKPOINT_URI. Not covered (such a Trainer runs
as the plain script, with a warning): a training set without a length, ``auto_find_batch_size``,
a Trainer subclass with its own ``get_train_dataloader``. Only the ``fixed`` batch mode.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from types import ModuleType
from typing import Any

import torch
from transformers.trainer_callback import TrainerCallback

from broker.protocol import Env
from broker.runtime.assignment import Assignment, AssignmentError
from broker.runtime.integrations.batching import saved_batch, split
from broker.runtime.trainer import Trainer as Runtime


class FleetCallback(TrainerCallback):
    """Drives the runtime's state from the Trainer's events (see the module docstring)."""

    def __init__(self, trainer: Any, batch: int, steps: int) -> None:
        self.trainer, self.batch, self.steps = trainer, batch, steps
        self.source: Any = None  # the Trainer's own data loader: dataset and collate function
        self.runtime: Runtime | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.runtime is not None:
            self.runtime.close()
        t = self.trainer
        self.runtime = Runtime(
            t.model,
            getattr(t.optimizer, "optimizer", t.optimizer),  # accelerate's wrapper holds it
            self.source.dataset,
            batch_size=self.batch,
            steps=self.steps,
            scheduler=t.lr_scheduler,
            batch_mode="fixed",
            max_micro_batch=args.per_device_train_batch_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_workers=args.dataloader_num_workers,
            collate_fn=self.source.collate_fn,
            even_batch=True,  # the Trainer's equal micro-batches: a W that does not divide B fails
        )
        # The Trainer counts from here: its logged loss averages and its report cover this run.
        state.global_step = t._globalstep_last_logged = t._initial_global_step = self.runtime.step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        runtime = self.runtime
        assert runtime is not None
        runtime.step_done()
        runtime.boundary()  # a stop checkpoints and exits here

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.runtime is not None:
            self.runtime.finish()
            self.runtime.close()
            self.runtime = None


class _Loader:
    """What the Trainer iterates: this rank's micro-batches from the restored position. Its
    length is the whole job's, as the Trainer counts every run's steps from 0."""

    def __init__(self, callback: FleetCallback, source: Any, batches: int) -> None:
        self.callback, self.dataset, self.batches = callback, source.dataset, batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        runtime = self.callback.runtime
        assert runtime is not None, "the Trainer iterates its data only after on_train_begin"
        return iter(runtime.batches())


def _warn(message: str) -> None:
    print(f"fleet: {message}", file=sys.stderr)


def attach(trainer: Any) -> FleetCallback | None:
    """Rewrite ``trainer``'s batch arguments for the job's global batch and add the callback."""
    data, args = trainer.train_dataset, trainer.args
    if data is None:
        return None
    if not hasattr(data, "__len__"):
        _warn(
            "the training set has no length, so its order cannot follow the job's: "
            "this Trainer runs without the fleet integration"
        )
        return None
    if args.auto_find_batch_size:
        _warn(
            "auto_find_batch_size changes the batch the job's maths is fixed to: "
            "this Trainer runs without the fleet integration"
        )
        return None
    if not getattr(type(trainer).get_train_dataloader, "fleet", False):
        _warn(
            f"{type(trainer).__name__} builds its own training data loader: "
            "it runs without the fleet integration"
        )
        return None
    a = Assignment.from_env()
    if a.batch_mode == "elastic":
        _warn(f"{Env.BATCH_MODE}=elastic is not supported for the Trainer; the batch stays fixed")
    world = a.world_size
    batch = (
        saved_batch(a.checkpoint_uri)
        or a.global_batch_size
        or args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    )
    if batch % world:
        raise AssignmentError(
            f"the global batch {batch} does not split evenly over {world} workers (the Trainer "
            f"averages equal micro-batches); run on a number of workers that divides {batch}"
        )
    micro, accumulate = split(batch // world, args.per_device_train_batch_size)
    steps = (
        args.max_steps
        if args.max_steps > 0
        else math.ceil(args.num_train_epochs * len(data) / batch)
    )
    args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, accumulate
    args.max_steps = steps
    args.average_tokens_across_devices = True  # a token-mean loss over the global batch
    trainer._train_batch_size = args.train_batch_size
    callback = FleetCallback(trainer, batch, steps)
    trainer.add_callback(callback)
    trainer._fleet = callback
    return callback


def install(module: ModuleType) -> None:
    """Wrap ``transformers.trainer.Trainer``'s constructor, training data loader and ``train``."""
    if not torch.accelerator.is_available():
        # Without it, accelerate runs the workers of a machine without an accelerator as
        # separate single-process jobs, each training its own model (it wants use_cpu=True).
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    cls = module.Trainer
    init, loader, train = cls.__init__, cls.get_train_dataloader, cls.train

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        attach(self)

    @functools.wraps(loader)
    def get_train_dataloader(self: Any) -> Any:
        own = loader(self)
        callback = getattr(self, "_fleet", None)
        if callback is None:
            return own
        callback.source = own
        return _Loader(callback, own, callback.steps * self.args.gradient_accumulation_steps)

    @functools.wraps(train)
    def train_(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint and getattr(self, "_fleet", None) is not None:
            # The Trainer would skip batches and set its step from its own checkpoint, at odds
            # with the position the runtime restores.
            _warn(
                f"train(resume_from_checkpoint={resume_from_checkpoint!r}) is ignored: the job "
                f"resumes from its latest checkpoint in {Env.CHECKPOINT_URI}"
            )
            resume_from_checkpoint = None
        return train(self, resume_from_checkpoint, *args, **kwargs)

    get_train_dataloader.fleet = True  # type: ignore[attr-defined]  # not a subclass's own
    cls.__init__ = __init__
    cls.get_train_dataloader = get_train_dataloader
    cls.train = train_
