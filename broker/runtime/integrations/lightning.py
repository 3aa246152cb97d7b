"""PyTorch Lightning, made stoppable and resizable without a code change.

Installed when a worker imports ``lightning.pytorch`` (or ``pytorch_lightning``):
``Trainer.__init__`` is wrapped so that every Trainer sees the agent's torchrun-style variables as
its cluster environment (``devices`` = the node's workers, ``num_nodes`` = the rest; DDP with gloo
on CPU, NCCL on GPU) and gets a :class:`FleetCallback`.

When ``fit`` asks for its training data, the callback takes it over. The job's global batch
``B`` is the latest checkpoint's, else FLEET_GLOBAL_BATCH_SIZE, else the script's
``batch_size x accumulate_grad_batches x world size``; each of the ``W`` ranks takes ``B / W``
samples a step as ``G`` equal micro-batches no larger than the script's ``batch_size``, and
``accumulate_grad_batches`` becomes ``G``. Lightning's own accumulation (loss / ``G``) and DDP's
mean over ranks then give the mean-loss gradient of the same ``B`` samples at any world size.

The state lives in the runtime's own :class:`broker.runtime.trainer.Trainer`: data order from
(seed, epoch, sample index) only (the seed is ``seed_everything``'s), sharded checkpoints in
FLEET_CHECKPOINT_URI (model, optimizer, LR scheduler, step, data position, RNGs), restore at any
world size, the agreement on stops and periodic checkpoints after each optimizer step (SIGTERM:
checkpoint, exit 75), and the progress file. Lightning's step counter starts at the restored
step, so ``max_steps`` ends the job where the uninterrupted run ends; the job's steps
(``max_steps``, else ``max_epochs`` worth of samples) run as one Lightning epoch.

Not covered (such a ``fit`` runs as the plain script, with a warning): manual optimization,
several optimizers or LR schedulers, a training loader without a ``batch_size`` (its own batch
sampler) or a data set without a length. Not supported: a ``ckpt_path`` given to ``fit`` (the
job's position is its latest checkpoint in FLEET_CHECKPOINT_URI). Only the ``fixed`` batch mode.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
from types import ModuleType
from typing import Any

from broker.protocol import EXIT_STOPPED, Env
from broker.runtime.assignment import Assignment, AssignmentError
from broker.runtime.integrations.batching import saved_batch, split
from broker.runtime.trainer import Trainer as Runtime


def _warn(message: str) -> None:
    print(f"fleet: {message}", file=sys.stderr)


class _Loader:
    """What Lightning iterates: this rank's micro-batches from the restored position on."""

    def __init__(self, runtime: Runtime, batches: int) -> None:
        self.runtime, self.batches, self.dataset = runtime, batches, runtime.dataset

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        return iter(self.runtime.batches())


def _unsupported(trainer: Any, loader: Any) -> str | None:
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization"
    if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
        return "several optimizers or LR schedulers"
    if getattr(loader, "batch_size", None) is None or not hasattr(loader.dataset, "__len__"):
        return "a training loader without a batch_size or a data set without a length"
    return None


