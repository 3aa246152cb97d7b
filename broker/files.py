"""A job's files on the control plane's side: a local ``workdir`` or file mount packed at launch
(tar.gz, its .gitignore honoured inside a git work tree) and the broker's blob store that keeps
the packs, owner-only, under its state dir until the job's nodes fetch them
(``broker.runtime.files`` unpacks them on the node)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from broker.errors import InvalidInput, PayloadTooLarge
from broker.runtime.files import FILE_MEMBER  # a pack of one file holds it under this name
from policies.models import BLOB_PREFIX

MAX_BLOB_BYTES = 100 * 1024 * 1024  # a pack, compressed; data belongs in a bucket
MAX_PACKED_BYTES = 1024 * 1024 * 1024  # what a pack may hold, uncompressed
DEFAULT_BLOB_QUOTA_BYTES = 2 * 1024**3  # what one team's packs may take of the state dir
ADMIN_FOLDER = "_admin"  # the admin's uploads; team names start with a letter or digit
GZIP_MAGIC = b"\x1f\x8b"
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


class BlobStore:
    """Packs by content digest, one folder (0700) per uploader under ``root``: a team's name, or
    ``_admin`` for the admin's uploads (no team may take that name), each file 0600. A team may
    keep at most ``quota_bytes`` there, so no team can fill the state dir (which also holds the
    Redis AOF) for the others; ``collect`` deletes the packs no active job needs."""

    def __init__(self, root: Path, quota_bytes: int = DEFAULT_BLOB_QUOTA_BYTES) -> None:
        self.root = root
        self.quota_bytes = quota_bytes
        # one upload at a time commits: two concurrent ones cannot both fit under the quota
        # that only one fits under, and a sweep cannot delete a pack being uploaded again
        self.lock = threading.Lock()

    def folder(self, owner: str | None) -> Path:
        return self.root / (owner or ADMIN_FOLDER)

    def used(self, owner: str | None, suffix: str = ".tar.gz") -> int:
        """The bytes of ``owner``'s kept packs (``.part``: of its uploads under way)."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.folder(owner))
                       if e.name.endswith(suffix) and e.is_file())
        except FileNotFoundError:
            return 0

    def upload(self, owner: str | None) -> Upload:
        """A new upload into ``owner``'s folder."""
        return Upload(self, owner)

    def path(self, digest: str, team: str) -> Path | None:
        """The pack with this hex digest that a job of ``team`` may use: its team's upload, the
        admin's, or one kept before packs had folders."""
        if not _HEX.match(digest):
            return None
        for folder in (self.folder(team), self.folder(None), self.root):
            path = folder / f"{digest}.tar.gz"
            if path.is_file():
                return path
        return None

    def collect(self, keep: set[str], older_than_s: float) -> int:
        """Delete each pack (and each upload a crash left half written) last written more than
        ``older_than_s`` ago whose digest is not in ``keep`` (what the active jobs reference);
        returns how many. The age spares a pack uploaded but not yet submitted with its job."""
        cutoff = time.time() - older_than_s
        removed = 0
        with self.lock:
            folders = [self.root, *(p for p in self.root.glob("*") if p.is_dir())]
            for folder in folders:
                for path in [*folder.glob("*.tar.gz"), *folder.glob("*.part")]:
                    digest = path.name.split(".", 1)[0]
                    with contextlib.suppress(FileNotFoundError):
                        if path.stat().st_mtime < cutoff and (
                                path.suffix == ".part" or digest not in keep):
                            path.unlink()
                            removed += 1
        return removed


class Upload:
    """One pack being received: written to a ``.part`` file as it comes (never held whole in
    memory) and hashed on the way, then ``commit``-ed under its digest, or ``abort``-ed."""

    def __init__(self, store: BlobStore, owner: str | None) -> None:
        self.store, self.owner = store, owner
        self.size = 0
        self.head = b""
        self._hash = hashlib.sha256()
        # uploads under way count at once: concurrent ones cannot together pass the quota
        self._parts = store.used(owner, ".part")
        folder = store.folder(owner)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")  # 0600
        self._tmp = Path(tmp)
        self._file: Any = os.fdopen(fd, "wb")

    def _refuse(self, kept: int) -> None:
        """Refuse (413) an upload that would take ``owner`` past the quota with ``kept``."""
        if kept + self.size > self.store.quota_bytes:
            who = f"team {self.owner}" if self.owner else "the admin"
            raise PayloadTooLarge(
                f"{who} keeps {kept:,} bytes of packed files; {self.size:,} more would pass "
                f"the {self.store.quota_bytes:,}-byte quota (api.blob_quota_bytes): wait until "
                "the packs of finished jobs are deleted (broker.blob_retention_s after their "
                "upload), put data in a bucket (file_mounts: s3://...), or have the operator "
                "raise api.blob_quota_bytes")

    def write(self, chunk: bytes) -> None:
        if len(self.head) < 2:
            self.head += chunk[:2 - len(self.head)]
            if len(self.head) == 2 and self.head != GZIP_MAGIC:
                raise InvalidInput("the body is not gzip data; send what `fleet launch` packs")
        self.size += len(chunk)
        # only the commit knows whether the pack is kept already (then it costs nothing):
        # until then only the uploads under way are bounded by the quota
        self._refuse(self._parts)
        self._hash.update(chunk)
        self._file.write(chunk)

    def commit(self) -> str:
        """Keep the pack; its reference ``blob:sha256:<hex>`` (the same data: the same file,
        marked new again so that a sweep spares it until its job is submitted)."""
        if self.head != GZIP_MAGIC:
            raise InvalidInput("the body is not gzip data; send what `fleet launch` packs")
        self._file.close()
        digest = self._hash.hexdigest()
        path = self.store.folder(self.owner) / f"{digest}.tar.gz"
        with self.store.lock:
            if path.exists():
                os.utime(path)
                self._tmp.unlink()
            else:
                self._refuse(self.store.used(self.owner))
                os.replace(self._tmp, path)
        return BLOB_PREFIX + digest

    def abort(self) -> None:
        """Drop what was received (nothing once committed)."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
