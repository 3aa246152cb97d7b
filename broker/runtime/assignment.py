"""The job's assignment, as the broker (FLEET_*) or torchrun (RANK, WORLD_SIZE, ...) set it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from broker.errors import InvalidInput
from broker.protocol import Env

BATCH_MODES = ("fixed", "elastic")


class AssignmentError(InvalidInput):
    """A FLEET_* / torchrun variable or an argument has a value the runtime cannot use."""


def env_int(env: Mapping[str, str], name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise AssignmentError(
            f"{name}={raw!r} is not an integer; set it to a whole number"
        ) from None
    if value < minimum:
        raise AssignmentError(f"{name}={value} is below {minimum}; set it to at least {minimum}")
    return value


def env_float(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise AssignmentError(
            f"{name}={raw!r} is not a number; set it to seconds, e.g. 30"
        ) from None
    if value < 0:
        raise AssignmentError(f"{name}={value} is negative; set it to 0 or more")
    return value


@dataclass(frozen=True)
class Assignment:
    """Where this process sits in the job and what the broker asked of it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    job_id: str = "local"
    attempt: int = 0
    global_batch_size: int | None = None
    batch_mode: str | None = None
    checkpoint_uri: str | None = None
    progress_file: str | None = None
    progress_interval: float = 1.0
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None
    checkpoint_keep: int = 3
    resize_file: str | None = None  # where the agent writes an in-place resize order
    resize_join: int | None = None  # set: this worker joins a running group (that generation)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Assignment:
        """Read torchrun's variables and the broker's FLEET_* variables (all optional)."""
        env = os.environ if env is None else env
        world = env_int(env, "WORLD_SIZE", 1, minimum=1)
        rank = env_int(env, "RANK", 0)
        if rank >= world:  # type: ignore[operator]
            raise AssignmentError(f"RANK={rank} must be below WORLD_SIZE={world}")
        mode = env.get(Env.BATCH_MODE, "").strip().lower() or None
        if mode is not None and mode not in BATCH_MODES:
            raise AssignmentError(f"{Env.BATCH_MODE}={mode!r}; use one of {', '.join(BATCH_MODES)}")
        return cls(
            rank=rank,  # type: ignore[arg-type]
            world_size=world,  # type: ignore[arg-type]
            local_rank=env_int(env, "LOCAL_RANK", 0),  # type: ignore[arg-type]
            local_world_size=env_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1),  # type: ignore[arg-type]
            job_id=env.get(Env.JOB_ID, "").strip() or "local",
            attempt=env_int(env, Env.ATTEMPT, 0),  # type: ignore[arg-type]
            global_batch_size=env_int(env, Env.GLOBAL_BATCH_SIZE, None, minimum=1),
            batch_mode=mode,
            checkpoint_uri=env.get(Env.CHECKPOINT_URI, "").strip() or None,
            progress_file=env.get(Env.PROGRESS_FILE, "").strip() or None,
            progress_interval=env_float(env, Env.PROGRESS_INTERVAL, 1.0),  # type: ignore[arg-type]
            checkpoint_every_steps=env_int(env, Env.CHECKPOINT_EVERY_STEPS, None, minimum=1),
            checkpoint_every_seconds=env_float(env, Env.CHECKPOINT_EVERY_SECONDS, None),
            checkpoint_keep=env_int(env, Env.CHECKPOINT_KEEP, 3, minimum=1),  # type: ignore[arg-type]
            resize_file=env.get(Env.RESIZE_FILE, "").strip() or None,
            resize_join=env_int(env, Env.RESIZE_JOIN, None, minimum=1),
        )