def take_over(trainer: Any, loader: Any) -> tuple[Runtime, _Loader] | None:
    """Start the runtime on ``loader``'s data set and set Lightning up for the job's batch."""
    reason = _unsupported(trainer, loader)
    if reason is not None:
        _warn(f"{reason} is not supported: this fit runs without the fleet integration")
        return None
    a = Assignment.from_env()
    if a.batch_mode == "elastic":
        _warn(f"{Env.BATCH_MODE}=elastic is not supported for Lightning; the batch stays fixed")
    world, cap = trainer.world_size, loader.batch_size
    batch = (
        saved_batch(a.checkpoint_uri)
        or a.global_batch_size
        or cap * trainer.accumulate_grad_batches * world
    )
    if batch % world:
        raise AssignmentError(
            f"the global batch {batch} does not split evenly over {world} workers (Lightning "
            f"averages equal micro-batches); run on a number of workers that divides {batch}"
        )
    micro, accumulate = split(batch // world, cap)
    if trainer.max_steps > 0:
        steps = trainer.max_steps
    elif trainer.max_epochs is not None and trainer.max_epochs > 0:
        steps = math.ceil(trainer.max_epochs * len(loader.dataset) / batch)
    else:
        raise AssignmentError("the job needs an end: give the Trainer max_steps or max_epochs")
    schedulers = trainer.lr_scheduler_configs
    runtime = Runtime(
        trainer.lightning_module,
        trainer.optimizers[0],
        loader.dataset,
        batch_size=batch,
        steps=steps,
        scheduler=schedulers[0].scheduler if schedulers else None,
        batch_mode="fixed",
        max_micro_batch=micro,
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),  # seed_everything's
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        even_batch=True,  # Lightning's equal micro-batches: a W that does not divide B fails
    )
    trainer.accumulate_grad_batches = accumulate
    loop = trainer.fit_loop.epoch_loop
    loop.max_steps = steps
    # Lightning counts optimizer steps from the restored one (what restoring its loops does)
    counter = loop.automatic_optimization.optim_progress.optimizer.step.total
    counter.ready = counter.completed = loop._batches_that_stepped = runtime.step
    return runtime, _Loader(runtime, (steps - runtime.step) * accumulate)


def _callback_class(base: type, sigterm: type[BaseException]) -> type:
    class FleetCallback(base):  # type: ignore[misc, valid-type]
        """Takes over ``fit``'s training data and drives the runtime from Lightning's hooks."""

        def __init__(self) -> None:
            self.runtime: Runtime | None = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            # The strategy's hook sees every loader once Lightning has set it up; only the
            # training loader (asked for while the trainer trains) is replaced.
            strategy = trainer.strategy
            own = strategy.process_dataloader

            def process_dataloader(loader: Any) -> Any:
                loader = own(loader)
                if not trainer.training:
                    return loader
                self.close()
                taken = take_over(trainer, loader)
                if taken is None:
                    return loader
                self.runtime, loader = taken
                return loader

            strategy.process_dataloader = process_dataloader

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            runtime = self.runtime
            if runtime is not None and trainer.global_step > runtime.step:  # an optimizer step
                runtime.step_done()
                runtime.boundary()  # a stop checkpoints and exits here

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.runtime is not None:
                self.runtime.finish()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            if isinstance(exception, sigterm):
                # Lightning's own SIGTERM handler saw the stop, before the runtime's took over:
                # nothing trained since the latest checkpoint, so it is a clean stop, not the
                # exit 0 (finished) Lightning would give it.
                exception.code = EXIT_STOPPED  # type: ignore[attr-defined]
            self.close()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            trainer.strategy.__dict__.pop("process_dataloader", None)
            self.close()

        def close(self) -> None:
            if self.runtime is not None:
                self.runtime.close()
                self.runtime = None

    return FleetCallback


def install(module: ModuleType) -> None:
    """Wrap ``module.Trainer.__init__`` (``module``: ``lightning.pytorch`` or
    ``pytorch_lightning``) to add the agent's cluster environment and the callback."""
    environments = importlib.import_module(f"{module.__name__}.plugins.environments")
    exceptions = importlib.import_module(f"{module.__name__}.utilities.exceptions")
    callback_class = _callback_class(module.Callback, exceptions.SIGTERMException)

    class AgentEnvironment(environments.TorchElasticEnvironment):
        """torchrun's variables as the agent sets them (it sets no GROUP_RANK)."""

        def node_rank(self) -> int:
            return self.global_rank() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    init = module.Trainer.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        a = Assignment.from_env()
        plugins = kwargs.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if not any(isinstance(p, environments.ClusterEnvironment) for p in plugins):
            plugins.append(AgentEnvironment())
            for name, value, default in (
                ("devices", a.local_world_size, "auto"),
                ("num_nodes", a.world_size // a.local_world_size, 1),
            ):
                given = kwargs.get(name, default)
                if given not in (default, value):
                    _warn(f"Trainer({name}={given!r}) becomes {value}: the agent runs the workers")
                kwargs[name] = value
        kwargs["plugins"] = plugins
        callbacks = kwargs.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        kwargs["callbacks"] = [*callbacks, callback_class()]
        init(self, *args, **kwargs)

    module.Trainer.__init__ = __init__
