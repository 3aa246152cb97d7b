"""Who a local job runs as. A broker running as root starts its local jobs as an unprivileged
user (``FLEET_JOB_USER``, default ``nobody``), so a job cannot read the broker's 0600 state: the
Redis password and AOF, the token file, other nodes' logs. A broker that is not root cannot
switch users: its jobs run as itself (docs/security.md says what that leaves open).

The job user needs exactly one place of the broker's state: its checkpoint directory.
``hand_over`` makes that directory the job user's and lets the job user pass through (search,
never list or read) the directories above it inside the state dir.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from broker.errors import InvalidInput
from broker.protocol import BrokerEnv
from providers.base import ProviderError

log = logging.getLogger(__name__)

JOB_USER_ENV = BrokerEnv.JOB_USER
DEFAULT_JOB_USER = "nobody"


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    home: str


def job_user(env: dict[str, str] | None = None, python: str = sys.executable) -> JobUser | None:
    """The user local jobs run as, or None for "the broker's own user" (the broker is not root,
    or ``FLEET_JOB_USER`` names root itself: an explicit choice, logged). Raises ``InvalidInput``
    naming the fix when the user does not exist or cannot run ``python`` (their agent's)."""
    if os.geteuid() != 0:
        return None
    name = (os.environ if env is None else env).get(JOB_USER_ENV) or DEFAULT_JOB_USER
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise InvalidInput(f"{JOB_USER_ENV}={name!r}: no such user on this machine; create it "
                           f"or set {JOB_USER_ENV} to an existing unprivileged user") from None
    if pw.pw_uid == 0:
        log.warning("%s=%s: local jobs run as root and can read the broker's state",
                    JOB_USER_ENV, name)
        return None
    user = JobUser(name=pw.pw_name, uid=pw.pw_uid, gid=pw.pw_gid, home=pw.pw_dir)
    blocked = unreachable(Path(python).resolve().parent, user)
    if blocked is not None:
        raise InvalidInput(
            f"the job user {name} cannot run this Python ({python}): {blocked} is "
            f"{stat.filemode(blocked.stat().st_mode)}; install Python where {name} can read it "
            f"or set {JOB_USER_ENV} to a user that can ({JOB_USER_ENV}=root runs jobs as the "
            "broker's user, able to read its state: docs/security.md)")
    return user


def unreachable(path: Path, user: JobUser) -> Path | None:
    """The first directory from / down to ``path`` that ``user`` may not enter, or None."""
    for up in [*reversed(path.parents), path]:
        st = up.stat()
        bit = stat.S_IXUSR if st.st_uid == user.uid else \
            stat.S_IXGRP if st.st_gid == user.gid else stat.S_IXOTH
        if not st.st_mode & bit:
            return up
    return None


def hand_over(path: Path, root: Path, user: JobUser) -> None:
    """Make directory ``path`` (inside ``root``, the broker's checkpoint root) the job user's
    (0700), creating it if needed, and let the job user search ``root`` and its parent (the
    state dir): mode 0711, nothing listable. Raises ``ProviderError`` naming the directory the
    job user cannot pass above the state dir."""
    path, root = path.resolve(), root.resolve()
    if root not in path.parents:
        return  # a checkpoint place of the spec's own choosing: the job user's business
    for up in (root, root.parent):
        up.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(up, 0o711)
    blocked = unreachable(root.parent, user)
    if blocked is not None:
        raise ProviderError(
            f"the job user {user.name} cannot enter {blocked} "
            f"({stat.filemode(blocked.stat().st_mode)}), above the broker's state dir; put the "
            f"state dir where {user.name} can pass (not under a 0700 folder) or set "
            f"{JOB_USER_ENV}")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    # lchown: never follow a link a job may have left where its directory should be
    os.lchown(path, user.uid, user.gid)
    os.chmod(path, 0o700)
