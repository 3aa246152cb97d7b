"""Checkpoint stores: a local directory, S3 (boto3) and any fsspec filesystem, with atomic commits.

Layout under the checkpoint URI: one folder ``step-<10 digits>/`` per checkpoint holding the
torch.distributed.checkpoint files, the per-rank RNG files and, written last, ``MANIFEST.json``.
A folder without a manifest is a checkpoint whose writer died: it is never loaded and is removed
by the next successful commit. Remote stores write to a local staging folder first and upload;
restores download into a local cache (one download per node).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from broker.protocol import Env

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{10})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def is_step_dir_name(name: str) -> bool:
    """Is ``name`` a folder of this layout (``step-`` and 10 digits)?"""
    return _STEP_DIR.match(name) is not None


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest file's content, the same in every store (its length counts in the size)."""
    return json.dumps(manifest, indent=1).encode()


class CheckpointStore(ABC):
    """Where checkpoints live. Every method is safe to call from a background thread."""

    uri: str

    @abstractmethod
    def write_dir(self, step: int) -> Path:
        """The local folder the checkpoint of ``step`` is written into."""

    def publish(self, step: int, files: list[Path]) -> None:  # noqa: B027 - local: nothing to do
        """Make ``files`` (written under ``write_dir(step)``) durable in the store."""

    @abstractmethod
    def commit(self, step: int, manifest: dict[str, Any]) -> int:
        """Write the manifest, last and atomically: from now on the checkpoint exists.
        Returns the manifest's size in bytes."""

    @abstractmethod
    def step_bytes(self, step: int) -> int:
        """Bytes of every file published for ``step`` so far (the manifest not included)."""

    @abstractmethod
    def steps(self) -> tuple[list[int], list[int]]:
        """(complete, incomplete) checkpoint steps, each sorted ascending."""

    @abstractmethod
    def manifest(self, step: int) -> dict[str, Any]: ...

    @abstractmethod
    def fetch(self, step: int) -> Path:
        """Make the files of ``step`` readable locally (download if remote); return their folder."""

    @abstractmethod
    def local_dir(self, step: int) -> Path:
        """Where ``fetch`` put (or will put) the files of ``step`` on this node."""

    @abstractmethod
    def delete(self, step: int) -> None: ...

    @abstractmethod
    def folder_files(self) -> dict[str, dict[str, int]]:
        """Every file right inside each folder right under the URI, whoever wrote it: folder
        name -> {file name: size in bytes} (the agent reads a plain script's own DCP
        checkpoints from it)."""

    def latest(self) -> int | None:
        complete, _ = self.steps()
        return complete[-1] if complete else None

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop older ones and dead writes below."""
        complete, incomplete = self.steps()
        if not complete:
            return
        newest = complete[-1]
        for step in complete[:-keep] + [s for s in incomplete if s < newest]:
            self.delete(step)


class LocalStore(CheckpointStore):
    """A directory on a local or shared (NFS) file system; files are written in place."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.uri = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # a job's weights: its own

    def write_dir(self, step: int) -> Path:
        path = self.root / step_dir_name(step)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def commit(self, step: int, manifest: dict[str, Any]) -> int:
        folder = self.root / step_dir_name(step)
        tmp = folder / f".{MANIFEST}.tmp"
        data = manifest_bytes(manifest)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself must survive a crash
        finally:
            os.close(fd)
        return len(data)

    def step_bytes(self, step: int) -> int:
        folder = self.root / step_dir_name(step)
        return sum(f.stat().st_size for f in folder.iterdir()
                   if f.is_file() and f.name not in (MANIFEST, f".{MANIFEST}.tmp"))

    def steps(self) -> tuple[list[int], list[int]]:
        complete, incomplete = [], []
        for entry in self.root.iterdir() if self.root.exists() else []:
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                done = (entry / MANIFEST).exists()
                (complete if done else incomplete).append(int(match.group(1)))
        return sorted(complete), sorted(incomplete)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads((self.root / step_dir_name(step) / MANIFEST).read_text())

    def fetch(self, step: int) -> Path:
        return self.local_dir(step)

    def local_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def delete(self, step: int) -> None:
        shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def folder_files(self) -> dict[str, dict[str, int]]:
        found: dict[str, dict[str, int]] = {}
        for entry in self.root.iterdir() if self.root.exists() else []:
            if entry.is_dir():
                # a file removed between the listing and its stat is simply not there
                with contextlib.suppress(FileNotFoundError):
                    found[entry.name] = {f.name: f.stat().st_size for f in entry.iterdir()
                                         if f.is_file()}
        return found


