"""A job's files on the node, before its setup runs (every launch, so after every migration too):
the packed ``workdir`` and local file mounts fetched from the broker and unpacked, bucket and
https sources copied (COPY), buckets mounted with the clouds' FUSE tools (MOUNT, MOUNT_CACHED).

What to place comes from FLEET_FILES (JSON: ``{"workdir": ref | null, "mounts": [{path, source,
mode}]}``, refs ``blob:sha256:<hex>``). Standard library only, plus each cloud's SDK when a
source needs it (boto3 for s3://, google-cloud-storage for gs://, azure-storage-blob for az://);
a missing SDK or FUSE tool is a ``FilesError`` that names it: the launch fails with that reason,
it never falls back to something else silently.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.errors import FleetError
from broker.protocol import Env

FILES_ENV = Env.FILES
ROOT_ENV = Env.FILES_ROOT
BLOB_PREFIX = "blob:sha256:"  # policies.models.BLOB_PREFIX (the agent imports no pydantic)
FILE_MEMBER = ".fleet-single-file"  # broker.files: a pack of one file
WORKDIR = "sky_workdir"  # as SkyPilot: the workdir lands in ~/sky_workdir
# The FUSE tool each bucket scheme mounts with, and how it is installed.
FUSE = {"s3": ("goofys", "https://github.com/kahing/goofys"),
        "gs": ("gcsfuse", "https://cloud.google.com/storage/docs/gcsfuse-install"),
        "az": ("blobfuse2", "https://github.com/Azure/azure-storage-fuse")}
SDK = {"s3": ("boto3", "boto3"), "gs": ("google.cloud.storage", "google-cloud-storage"),
       "az": ("azure.storage.blob", "azure-storage-blob")}
# policies.models.STORE_SCHEMES: a named bucket's store and its URL scheme.
STORE_SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}


class FilesError(FleetError):
    """A file the job needs could not be placed; the message names what and the fix."""


def node_path(path: str, root: Path) -> Path:
    """A node path as SkyPilot reads it: ``~`` under the home (``root``), a relative path under
    the workdir (``~/sky_workdir``, where SkyPilot's backend puts a relative destination)."""
    if path == "~" or path.startswith("~/"):
        return root / path[2:]
    p = Path(path)
    return p if p.is_absolute() else root / WORKDIR / p


def unpack(data: bytes, dest: Path) -> None:
    """A pack (``broker.files.pack``) at ``dest``: a directory's files under it, or one file
    as it."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        if names == [FILE_MEMBER]:
            dest.parent.mkdir(parents=True, exist_ok=True)
            member = tar.extractfile(FILE_MEMBER)
            assert member is not None
            dest.write_bytes(member.read())
            return
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, filter="data")  # no absolute paths, no .., no devices


def _bucket(source: str) -> tuple[str, str, str]:
    """(scheme, bucket, key prefix) of ``s3://bucket/prefix``; for az, the container is the
    first path part after the account (``az://account/container/prefix``)."""
    parts = urllib.parse.urlsplit(source)
    return parts.scheme, parts.netloc, parts.path.lstrip("/")


def _sdk(scheme: str) -> Any:
    module, package = SDK[scheme]
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise FilesError(f"{scheme}:// sources need the {package} package on the node: add "
                         f"`pip install {package}` to the node image (or setup)") from None


def copy_s3(source: str, dest: Path) -> None:
    """An object, or every object under a prefix, to ``dest`` (boto3's usual credentials and
    endpoint settings: AWS_* variables, AWS_ENDPOINT_URL)."""
    boto3 = _sdk("s3")
    _, bucket, key = _bucket(source)
    s3 = boto3.client("s3")
    prefix = key.rstrip("/")
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    if prefix and prefix in keys:  # one object
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, prefix, str(dest))
        return
    under = [k for k in keys if not prefix or k.startswith(prefix + "/")]
    if not under and prefix:
        raise FilesError(f"{source}: no such object or prefix")
    for k in under:
        rel = k[len(prefix):].lstrip("/") if prefix else k
        if not rel or rel.endswith("/"):
            continue
        target = dest / rel
        if not target.resolve().is_relative_to(dest.resolve()):
            raise FilesError(f"{source}: object {k!r} would land outside {dest}")
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, k, str(target))


