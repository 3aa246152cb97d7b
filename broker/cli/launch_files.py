"""``fleet launch`` of a spec with a local ``workdir`` or local ``file_mounts``: each is packed
(``broker.files.pack``) and uploaded to the broker, and the spec names the upload instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.files import pack
from policies.models import BLOB_PREFIX, JobSpec


def upload_files(spec: JobSpec, put: Callable[[bytes], dict[str, Any]]) -> JobSpec:
    """``spec`` with each local path packed and uploaded through ``put``
    (``BrokerClient.put_blob``); ``broker.files.PackError`` for a path that cannot be packed."""
    update: dict[str, Any] = {}
    if spec.workdir and not spec.workdir.startswith(BLOB_PREFIX):
        update["workdir"] = put(pack(spec.workdir))["ref"]
    if any(m.local for m in spec.file_mounts):
        update["file_mounts"] = [
            m.model_copy(update={"source": put(pack(m.source))["ref"]}) if m.local else m
            for m in spec.file_mounts]
    return spec.model_copy(update=update) if update else spec
