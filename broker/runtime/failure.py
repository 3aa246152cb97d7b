"""Why a worker failed, in a few words the broker can show: the runtime names the cause of a
failure it understands (``checkpoint write failed: no space left on device``) in the file the
agent gives it (FLEET_ERROR_FILE), and the agent sends that with its final report; without it
the broker can only say "command exited 1"."""

from __future__ import annotations

import contextlib
import errno
import os

from broker.protocol import Env

ERROR_ENV = Env.ERROR_FILE
MAX_ERROR_CHARS = 200


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause or context, or one a checkpoint library
    wrapped (torch DCP's ``CheckpointException`` keeps each rank's exception in ``failures``)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [cur.__cause__, cur.__context__]
    return None


def probe(folder: str | os.PathLike[str]) -> OSError | None:
    """What is wrong with writing into ``folder`` as the file system says: full (ENOSPC),
    mounted read-only (EROFS) or not writable (EACCES). Torch's C++ writer reports a failed
    write as a RuntimeError with no errno; the folder still tells the cause."""
    try:
        st = os.statvfs(folder)
    except OSError as err:
        return err
    for failed, code in ((st.f_flag & os.ST_RDONLY, errno.EROFS), (st.f_bavail == 0, errno.ENOSPC),
                         (not os.access(folder, os.W_OK), errno.EACCES)):
        if failed:
            return OSError(code, os.strerror(code))
    return None


def describe(what: str, exc: BaseException, folder: str | os.PathLike[str] | None = None) -> str:
    """``"<what>: <cause>"``: the OS's words for an OSError behind ``exc`` (lower-case, no
    path: a path may name a user's directory), else what ``folder`` (the one being written)
    shows is wrong with it, else the exception's type."""
    err = os_error(exc) or (probe(folder) if folder is not None else None)
    if err is not None and err.errno is not None:
        cause = (err.strerror or os.strerror(err.errno)).lower()
        name = errno.errorcode.get(err.errno)
        return f"{what}: {cause}" + (f" ({name})" if name else "")
    return f"{what}: {type(exc).__name__}"


def report(text: str, env: dict[str, str] | None = None) -> None:
    """Leave ``text`` for the agent (the first cause a worker names wins; best effort)."""
    path = (os.environ if env is None else env).get(ERROR_ENV)
    if not path:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, " ".join(text.split())[:MAX_ERROR_CHARS].encode())
        finally:
            os.close(fd)


def read(path: str | os.PathLike[str]) -> str | None:
    """What a worker left in the error file, if anything."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = " ".join(f.read(4 * MAX_ERROR_CHARS).split())[:MAX_ERROR_CHARS]
    except OSError:
        return None
    return text or None