def copy_gs(source: str, dest: Path) -> None:
    storage = _sdk("gs")
    _, bucket, prefix = _bucket(source)
    client = storage.Client()
    blobs = [b for b in client.list_blobs(bucket, prefix=prefix.rstrip("/"))
             if not b.name.endswith("/")]
    if len(blobs) == 1 and blobs[0].name == prefix:
        dest.parent.mkdir(parents=True, exist_ok=True)
        blobs[0].download_to_filename(str(dest))
        return
    for b in blobs:
        target = dest / b.name[len(prefix):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        b.download_to_filename(str(target))


def copy_az(source: str, dest: Path) -> None:
    blob = _sdk("az")
    _, account, path = _bucket(source)
    container, _, prefix = path.partition("/")
    service = blob.BlobServiceClient(f"https://{account}.blob.core.windows.net",
                                     credential=os.environ.get("AZURE_STORAGE_KEY"))
    client = service.get_container_client(container)
    names = [b.name for b in client.list_blobs(name_starts_with=prefix)]
    if names == [prefix]:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(client.download_blob(prefix).readall())
        return
    for name in names:
        target = dest / name[len(prefix):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.download_blob(name).readall())


def copy_https(source: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(source, timeout=60) as r, open(dest, "wb") as f:
        shutil.copyfileobj(r, f)


COPY = {"s3": copy_s3, "gs": copy_gs, "az": copy_az, "https": copy_https}


def mount_bucket(source: str, dest: Path, cached: bool) -> None:
    """A bucket mounted at ``dest`` with its cloud's FUSE tool; ``FilesError`` naming the tool
    where the node lacks it."""
    scheme, bucket, prefix = _bucket(source)
    tool, where = FUSE[scheme]
    if shutil.which(tool) is None:
        mode = "MOUNT_CACHED" if cached else "MOUNT"
        raise FilesError(f"file_mounts {dest}: mode {mode} needs {tool} on the node and it is "
                         f"not installed (see {where}); install it in the node image, or use "
                         "mode: COPY")
    dest.mkdir(parents=True, exist_ok=True)
    if scheme == "s3":
        cmd = [tool, f"{bucket}:{prefix}" if prefix else bucket, str(dest)]
    elif scheme == "gs":
        cmd = [tool, "--implicit-dirs", *(["--only-dir", prefix] if prefix else []), bucket,
               str(dest)]
    else:
        container = prefix.partition("/")[0]
        cmd = [tool, "mount", str(dest), f"--container-name={container}",
               *(["--block-cache"] if cached else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise FilesError(f"{tool} could not mount {source} at {dest}: "
                         f"{done.stderr.strip()[-300:]}")


def create_s3(bucket: str) -> None:
    """The bucket, made in the client's region if absent; one this account owns already is
    reused (SkyPilot's storage reuses its bucket, so a task can be launched again)."""
    boto3 = _sdk("s3")
    s3 = boto3.client("s3")
    region = s3.meta.region_name
    extra = {} if region in (None, "us-east-1") else {
        "CreateBucketConfiguration": {"LocationConstraint": region}}
    try:
        s3.create_bucket(Bucket=bucket, **extra)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    except s3.exceptions.BucketAlreadyExists:
        raise FilesError(f"s3://{bucket} belongs to another account (bucket names are global): "
                         "choose another name") from None


def create_gs(bucket: str) -> None:
    client = _sdk("gs").Client()
    if client.lookup_bucket(bucket) is None:
        client.create_bucket(bucket)


def create_az(url: str) -> None:
    blob = _sdk("az")
    _, account, container = _bucket(url)
    service = blob.BlobServiceClient(f"https://{account}.blob.core.windows.net",
                                     credential=os.environ.get("AZURE_STORAGE_KEY"))
    client = service.get_container_client(container)
    if not client.exists():
        client.create_container()


def upload(url: str, local: Path) -> None:
    """Every file under ``local`` (or the one file) into the root of the bucket at ``url``,
    keyed by its path relative to ``local``."""
    scheme, bucket, container = _bucket(url)
    files = [(f, f.relative_to(local).as_posix()) for f in sorted(local.rglob("*"))
             if f.is_file()] if local.is_dir() else [(local, local.name)]
    if scheme == "s3":
        s3 = _sdk("s3").client("s3")
        for f, key in files:
            s3.upload_file(str(f), bucket, key)
    elif scheme == "gs":
        target = _sdk("gs").Client().bucket(bucket)
        for f, key in files:
            target.blob(key).upload_from_filename(str(f))
    else:  # az://account/container
        client = _sdk("az").BlobServiceClient(
            f"https://{bucket}.blob.core.windows.net",
            credential=os.environ.get("AZURE_STORAGE_KEY")).get_container_client(container)
        for f, key in files:
            with open(f, "rb") as data:
                client.upload_blob(key, data, overwrite=True)


def bucket_url(mount: dict[str, Any]) -> str:
    """The URL of a named bucket on its store (the broker fills in the placed cloud's)."""
    name, store = mount["name"], mount.get("store")
    if store is None:
        raise FilesError(f"file_mounts {mount['path']}: bucket {name} names no store and the "
                         "job's cloud has no object store of its own: set store: s3, gcs or "
                         "azure in the mount")
    scheme = STORE_SCHEMES[store]
    if scheme != "az":
        return f"{scheme}://{name}"
    account = os.environ.get("AZURE_STORAGE_ACCOUNT")
    if not account:  # an Azure container lives in a storage account the node must name
        raise FilesError(f"file_mounts {mount['path']}: an azure bucket needs its storage "
                         "account: set AZURE_STORAGE_ACCOUNT (and AZURE_STORAGE_KEY) in the "
                         "task's envs or secrets")
    return f"az://{account}/{name}"


def place_named(mount: dict[str, Any], dest: Path, fetch_blob: Callable[[str], bytes]) -> None:
    """A named bucket at ``dest``: created if absent, the local source (packed at launch)
    uploaded into it, then mounted or copied down as its mode says. Every node of a gang does
    this: creating is idempotent and each node uploads the same bytes, so no node waits on
    another before its setup."""
    url = bucket_url(mount)
    scheme = _bucket(url)[0]
    {"s3": lambda: create_s3(mount["name"]), "gs": lambda: create_gs(mount["name"]),
     "az": lambda: create_az(url)}[scheme]()
    source = mount.get("source")
    if source:
        with tempfile.TemporaryDirectory(prefix="fleet-upload-") as tmp:
            local = Path(tmp) / (dest.name or "src")  # a single file keeps the mount's name
            unpack(fetch_blob(source.removeprefix(BLOB_PREFIX)), local)
            upload(url, local)
    mode = mount.get("mode", "MOUNT")
    if mode != "COPY":
        mount_bucket(url, dest, cached=mode == "MOUNT_CACHED")
    else:
        dest.mkdir(parents=True, exist_ok=True)
        COPY[scheme](url, dest)


def place(files: dict[str, Any], root: Path,
          fetch_blob: Callable[[str], bytes]) -> Path | None:
    """Put the job's files in place under ``root``; the workdir's path (setup and run start
    there), if the job has one."""
    workdir = None
    if files.get("workdir"):
        workdir = root / WORKDIR
        unpack(fetch_blob(files["workdir"].removeprefix(BLOB_PREFIX)), workdir)
    for m in files.get("mounts", []):
        dest, source, mode = node_path(m["path"], root), m.get("source"), m.get("mode", "COPY")
        if m.get("name"):
            place_named(m, dest, fetch_blob)
        elif source.startswith(BLOB_PREFIX):
            unpack(fetch_blob(source.removeprefix(BLOB_PREFIX)), dest)
        elif mode != "COPY":
            mount_bucket(source, dest, cached=mode == "MOUNT_CACHED")
        else:
            COPY[_bucket(source)[0]](source, dest)
    return workdir


def files_of(env: dict[str, str]) -> dict[str, Any] | None:
    text = env.get(FILES_ENV, "").strip()
    return json.loads(text) if text else None


def files_root(env: dict[str, str]) -> Path:
    return Path(env.get(ROOT_ENV) or os.path.expanduser("~"))

