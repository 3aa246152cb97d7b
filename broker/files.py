"""A job's files on the control plane's side: a local ``workdir`` or file mount packed at launch
(tar.gz, its .gitignore honoured inside a git work tree) and the broker's blob store that keeps
the packs, owner-only, under its state dir until the job's nodes fetch them
(``broker.runtime.files`` unpacks them on the node)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

from broker.errors import InvalidInput
from broker.runtime.files import FILE_MEMBER  # a pack of one file holds it under this name
from policies.models import BLOB_PREFIX

MAX_BLOB_BYTES = 100 * 1024 * 1024  # a pack, compressed; data belongs in a bucket
MAX_PACKED_BYTES = 1024 * 1024 * 1024  # what a pack may hold, uncompressed
_HEX = re.compile(r"^[0-9a-f]{64}$")


class PackError(InvalidInput):
    """A path that cannot be packed: missing, or over the size caps."""


def _listed(root: Path) -> list[Path]:
    """The files under ``root``: what git would track (tracked and untracked, .gitignore
    applied) inside a git work tree, else every file."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "."], capture_output=True, check=True,
                             timeout=60).stdout
        return sorted(root / p for p in out.decode().split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.SubprocessError):  # no git, or not a work tree
        return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def pack(path: str | Path) -> bytes:
    """``path`` (a directory, or one file) as tar.gz bytes."""
    src = Path(path).expanduser()
    if not src.exists():
        raise PackError(f"{src} does not exist; check the path (relative paths start where you "
                        "run fleet launch)")
    files = [(src, FILE_MEMBER)] if src.is_file() else \
        [(f, f.relative_to(src).as_posix()) for f in _listed(src)]
    total = sum(f.stat().st_size for f, _ in files)
    if total > MAX_PACKED_BYTES:
        raise PackError(f"{src} holds {total:,} bytes, over the {MAX_PACKED_BYTES:,}-byte cap; "
                        "put data in a bucket and mount it (file_mounts: s3://...)")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f, name in files:
            tar.add(f, arcname=name, recursive=False)
    data = buf.getvalue()
    if len(data) > MAX_BLOB_BYTES:
        raise PackError(f"{src} packs to {len(data):,} bytes, over the {MAX_BLOB_BYTES:,}-byte "
                        "cap; put data in a bucket and mount it (file_mounts: s3://...)")
    return data


def blob_ref(data: bytes) -> str:
    return BLOB_PREFIX + hashlib.sha256(data).hexdigest()


class BlobStore:
    """Packs by content digest in ``root`` (0700), each file 0600."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, data: bytes) -> str:
        """Keep ``data``; its reference ``blob:sha256:<hex>`` (the same data: the same file)."""
        ref = blob_ref(data)
        path = self.root / f"{ref.removeprefix(BLOB_PREFIX)}.tar.gz"
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".part")  # 0600
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return ref

    def path(self, digest: str) -> Path | None:
        """The pack with this hex digest, if kept."""
        if not _HEX.match(digest):
            return None
        path = self.root / f"{digest}.tar.gz"
        return path if path.is_file() else None
