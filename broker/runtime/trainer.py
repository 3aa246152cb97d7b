"""The elastic trainer: an iterable of micro-batches that makes a DDP loop resumable and resizable.

``fleet.elastic(model, optimizer, dataset, batch_size=..., steps=...)`` replaces the script's
DataLoader. Iterating it yields this rank's micro-batches; the script's own ``zero_grad`` /
``backward`` / ``step`` / ``scheduler.step`` calls stay as they are. Between optimizer steps the
trainer agrees with all ranks (one tiny all-reduce) whether to checkpoint, stop or re-form the
group at the size the agent ordered (in place: docs/runtime.md), and it checkpoints, resumes and
reshards through :mod:`broker.runtime.checkpoint`.

Gradient maths: the loss is assumed to be a mean over the micro-batch (PyTorch's default). A
micro-batch of ``m`` samples in a global batch of ``B`` carries weight ``m / B``; the accumulated
gradient is kept in units of the current micro-batch's weight, and the all-reduce (a DDP
communication hook, or our own all-reduce without DDP) multiplies by the last weight and sums. The
optimizer therefore always sees the mean-loss gradient of exactly the ``B`` samples of the step,
however they were spread over ranks and micro-batches.

FSDP2 (``fully_shard``) models reduce-scatter every micro-batch's gradient, so there the weight
is applied before each reduce-scatter (FSDP's divide factor set to 1, a custom reduce-scatter
that multiplies by this rank's current weight and sums), the sharded gradients accumulate the
already weighted sums, and every rank runs the same number of micro-batches (each one is a
collective).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from broker.protocol import EXIT_STOPPED
from broker.runtime import failure
from broker.runtime.assignment import BATCH_MODES, Assignment
from broker.runtime.checkpoint import Checkpointer
from broker.runtime.checkpoint_stores import open_store
from broker.runtime.data import MicroBatch, step_plan
from broker.runtime.noise import NoiseScale, squared_norm
from broker.runtime.scaling import lr_factor

log = logging.getLogger("fleet")
if not log.handlers:  # resumes, stops and checkpoints are worth seeing in every job's log
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("fleet: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class _WeightedReduceScatter(DefaultReduceScatter):
    """FSDP's reduce-scatter with this rank's micro-batch weight applied first, then a sum."""

    def __init__(self, weight: Callable[[], float]) -> None:
        self.weight = weight

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        input_tensor.mul_(self.weight())
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )


class Trainer:
    """Iterate it instead of a DataLoader; see the module docstring and :func:`elastic`.

    ``batch_size`` is the global batch the learning rate was tuned for and ``steps`` the job's
    length in optimizer steps at that batch (or ``epochs``). ``batch_mode`` ``fixed`` keeps
    ``batch_size`` across resizes; ``elastic`` runs at ``global_batch_size`` (default:
    FLEET_GLOBAL_BATCH_SIZE) with the LR scaled by ``lr_scaling`` (linear, sqrt, none).
    ``max_micro_batch`` caps the samples per forward pass (gradient accumulation beyond it).
    Checkpoints go to ``checkpoint_dir`` (default FLEET_CHECKPOINT_URI; none = no checkpoints)
    every ``checkpoint_every_steps`` / ``checkpoint_every_seconds`` (default: the job spec's
    interval, FLEET_CHECKPOINT_EVERY_*), keeping ``keep_checkpoints``.
    ``seed`` fixes the data order. ``assignment`` replaces the environment (tests, notebooks).

    A framework that runs its own loop (``broker.runtime.integrations.hf``) takes its data from
    :meth:`batches` and calls :meth:`step_done`, :meth:`boundary` after each optimizer step and
    :meth:`finish` at the end, as iterating the trainer does. Such a framework that averages
    equal micro-batches passes ``even_batch=True``: the progress file then says the job needs a
    global batch that divides by the world size, and the broker offers only such batches.

    ``model`` is a DDP model, a model sharded with FSDP2's ``fully_shard`` (the optimizer built
    on its DTensor parameters), or a plain module.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        *,
        batch_size: int | None = None,
        steps: int | None = None,
        epochs: float | None = None,
        scheduler: Any = None,
        global_batch_size: int | None = None,
        batch_mode: str | None = None,
        lr_scaling: str = "linear",
        max_micro_batch: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_seconds: float | None = None,
        keep_checkpoints: int | None = None,
        async_checkpoint: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        assignment: Assignment | None = None,
        even_batch: bool = False,
    ) -> None:
        a = assignment or Assignment.from_env()
        self.assignment = a
        self.even_batch = even_batch
        self.model, self.optimizer, self.dataset, self.scheduler = (
            model,
            optimizer,
            dataset,
            scheduler,
        )
        self.n = len(dataset)  # type: ignore[arg-type]
        self.seed = seed
        self.num_workers = num_workers
        self.collate_fn = collate_fn or default_collate
        self.async_checkpoint = async_checkpoint

        # Arguments (the script's flags) win over the environment, which wins over defaults.
        self.batch_mode = (batch_mode or a.batch_mode or "fixed").lower()
        if self.batch_mode not in BATCH_MODES:
            raise ValueError(f"batch_mode={batch_mode!r}; use one of {', '.join(BATCH_MODES)}")
        base = batch_size or a.global_batch_size
        if not base:
            raise ValueError("give batch_size= (the global batch the learning rate is tuned for)")
        self.base_batch_size = int(base)
        # fixed: the script's batch is the job's batch; elastic: the allocator's choice wins.
        chosen = (
            global_batch_size or batch_size
            if self.batch_mode == "fixed"
            else global_batch_size or a.global_batch_size
        )
        self.global_batch_size = int(chosen or base)
        if steps is None and epochs is None:
            raise ValueError("give steps= (optimizer steps at batch_size) or epochs=")
        self.total_samples = int(
            steps * self.base_batch_size if steps is not None else epochs * self.n  # type: ignore[operator]
        )
        self.lr_scaling = lr_scaling
        lr_factor(lr_scaling, 1, 1)  # reject an unknown rule now, not at the first step
        self.max_micro_batch = max_micro_batch
        # An interval the script passes replaces the broker's (the job spec's), not adds to it.
        if checkpoint_every_steps or checkpoint_every_seconds:
            self.every_steps, self.every_seconds = checkpoint_every_steps, checkpoint_every_seconds
        else:
            self.every_steps, self.every_seconds = (a.checkpoint_every_steps,
                                                    a.checkpoint_every_seconds)

        self._init_distributed(a, on_gpu=any(p.is_cuda for p in model.parameters()))
        ckpt_group = self._new_groups()

        uri = checkpoint_dir or a.checkpoint_uri
        try:
            store = None if uri is None else open_store(uri)
        except OSError as exc:
            cause = failure.describe("cannot create the checkpoint directory", exc)
            failure.report(cause)
            raise RuntimeError(cause) from exc
        self.checkpointer = (
            None
            if store is None
            else Checkpointer(
                store,
                rank=self.rank,
                local_rank=a.local_rank,
                group=ckpt_group,
                keep=keep_checkpoints or a.checkpoint_keep,
            )
        )

        self.step = 0
        self.samples_done = 0
        self.finished = False
        self.noise = NoiseScale()  # the gradient noise scale, reported with the progress
        self.generation = a.resize_join or 0  # in-place resizes this job went through
        # A joining rank starts its loop where the others are: just past a step boundary.
        self._joined = bool(a.resize_join)
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._in_place = False  # set once this trainer's own loop runs (``__iter__``)
        if a.resize_join:
            self._share_state()  # a running group's rank 0 has the state: no checkpoint read
        else:
            self._restore()
        # Refuse an impossible split now, with the fix in the message, not at the first step.
        step_plan(self.seed, self.n, 0, self.global_batch_size, self.world_size, self.rank, None)

        self._micro: MicroBatch | None = None
        self._next_weight: float | None = None
        self._local_n = 0  # this rank's samples in the current step
        # this step's squared norms, local and all-reduced, on the gradients' device
        self._sq: list[torch.Tensor | None] = [None, None]
        self._previous: torch.Tensor | None = None  # a lone replica's last mean gradient
        self._accumulating = False
        self._factor = (
            1.0
            if self.batch_mode == "fixed"
            else lr_factor(lr_scaling, self.global_batch_size, self.base_batch_size)
        )
        self._wrap()

        self._stop = threading.Event()
        self._ckpt_request = threading.Event()
        # the all-reduce of what the last boundary saw, and its tensor (see ``boundary``)
        self._agreeing: tuple[Any, torch.Tensor] | None = None
        self._order_seen: tuple[int, int] = (0, 0)  # the order file's mtime, its generation
        self._handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._handlers = {
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self._stop.set()),
                signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda *_: self._ckpt_request.set()),
            }
        self._saved_step = self.step
        self._last_ckpt_time = time.monotonic()
        self._progress_at = (time.monotonic(), self.samples_done)
        self._progress_written = 0.0
        self._rate = 0.0
        if self.rank == 0:
            log.info(
                "rank %d/%d: %s batch %d (base %d, lr x%.3g), step %d, samples %d of %d",
                self.rank,
                self.world_size,
                self.batch_mode,
                self.global_batch_size,
                self.base_batch_size,
                self._factor,
                self.step,
                self.samples_done,
                self.total_samples,
            )
        # at once: the agent tells the broker this job resumes where it stops
        self._write_progress(force=True)

    # ---- set-up -----------------------------------------------------------------------------
    @staticmethod
    def _init_distributed(a: Assignment, *, on_gpu: bool) -> None:
        """Start the process group unless the script already did: NCCL for a model on the GPU,
        gloo for one on the CPU (a CPU model on a GPU machine too: NCCL takes CUDA tensors
        only)."""
        if not a.distributed or dist.is_initialized():
            return
        if on_gpu:
            torch.cuda.set_device(a.local_rank)
        dist.init_process_group("nccl" if on_gpu else "gloo")

    def _new_groups(self) -> dist.ProcessGroup | None:
        """Note rank and world of the default group; make the trainer's own groups (each rank
        calls this at the same point: a group's creation is collective). The checkpoint's."""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # Own gloo groups: control flags never wait behind NCCL kernels, and the background
        # checkpoint thread's collectives never interleave with the training thread's.
        self._control = dist.new_group(backend="gloo") if self.world_size > 1 else None
        return dist.new_group(backend="gloo") if dist.is_initialized() else None

    def _restore(self) -> None:
        if self.checkpointer is None:
            return
        step = self.checkpointer.latest()
        if step is None:
            return
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        manifest, shared = self.checkpointer.load(step, state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        if self.scheduler is not None and shared.get("scheduler") is not None:
            self.scheduler.load_state_dict(shared["scheduler"])
        self.step, self.samples_done = shared["step"], shared["samples_done"]
        self.finished = bool(shared.get("finished"))
        saved_batch = int(shared["global_batch_size"])
        if self.batch_mode == "fixed" and saved_batch != self.global_batch_size:
            log.warning(
                "fixed batch mode: keeping the checkpoint's global batch %d (asked %d)",
                saved_batch,
                self.global_batch_size,
            )
            self.global_batch_size = saved_batch
        if self.rank == 0:
            log.info(
                "resumed from step %d (written by %d ranks) in %s",
                step,
                manifest.get("world_size", 1),
                self.checkpointer.store.uri,
            )

    def _wrap(self) -> None:
        """Route the script's optimizer/scheduler calls through the accumulation logic."""
        opt = self.optimizer
        real_step, real_zero = opt.step, opt.zero_grad

        @functools.wraps(real_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._optimizer_step(real_step, *args, **kwargs)

        @functools.wraps(real_zero)
        def zero_grad(*args: Any, **kwargs: Any) -> None:
            if not self._accumulating:
                real_zero(*args, **kwargs)

        opt.step, opt.zero_grad = step, zero_grad  # type: ignore[method-assign]
        if self.scheduler is not None:
            real_sched = self.scheduler.step

            @functools.wraps(real_sched)
            def sched_step(*args: Any, **kwargs: Any) -> Any:
                if self._micro is None or self._micro.last:
                    return real_sched(*args, **kwargs)
                return None

            self.scheduler.step = sched_step
        if self._ddp is not None:
            self._ddp.register_comm_hook(None, self._weighted_allreduce)
        reduce_scatter = _WeightedReduceScatter(self._current_weight)
        for module in self._fsdp:
            module.set_gradient_divide_factor(1.0)  # the weights already make it a mean
            try:
                module.set_custom_reduce_scatter(reduce_scatter)
            except ValueError as exc:  # several parameter groups (per-parameter meshes)
                raise ValueError(
                    f"fleet.elastic cannot weight this FSDP module's gradients: {exc}; "
                    "shard it on one mesh (no shard_placement_fn meshes)"
                ) from exc

    def _current_weight(self) -> float:
        """This rank's share of the step, for FSDP; plain averaging outside the loop."""
        return self._micro.weight if self._micro is not None else 1.0 / self.world_size

    def _weighted_allreduce(self, _state, bucket):  # DDP rejects string annotations on hooks
        buf = bucket.buffer()
        if self._micro is None:  # a backward outside the loop: plain DDP averaging
            buf.div_(self.world_size)
            fut = dist.all_reduce(buf, async_op=True).get_future()  # type: ignore[union-attr]
            return fut.then(lambda f: f.value()[0])
        buf.mul_(self._micro.weight)
        self._add_sq(0, buf)
        fut = dist.all_reduce(buf, async_op=True).get_future()  # type: ignore[union-attr]

        def reduced(f: Any) -> torch.Tensor:
            out = f.value()[0]
            self._add_sq(1, out)
            return out

        return fut.then(reduced)

    def _add_sq(self, k: int, grads: torch.Tensor) -> None:
        x = squared_norm(grads)
        self._sq[k] = x if self._sq[k] is None else self._sq[k] + x

    def _measure_noise(self) -> None:
        """Feed this step's squared norms to the noise scale: this rank's share of the mean
        gradient (weighted by its ``local_n`` of the global batch's samples) rescaled to the
        mean over its own samples, and the all-reduced mean."""
        local, reduced = self._sq
        self._sq = [None, None]
        if self._local_n and local is not None and reduced is not None:
            share = self.global_batch_size / self._local_n
            self.noise.update(local * share**2, self._local_n, reduced, self.global_batch_size)

    def _measure_noise_alone(self) -> None:
        """One replica: steps pair up, the first's mean gradient kept until the second's, so
        each step's gradient serves one estimate and the copy lives for one step only."""
        flat = torch.cat([g.detach().reshape(-1) for g in self._grads()])
        if self._previous is None or self._previous.numel() != flat.numel():
            self._previous = flat
            return
        self.noise.update_pair(self._previous, flat, self.global_batch_size)
        self._previous = None

    def _grads(self) -> list[torch.Tensor]:
        return [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]

    def _optimizer_step(self, real_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        mb = self._micro
        if mb is None:  # outside the loop (e.g. DCP initialising optimizer state)
            return real_step(*args, **kwargs)
        # FSDP over several ranks: its reduce-scatter weighted every micro-batch already.
        weighted = bool(self._fsdp) and self.world_size > 1
        if not mb.last:
            if not weighted and self._next_weight is not None and self._next_weight != mb.weight:
                torch._foreach_mul_(self._grads(), mb.weight / self._next_weight)
            self._accumulating = True
            return None
        if self._ddp is None and not weighted:
            grads = self._grads()
            torch._foreach_mul_(grads, mb.weight)
            if self.world_size > 1:
                flat = torch.cat([g.reshape(-1) for g in grads])
                self._add_sq(0, flat)
                dist.all_reduce(flat)
                self._add_sq(1, flat)
                parts = flat.split([g.numel() for g in grads])
                torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(parts, grads,
                                                                             strict=True)])
        # The noise scale needs each rank's own whole gradient, which FSDP never holds.
        if not self._fsdp:
            if self.world_size > 1:
                self._measure_noise()
            else:
                self._measure_noise_alone()
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        if self._factor != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * self._factor
        try:
            return real_step(*args, **kwargs)
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                g["lr"] = lr
            self._accumulating = False

    # ---- the loop ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.samples_done // self.n

    def _step_samples(self, samples_done: int) -> int:
        """The samples of the step that starts at ``samples_done``: the global batch, but the
        last step takes only what is left, so the job ends exactly at its work however batch
        changes left it aligned. A remainder smaller than the world is folded into the step
        before; after a resize to more ranks than samples left, the last step still takes only
        those (ranks without one add nothing: ``step_plan``'s ``pad``)."""
        left = self.total_samples - samples_done
        return left if left < self.global_batch_size + self.world_size else self.global_batch_size

    def _plan(self, samples_done: int) -> list[MicroBatch]:
        return step_plan(
            self.seed,
            self.n,
            samples_done,
            self._step_samples(samples_done),
            self.world_size,
            self.rank,
            self.max_micro_batch,
            pad=True,
            even=bool(self._fsdp),
        )

    def _plans(self, samples_done: int) -> Iterator[list[MicroBatch]]:
        while samples_done < self.total_samples:
            yield self._plan(samples_done)
            samples_done += self._step_samples(samples_done)

    def batches(self) -> Iterator[Any]:
        """This rank's micro-batches, from the current position to the end of the job."""
        if isinstance(self.dataset, TensorDataset) and self.num_workers == 0:
            for plan in self._plans(self.samples_done):
                for mb in plan:
                    idx = torch.from_numpy(mb.indices)
                    yield [t[idx] for t in self.dataset.tensors]
            return
        sampler = (mb.indices.tolist() for plan in self._plans(self.samples_done) for mb in plan)
        yield from DataLoader(
            self.dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )

    def __iter__(self) -> Iterator[Any]:
        self._in_place = not self._fsdp  # the trainer's own loop re-forms a DDP group in place
        batches = self.batches()
        try:
            while True:
                if self.boundary():  # resized in place: this rank's share of each step changed
                    batches = self.batches()
                if self.samples_done >= self.total_samples:
                    break
                plan = self._plan(self.samples_done)
                self._local_n = sum(len(mb.indices) for mb in plan if mb.weight)
                for k, mb in enumerate(plan):
                    self._micro = mb
                    self._next_weight = None if mb.last else plan[k + 1].weight
                    if self._ddp is not None:
                        self._ddp.require_backward_grad_sync = mb.last
                    yield next(batches)
                self._micro = None
                self.step_done()
            self._micro = None
            self.finish()
        finally:
            self._micro = None
            if self._ddp is not None:
                self._ddp.require_backward_grad_sync = True
            self._restore_signals()

    def step_done(self) -> None:
        """Count the step just taken and report progress."""
        self.samples_done += self._step_samples(self.samples_done)
        self.step += 1
        self._write_progress()

    def finish(self) -> None:
        """The job's work is done: a final, synchronous checkpoint and progress report."""
        self.finished = True
        self._agreed()  # an agreement still under way is of no use now, but must complete
        self._checkpoint(sync=True)
        self._write_progress(force=True)

    def boundary(self) -> bool:
        """Between steps: agree with every rank on checkpoint/stop/resize, then act on it.
        True when the group was resized in place.

        In a group, the ranks agree on what each saw at the previous boundary: that all-reduce
        runs during the step in between, so no step waits for it (a blocking one per step held
        every rank in lockstep once more). Every rank acts on the same answer at the same step,
        one step after the boundary that saw a stop, checkpoint request or resize order."""
        if self._joined:
            self._joined = False
            return False
        if self._control is None:
            stop, requested, generation = self._seen()
        else:
            stop, requested, generation = self._agreed()
        if stop:
            log.warning(
                "rank %d: stop requested at step %d: checkpointing and exiting",
                self.rank,
                self.step,
            )
            self._checkpoint(sync=True)
            self._write_progress(force=True)
            self._exit_stopped()
        if generation > self.generation:
            self._resize(generation)
            return True
        periodic = bool(self.every_steps) and self.step % self.every_steps == 0  # type: ignore[operator]
        if requested or periodic:
            self._checkpoint(sync=not self.async_checkpoint)
        if self._control is not None:  # what this boundary saw, agreed on at the next
            flags = torch.tensor(self._seen(), dtype=torch.int32)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control,
                                   async_op=True)
            self._agreeing = (work, flags)
        return False

    def _seen(self) -> tuple[bool, bool, int]:
        """This rank's stop, checkpoint request (a request is taken: cleared) and the agent's
        resize order, now."""
        timer = bool(self.every_seconds) and \
            time.monotonic() - self._last_ckpt_time >= self.every_seconds  # type: ignore[operator]
        requested = self._ckpt_request.is_set() or (timer and self.rank == 0)
        self._ckpt_request.clear()
        return self._stop.is_set(), requested, self._ordered_generation()

    def _agreed(self) -> tuple[bool, bool, int]:
        """What the group agreed on at the previous boundary (the max over ranks); nothing yet
        at the first boundary and after a resize."""
        pending, self._agreeing = self._agreeing, None
        if pending is None:
            return False, False, 0
        work, flags = pending
        work.wait()
        return bool(flags[0]), bool(flags[1]), int(flags[2])

    # ---- in-place resize ----------------------------------------------------------------------
    def _order(self) -> dict[str, Any] | None:
        """The agent's resize order (FLEET_RESIZE_FILE), if there is one."""
        path = self.assignment.resize_file
        if path is None:
            return None
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None

    def _ordered_generation(self) -> int:
        """The generation of the agent's latest resize order, else 0. A stat per step: no
        signal, whose default action would kill a script past its loop."""
        if self.assignment.resize_file is None:
            return 0
        try:
            mtime = os.stat(self.assignment.resize_file).st_mtime_ns
        except OSError:
            return 0
        if mtime != self._order_seen[0]:
            order = self._order()
            self._order_seen = (mtime, int(order["generation"]) if order else 0)
        return self._order_seen[1]

    def _resize(self, generation: int) -> None:
        """Re-form the group at the order's size without leaving the process: ranks at or above
        it exit (75), the others keep model, optimizer and trainer state, and ranks the agent
        started meanwhile (``FLEET_RESIZE_JOIN``) get them from rank 0."""
        box = [self._order() if self.rank == 0 else None]
        if self._control is not None:
            dist.broadcast_object_list(box, src=0, group=self._control)
        order = box[0]
        if order is None or int(order["generation"]) != generation:
            raise RuntimeError(f"resize {generation}: the agent's order is gone or changed")
        world, host, port = int(order["world_size"]), order["master_addr"], order["master_port"]
        old_world, began = self.world_size, time.monotonic()
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a checkpoint being written uses the old group
        backend = dist.get_backend() if dist.is_initialized() else None
        if dist.is_initialized():
            if self._control is not None:
                dist.barrier(group=self._control)  # leave together: gloo aborts a rank left alone
            dist.destroy_process_group()
        if self.rank >= world:
            log.info("rank %d: leaving the group (resize %d -> %d) at step %d",
                     self.rank, old_world, world, self.step)
            self._exit_stopped()
        # What the script reads of its world after this point is the new one.
        os.environ.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                           "MASTER_ADDR": host, "MASTER_PORT": str(port)})
        address = f"[{host}]" if ":" in host else host
        dist.init_process_group(
            backend or ("nccl" if torch.cuda.is_available() else "gloo"),
            init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=world)
        if self._ddp is not None:
            self._rewrap()
        ckpt_group = self._new_groups()
        if self.checkpointer is not None:
            self.checkpointer.group = ckpt_group
        self._share_state(joining=False)
        self.generation = generation
        self.assignment = dataclasses.replace(self.assignment, world_size=world,
                                              local_world_size=world)
        step_plan(self.seed, self.n, 0, self.global_batch_size, self.world_size, self.rank, None)
        self._previous, self._sq = None, [None, None]
        if self.rank == 0:
            log.info("resized in place %d -> %d ranks at step %d in %.2f s",
                     old_world, world, self.step, time.monotonic() - began)
        self._write_progress(force=True)

    def _rewrap(self) -> None:
        """Build the script's DDP wrapper anew over the new group, in the same object (the
        script holds it), with its options; like the constructor on a joining rank, this checks
        the parameters' shapes and broadcasts rank 0's parameters and buffers."""
        ddp = self._ddp
        assert ddp is not None
        ddp.reducer._remove_autograd_hooks()  # the old reducer's hooks would reduce on a dead group
        options: dict[str, Any] = {
            "device_ids": ddp.device_ids, "output_device": ddp.output_device, "dim": ddp.dim,
            "find_unused_parameters": ddp.find_unused_parameters,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "static_graph": ddp.static_graph,
        }
        if not ddp.bucket_bytes_cap_default:
            options["bucket_cap_mb"] = ddp.bucket_bytes_cap / 1024**2
        DistributedDataParallel.__init__(ddp, ddp.module, **options)
        ddp.register_comm_hook(None, self._weighted_allreduce)

    def _share_state(self, *, joining: bool = True) -> None:
        """Every rank of a re-formed group takes rank 0's training state; only a joining rank
        loads it (the others have it). Collective: every rank calls it at the same point."""
        if self.world_size == 1:
            return
        if self._ddp is None:  # DDP's constructor broadcasts a wrapped model's parameters
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        box = [self._state() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if not joining:
            return
        state = box[0]
        assert state is not None
        self.optimizer.load_state_dict(state["optim"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.samples_done = state["step"], state["samples_done"]
        self.global_batch_size, self.finished = state["global_batch_size"], state["finished"]
        self.noise = state["noise"]
        log.info("rank %d: joined the group (resize %d) at step %d",
                 self.rank, self.generation, self.step)

    def _state(self) -> dict[str, Any]:
        """What a joining rank needs beyond the model: optimizer, scheduler, progress."""
        return {"optim": self.optimizer.state_dict(), "scheduler": self._scheduler_state(),
                "step": self.step, "samples_done": self.samples_done,
                "global_batch_size": self.global_batch_size, "finished": self.finished,
                "noise": self.noise}

    def _scheduler_state(self) -> dict[str, Any] | None:
        if self.scheduler is None:
            return None
        state = self.scheduler.state_dict()
        if state.get("step") is self.scheduler.step:  # our wrapper lives in the instance dict
            del state["step"]
        return state

    def _checkpoint(self, *, sync: bool) -> None:
        if self.checkpointer is None:
            return
        self._last_ckpt_time = time.monotonic()
        if self.step == self._saved_step:  # nothing new since the last checkpoint
            if sync:
                self.checkpointer.wait()
            return
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        shared = {
            "scheduler": self._scheduler_state(),
            "step": self.step,
            "samples_done": self.samples_done,
            "global_batch_size": self.global_batch_size,
            "finished": self.finished,
        }
        manifest = {
            "job_id": self.assignment.job_id,
            "attempt": self.assignment.attempt,
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "batch_mode": self.batch_mode,
            "samples_done": self.samples_done,
            "finished": self.finished,
            "time": time.time(),
        }
        self.checkpointer.save(
            self.step,
            {"model": model_sd, "optim": optim_sd},
            shared,
            manifest,
            asynchronous=not sync,
        )
        if sync:
            self.checkpointer.wait()
        self._saved_step = self.step

    def _write_progress(self, force: bool = False) -> None:
        path = self.assignment.progress_file
        if self.rank != 0 or path is None:
            return
        now = time.monotonic()
        if not force and now - self._progress_written < self.assignment.progress_interval:
            return
        committed = self.checkpointer.committed if self.checkpointer else None
        then, samples = self._progress_at
        if now > then and self.samples_done > samples:
            self._rate = (self.samples_done - samples) / (now - then)
        self._progress_at = (now, self.samples_done)
        self._progress_written = now
        record = {
            "step": self.step,
            "samples_done": self.samples_done,
            "samples_per_sec": self._rate,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "checkpoint_step": committed[0] if committed else None,
            "checkpoint_bytes": committed[1] if committed else None,
            "checkpoint_seconds": committed[2] if committed else None,
            "grad_noise_scale": self.noise.value,
            "finished": self.finished,
            # without checkpoints a move restarts the job from the beginning
            "resumable": self.checkpointer is not None,
            # the in-place resizes done; None: this loop cannot resize in place (a framework
            # drives it, or the model is sharded), and the agent restarts its workers instead
            "resize_generation": self.generation if self._in_place else None,
            # the framework driving this loop refuses a batch that does not split evenly
            "even_batch": self.even_batch,
        }
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)

    # ---- explicit control -------------------------------------------------------------------
    def request_checkpoint(self) -> None:
        """Checkpoint at the next step boundary (what SIGUSR1 does)."""
        self._ckpt_request.set()

    def _exit_stopped(self) -> None:
        """Exit 75 through the script (its ``finally`` blocks and exit handlers run), without
        finalizing the interpreter when this process has been in a group (a group of one has
        gloo's threads too; a rank leaving a resize has destroyed its group, whose threads
        live on): see :func:`_leave_without_finalizing`."""
        self._restore_signals()
        if self.world_size > 1 or dist.is_initialized():
            atexit.register(_leave_without_finalizing, EXIT_STOPPED)
        raise SystemExit(EXIT_STOPPED)

    def _restore_signals(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}

    def close(self) -> None:
        """Wait for a checkpoint still being written; give SIGTERM/SIGUSR1 back to the script."""
        self._restore_signals()
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leave_without_finalizing(code: int) -> None:
    """Registered by a stop, so the first exit handler to run: run the others, flush, and
    leave. Gloo's worker threads drop a finished collective's tensors a moment after it
    completes; one that does so while the interpreter finalizes takes the GIL of a dying
    interpreter and aborts the process (SIGABRT), which would turn a committed stop into a
    failed attempt. Nothing is left to release: the checkpoint and progress are on disk."""
    atexit.unregister(_leave_without_finalizing)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def elastic(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset, **kwargs: Any
) -> Trainer:
    """Make a training loop elastic: ``for x, y in fleet.elastic(model, opt, data, ...)``.

    Keyword arguments are those of :class:`Trainer`; each one left out is read from the
    broker's FLEET_* variables (see :mod:`broker.runtime`).
    """
    return Trainer(model, optimizer, dataset, **kwargs)


def from_args(args: Any) -> dict[str, Any]:
    """The :class:`Trainer` options found (and set) among a script's parsed flags.

    ``fleet.elastic(model, optimizer, data, **fleet.from_args(args))`` passes ``--batch-size``,
    ``--steps``, ``--seed``, ``--batch-mode``, ``--checkpoint-dir`` and the like through; flags
    left unset fall back to the broker's environment.
    """
    names = (
        "batch_size",
        "steps",
        "epochs",
        "seed",
        "global_batch_size",
        "batch_mode",
        "lr_scaling",
        "max_micro_batch",
        "checkpoint_dir",
        "checkpoint_every_steps",
        "checkpoint_every_seconds",
        "keep_checkpoints",
        "num_workers",
    )
    given = vars(args)
    return {name: given[name] for name in names if given.get(name) is not None}
