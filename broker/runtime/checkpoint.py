"""Sharded, atomic, optionally asynchronous checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes its own DCP shard (replicated tensors are de-duplicated across ranks, so the
write is spread over all of them), its RNG states, and rank 0 the trainer state; after a barrier
rank 0 reads the step's size back from the store and commits the manifest, which records it.
DCP stores tensors by name, so a checkpoint written by N ranks loads into M ranks. An
asynchronous save copies the state into reusable host buffers (the only pause training sees) and
writes, uploads and commits in a background thread on its own process group.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import os
import random
import struct
import threading
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from broker.runtime import failure
from broker.runtime.checkpoint_stores import MANIFEST, CheckpointStore

# DCP warns on every single-process save/load; a one-process job is a normal case here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
log = logging.getLogger("fleet.checkpoint")  # a child of the "fleet" logger the trainer sets up
TRAINER_FILE = "trainer.pt"


class _Slice(io.RawIOBase):
    """A read-only window ``[offset, offset + length)`` of an open file, for zipfile."""

    def __init__(self, f: BinaryIO, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _read_into(f: BinaryIO, offset: int, length: int, target: torch.Tensor) -> bool:
    """Read one torch.save'd tensor straight into ``target``'s memory if the layout allows."""
    with zipfile.ZipFile(_Slice(f, offset, length)) as zf:
        data = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
        if len(data) != 1 or len(zf.infolist()) > 8:
            return False
        entry = data[0]
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != target.nbytes:
            return False
    f.seek(offset + entry.header_offset)
    name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    f.seek(offset + entry.header_offset + 30 + name_len + extra_len)
    buf = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    return f.readinto(buf) == target.nbytes


class FastReader(dcp.FileSystemReader):
    """DCP's file reader, made to read at disk speed.

    DCP reads shard files one after another and deserialises every tensor into a temporary
    before copying it. Here every file has its own thread, and a whole, same-dtype, contiguous
    CPU tensor is read straight from the file into its destination; anything else (resharded
    slices, GPU targets, transformed streams) goes through DCP's own path.
    """

    def __init__(self, path: str | os.PathLike, threads: int = 8) -> None:
        super().__init__(path)
        self.threads = threads

    def _direct(self, f: BinaryIO, req: Any, planner: LoadPlanner) -> bool:
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        target = planner.resolve_tensor(req).detach()
        meta = planner.metadata.state_dict_metadata.get(req.storage_index.fqn)  # type: ignore[attr-defined]
        shape = tuple(target.shape)
        whole = not any(req.storage_offsets) and tuple(req.lengths) == shape
        if not (whole and target.device.type == "cpu" and target.is_contiguous()
                and getattr(meta, "properties", None) is not None
                and meta.properties.dtype == target.dtype and tuple(meta.size) == shape):
            return False
        if not _read_into(f, info.offset, info.length, target):
            return False
        planner.commit_tensor(req, target)
        return True

    def _read_file(self, path: str, reqs: list[Any], planner: LoadPlanner) -> list[Any]:
        with open(Path(self.path) / path, "rb", buffering=0) as f:
            return [req for req in reqs if not self._direct(f, req, planner)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
        with ThreadPoolExecutor(min(self.threads, max(len(per_file), 1))) as pool:
            rest = pool.map(lambda kv: self._read_file(kv[0], kv[1], planner), per_file.items())
            leftover = [req for reqs in rest for req in reqs]
        if leftover:
            super().read_data(dataclasses.replace(plan, items=leftover), planner).wait()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from on this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:devices])


class Checkpointer:
    """Saves and loads one job's checkpoints in ``store``; one save in flight at a time."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        rank: int = 0,
        local_rank: int = 0,
        group: dist.ProcessGroup | None = None,
        keep: int = 3,
        write_threads: int = 4,
    ) -> None:
        self.store = store
        self.rank = rank
        self.local_rank = local_rank
        self.group = group
        self.keep = keep
        self.write_threads = write_threads
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._folder: Path | None = None  # the folder the last save wrote into
        # (step, bytes, seconds) of the newest committed or loaded checkpoint, one tuple so that a
        # reader never pairs a step with another checkpoint's size. bytes: every rank's files plus
        # the manifest, known on rank 0 (None elsewhere, and for a checkpoint without a recorded
        # size); seconds: how long this process took to write and commit it (None once loaded).
        self.committed: tuple[int, int | None, float | None] | None = None
        self.last_pause_s = 0.0  # how long the last save held up the caller

    @property
    def last_committed(self) -> int | None:
        """The step of the newest committed (or loaded) checkpoint."""
        return self.committed[0] if self.committed else None

    @property
    def _local(self) -> bool:
        """One process and no process group: DCP must not look for one."""
        return self.group is None and not dist.is_initialized()

    # ---- save -------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        shared: dict[str, Any],
        manifest: dict[str, Any],
        *,
        asynchronous: bool = True,
    ) -> None:
        """Checkpoint ``state`` (DCP) at ``step``; ``shared`` is rank 0's small trainer state."""
        start = time.perf_counter()
        self.wait()
        rng = rng_state()
        if asynchronous:
            state = self._stage(state)
            shared = copy.deepcopy(shared)
            self._thread = threading.Thread(
                target=self._run,
                args=(step, state, rng, shared, manifest),
                daemon=True,
                name=f"fleet-checkpoint-{step}",
            )
            self._thread.start()
        else:
            self._run(step, state, rng, shared, manifest)
            self._raise()
        self.last_pause_s = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            cause = failure.describe("checkpoint write failed", error, self._folder)
            failure.report(cause)  # the broker shows it, not just "command exited 1"
            raise RuntimeError(cause) from error

    def _stage(self, obj: Any, path: str = "") -> Any:
        """Copy tensors into host buffers kept between checkpoints (pinned when on a GPU)."""
        if isinstance(obj, DTensor):  # FSDP: stage this rank's shard, keep its sharding spec
            return DTensor(self._stage(obj.to_local(), path), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                self._buffers[path] = buf
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            if obj.is_cuda:
                torch.cuda.current_stream(obj.device).synchronize()
            return buf
        if isinstance(obj, dict):
            return {k: self._stage(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._stage(v, f"{path}/{i}") for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _owns(self, name: str) -> bool:
        if name.startswith(f"__{self.rank}_") or name == f"rng-{self.rank}.pt":
            return True
        return self.rank == 0 and name in (".metadata", TRAINER_FILE)

    def _run(
        self,
        step: int,
        state: dict[str, Any],
        rng: dict[str, Any],
        shared: dict[str, Any],
        manifest: dict[str, Any],
    ) -> None:
        try:
            t0 = time.perf_counter()
            folder = self._folder = self.store.write_dir(step)
            writer = dcp.FileSystemWriter(folder, thread_count=self.write_threads)
            dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self._local)
            torch.save(rng, folder / f"rng-{self.rank}.pt")
            if self.rank == 0:
                torch.save(shared, folder / TRAINER_FILE)
            self.store.publish(step, sorted(p for p in folder.iterdir() if self._owns(p.name)))
            if self.group is not None:
                dist.barrier(group=self.group)  # every rank's files are durable
            size, written_s = None, None
            if self.rank == 0:
                # Read back from the store rather than summed over ranks: a tensor collective in
                # this thread (an all-reduce) made some processes abort at exit (gloo teardown).
                size = self.store.step_bytes(step)
                written_s = time.perf_counter() - t0
                size += self.store.commit(step, {
                    **manifest, "step": step, "bytes": size, "written_s": written_s,
                })
                self.store.prune(self.keep)
                log.info("checkpoint of step %d (%d bytes) committed to %s",
                         step, size, self.store.uri)
            self.committed = (step, size, written_s)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self._error = exc

    # ---- load -------------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The newest complete checkpoint, as rank 0 sees it (all ranks get the same answer)."""
        found = [self.store.latest() if self.rank == 0 else None]
        if self.group is not None:
            dist.broadcast_object_list(found, src=0, group=self.group)
        return found[0]

    def load(self, step: int, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load ``step`` into ``state`` in place; return (manifest, rank 0's trainer state).

        Restores this rank's RNG states: those of the same rank when it existed in the writing
        job, else those of ``rank % old_world_size``.
        """
        if self.local_rank == 0:
            self.store.fetch(step)
        if self.group is not None:
            dist.barrier(group=self.group)
        folder = Path(self.store.local_dir(step))
        raw = (folder / MANIFEST).read_bytes()
        manifest = json.loads(raw)
        reader = FastReader(folder)
        dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=self._local)
        shared = torch.load(folder / TRAINER_FILE, weights_only=False)
        source = self.rank % int(manifest.get("world_size", 1))
        set_rng_state(torch.load(folder / f"rng-{source}.pt", weights_only=False))
        data = manifest.get("bytes")  # None: written before sizes were recorded
        self.committed = (step, None if data is None else int(data) + len(raw), None)
        return manifest, shared
