"""A job's container (``JobSpec.container_image``, SkyPilot's ``image_id: docker:<image>``): the
node's one per-node process runs inside the image, as SkyPilot runs such a task, through the
``docker`` CLI.

Standard library only, like the agent. Every command is an argv list (never a shell line), and
the environment passes by name only (``-e NAME``: docker takes the value from its own process
environment), so a secret's value never appears in any process's arguments. Which names pass:
the broker's ``FLEET_*`` ones, SkyPilot's ``SKYPILOT_*``, the node variables the agent sets, and
the job's own envs and secrets (FLEET_CONTAINER_ENV); the host's PATH, HOME, PYTHONPATH, ...
would break the image's own, so they stay outside.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from broker.protocol import ENV_PREFIX, Env

DOCKER = "docker"
SKYPILOT_PREFIX = "SKYPILOT_"
# Node variables the agent sets besides FLEET_* and SKYPILOT_* (torch's rendezvous, the GPUs).
NODE_NAMES = frozenset({"MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "PYTHONUNBUFFERED",
                        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"})
PROBE_TIMEOUT_S = 20.0


def unusable(docker: str = DOCKER) -> str | None:
    """Why this machine cannot run a container now (None: it can): no ``docker`` CLI on PATH,
    or ``docker info`` fails (no daemon, or no permission to use it)."""
    exe = shutil.which(docker)
    if exe is None:
        return f"no {docker!r} on PATH: install Docker (and the NVIDIA container toolkit on GPUs)"
    try:
        done = subprocess.run([exe, "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{docker} info` failed: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"`{docker} info` failed (no Docker daemon, or no permission to use it): " + (
            said[-1][:300] if said else f"exit {done.returncode}")
    return None


def node_has_gpus() -> bool:
    """Does this node have NVIDIA GPUs to pass through (a local fleet's virtual GPUs are not)?"""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def passed_names(env: Mapping[str, str]) -> list[str]:
    """The names of ``env`` that pass into the container, sorted."""
    own = {n.strip() for n in env.get(Env.CONTAINER_ENV, "").split(",") if n.strip()}
    return sorted(n for n in env if n.startswith((ENV_PREFIX, SKYPILOT_PREFIX))
                  or n in NODE_NAMES or n in own)


def container_name(job_id: str, attempt: int, rank: int, nonce: str) -> str:
    """A name unique on the node (``nonce``: a fresh one per start), in docker's alphabet."""
    job = re.sub(r"[^a-zA-Z0-9_.-]", "-", job_id)[:64]
    return f"fleet-{job}-a{attempt}-n{rank}-{nonce}"


def run_argv(image: str, name: str, command: Sequence[str], env: Mapping[str, str], *,
             volumes: Iterable[Path], cwd: Path | None, gpus: bool,
             docker: str = DOCKER) -> list[str]:
    """``docker run`` of ``command`` in ``image``, as SkyPilot runs a task's container: the
    node's GPUs (``gpus``), its network and IPC (NCCL and torch's shared memory need both),
    ``volumes`` at the same paths inside (the workdir, the mounts, the agent's progress files),
    started in ``cwd``. ``--init`` with TINI_KILL_PROCESS_GROUP: a stop's signal reaches the
    command's whole process group, as the agent's killpg does on the host. The environment by
    name only: the values come from the docker client's own environment."""
    argv = [docker, "run", "--rm", "--name", name, "--init", "--network", "host",
            "--ipc", "host", "--sig-proxy=false", "-e", "TINI_KILL_PROCESS_GROUP=1"]
    if gpus:
        argv += ["--gpus", "all"]
    for n in passed_names(env):
        argv += ["-e", n]
    for v in dict.fromkeys(str(Path(p).resolve()) for p in volumes):
        argv += ["-v", f"{v}:{v}"]
    if cwd is not None:
        argv += ["-w", str(Path(cwd).resolve())]
    return [*argv, image, *command]  # an image (checked) never starts with "-"


def stop_argv(name: str, grace_s: float, docker: str = DOCKER) -> list[str]:
    """SIGTERM to the container's processes, SIGKILL after ``grace_s`` (the agent's grace)."""
    return [docker, "stop", "-t", str(max(0, int(grace_s))), name]


def signal_argv(name: str, signal_name: str, docker: str = DOCKER) -> list[str]:
    return [docker, "kill", "--signal", signal_name, name]