class StagedStore(CheckpointStore):
    """An object store: write locally, upload each file, upload the manifest last."""

    def __init__(self, uri: str, cache_dir: str | os.PathLike | None = None) -> None:
        self.uri = uri.rstrip("/")
        default = (
            Path(tempfile.gettempdir()) / "fleet-ckpt" / hashlib.sha1(uri.encode()).hexdigest()[:12]
        )
        self.cache = Path(cache_dir or os.environ.get(Env.CHECKPOINT_CACHE) or default)

    @abstractmethod
    def _put(self, local: Path, key: str) -> None: ...

    @abstractmethod
    def _put_bytes(self, data: bytes, key: str) -> None: ...

    @abstractmethod
    def _get(self, key: str, local: Path) -> None: ...

    @abstractmethod
    def _get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def _listing(self) -> dict[str, int]:
        """Every key under the store's prefix, relative to it, with its size in bytes."""

    def _keys(self) -> list[str]:
        return list(self._listing())

    @abstractmethod
    def _delete_keys(self, keys: list[str]) -> None: ...

    def write_dir(self, step: int) -> Path:
        path = self.cache / "out" / step_dir_name(step)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, step: int, files: list[Path]) -> None:
        for f in files:
            self._put(f, f"{step_dir_name(step)}/{f.name}")

    def commit(self, step: int, manifest: dict[str, Any]) -> int:
        data = manifest_bytes(manifest)
        self._put_bytes(data, f"{step_dir_name(step)}/{MANIFEST}")
        shutil.rmtree(self.cache / "out" / step_dir_name(step), ignore_errors=True)
        return len(data)

    def _by_step(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        for key in self._keys():
            head, _, _ = key.partition("/")
            match = _STEP_DIR.match(head)
            if match:
                found.setdefault(int(match.group(1)), []).append(key)
        return found

    def step_bytes(self, step: int) -> int:
        prefix = step_dir_name(step) + "/"
        return sum(size for key, size in self._listing().items()
                   if key.startswith(prefix) and key != prefix + MANIFEST)

    def steps(self) -> tuple[list[int], list[int]]:
        complete, incomplete = [], []
        for step, keys in self._by_step().items():
            done = f"{step_dir_name(step)}/{MANIFEST}" in keys
            (complete if done else incomplete).append(step)
        return sorted(complete), sorted(incomplete)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads(self._get_bytes(f"{step_dir_name(step)}/{MANIFEST}"))

    def local_dir(self, step: int) -> Path:
        return self.cache / "in" / step_dir_name(step)

    def fetch(self, step: int) -> Path:
        target = self.local_dir(step)
        if (target / MANIFEST).exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        prefix = step_dir_name(step) + "/"
        for key in self._by_step().get(step, []):
            self._get(key, partial / key[len(prefix) :])
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        return target

    def delete(self, step: int) -> None:
        self._delete_keys(self._by_step().get(step, []))
        shutil.rmtree(self.local_dir(step), ignore_errors=True)

    def folder_files(self) -> dict[str, dict[str, int]]:
        found: dict[str, dict[str, int]] = {}
        for key, size in self._listing().items():
            folder, _, name = key.partition("/")
            if name and "/" not in name:
                found.setdefault(folder, {})[name] = size
        return found


class S3Store(StagedStore):
    """``s3://bucket/prefix`` via boto3 (multipart, threaded); honours AWS_ENDPOINT_URL."""

    def __init__(
        self, uri: str, cache_dir: str | os.PathLike | None = None, client: Any = None
    ) -> None:
        super().__init__(uri, cache_dir)
        parsed = urlparse(self.uri)
        if not parsed.netloc:
            raise ValueError(f"checkpoint URI {uri!r} names no bucket; use s3://BUCKET/PREFIX")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            import boto3

            client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
        self.client = client

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _put(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), self.bucket, self._key(key))

    def _put_bytes(self, data: bytes, key: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _get(self, key: str, local: Path) -> None:
        self.client.download_file(self.bucket, self._key(key), str(local))

    def _get_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def _listing(self) -> dict[str, int]:
        base = f"{self.prefix}/" if self.prefix else ""
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        ):
            sizes.update({obj["Key"][len(base) :]: obj["Size"] for obj in page.get("Contents", [])})
        return sizes

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk})


class FsspecStore(StagedStore):
    """Any other URI (gs://, az://, memory://, ...) through fsspec, if its package is installed."""

    def __init__(self, uri: str, cache_dir: str | os.PathLike | None = None) -> None:
        super().__init__(uri, cache_dir)
        import fsspec

        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.uri)
        except (ImportError, ValueError) as exc:
            raise ValueError(
                f"checkpoint URI {uri!r}: no usable fsspec filesystem ({exc}); "
                "install its package (gcsfs for gs://, adlfs for az://) or use a local path or s3://"
            ) from None

    def _put(self, local: Path, key: str) -> None:
        self.fs.put_file(str(local), f"{self.path}/{key}")

    def _put_bytes(self, data: bytes, key: str) -> None:
        self.fs.pipe_file(f"{self.path}/{key}", data)

    def _get(self, key: str, local: Path) -> None:
        self.fs.get_file(f"{self.path}/{key}", str(local))

    def _get_bytes(self, key: str) -> bytes:
        return self.fs.cat_file(f"{self.path}/{key}")

    def _listing(self) -> dict[str, int]:
        if not self.fs.exists(self.path):
            return {}
        base = self.fs._strip_protocol(self.path).rstrip("/") + "/"
        found = self.fs.find(self.path, detail=True)
        return {p[len(base) :]: int(info.get("size") or 0) for p, info in found.items()
                if p.startswith(base)}

    def _delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            self.fs.rm_file(f"{self.path}/{key}")


def open_store(uri: str | os.PathLike) -> CheckpointStore:
    """The store for a checkpoint URI: a path or file://, s3://, or any fsspec protocol."""
    text = str(uri)
    scheme = urlparse(text).scheme
    if scheme in ("", "file"):
        return LocalStore(urlparse(text).path if scheme else text)
    if scheme == "s3":
        return S3Store(text)
    return FsspecStore(text)
