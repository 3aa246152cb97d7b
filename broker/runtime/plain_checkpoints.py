"""The checkpoints a plain script commits itself: how the agent tells that a job which does not
run the runtime still resumes where it stopped.

Such a script saves and loads with ``torch.distributed.checkpoint`` (DCP) under the job's
``FLEET_CHECKPOINT_URI`` (``examples/train_dcp.py``). DCP writes a checkpoint's ``.metadata``
after every rank's shards, so a folder right under the URI is a committed checkpoint once it
holds that file; its step is the number its name ends in (``step-40``, ``checkpoint_40``,
``40``). Folders in the runtime's own layout (``step-`` and 10 digits, committed by its
``MANIFEST.json``) are left out: a job on the runtime reports its checkpoints through its
progress file. The script takes no checkpoint when it is stopped, so a restart loses the work
since its newest commit; the agent reports how long ago that was, as it saw it (its own clock:
the broker's may differ). Standard library only; a remote store's SDK (boto3, fsspec) is
imported on the first look at it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

from broker.runtime.checkpoint_stores import CheckpointStore, is_step_dir_name, open_store

DCP_METADATA = ".metadata"  # what DCP writes last: the checkpoint is complete
_STEP = re.compile(r"(\d+)$")
# A remote store is listed at most this often: each look is a LIST request, billed and slower
# than a heartbeat should wait for; a local folder is looked at on every heartbeat.
REMOTE_POLL_S = 30.0


@dataclass(frozen=True)
class Committed:
    """A committed DCP checkpoint: its step, the bytes of its folder's files, and when the
    agent first saw it committed (``time.monotonic``)."""

    step: int
    bytes: int
    seen_at: float

    def age_seconds(self, now: float | None = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self.seen_at)


def newest_committed(folders: dict[str, dict[str, int]]) -> tuple[int, int] | None:
    """(step, bytes) of the newest committed DCP checkpoint among ``folders`` (a store's
    ``folder_files``), or None when none is."""
    done = [(int(m.group(1)), sum(files.values())) for name, files in folders.items()
            if DCP_METADATA in files and not is_step_dir_name(name)
            and (m := _STEP.search(name)) is not None]
    return max(done) if done else None


class PlainCheckpoints:
    """Watches one checkpoint URI for the newest checkpoint a script committed itself."""

    def __init__(self, uri: str, log: Callable[[str], None],
                 opener: Callable[[str], CheckpointStore] = open_store) -> None:
        self.uri = uri
        self._log = log
        self._opener = opener
        self._store: CheckpointStore | None = None
        self._interval = 0.0 if urlparse(uri).scheme in ("", "file") else REMOTE_POLL_S
        self._looked_at: float | None = None
        self._newest: Committed | None = None
        self._told: str | None = None  # the last failure logged: each is logged once

    def newest(self) -> Committed | None:
        """The newest committed checkpoint seen so far, looking again when it is time to."""
        now = time.monotonic()
        if self._looked_at is not None and now - self._looked_at < self._interval:
            return self._newest
        self._looked_at = now
        try:
            if self._store is None:
                self._store = self._opener(self.uri)
            found = newest_committed(self._store.folder_files())
        except Exception as exc:  # any store's own errors (botocore's, fsspec's): keep going
            why = f"cannot read the script's checkpoints in {self.uri}: {type(exc).__name__}: {exc}"
            if why != self._told:
                self._told = why
                self._log(why)
            return self._newest
        if found is not None and (self._newest is None or found[0] != self._newest.step):
            self._newest = Committed(step=found[0], bytes=found[1], seen_at=now)
        return self._newest
