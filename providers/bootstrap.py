"""What the cloud providers share: launch tags, idempotency tokens, node ranks, the start script."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import uuid
from importlib import metadata

from broker.errors import InvalidInput
from broker.protocol import Env, shell
from policies.models import Market
from providers import registry
from providers.base import LaunchRequest

BROKER_TAG = "fleet-broker"  # value: the broker's id, so several brokers can share an account
JOB_TAG = "fleet-job"
KEY_TAG = "fleet-idempotency-key"
MARKET_TAG = "fleet-market"
ACCELERATOR_TAG = "fleet-accelerator"
GPUS_TAG = "fleet-gpus"
FIRST_RANK_TAG = "fleet-first-rank"  # the launch's first node rank (``LaunchRequest.first_rank``)
RANK_TAG = "fleet-node-rank"  # one node's rank, where each VM of a launch is made on its own
RANK_ENV = Env.NODE_RANK

# UUIDv5 namespace for request ids derived from idempotency keys (fixed forever: changing it
# would make retried launches after an upgrade look new).
REQUEST_NAMESPACE = uuid.UUID("6f1c2b8e-3f4a-5d6e-8a9b-0c1d2e3f4a5b")


# What a start script pip-installs when the image lacks the agent (see ``agent_install_spec``):
# fleetbroker's base install, the agent and runtime without the control plane's packages.
AGENT_INSTALL_ENV = Env.AGENT_INSTALL
# The start script's power-off once the agent exited; empty keeps the VM up.
SHUTDOWN_ENV = Env.SHUTDOWN_COMMAND
DEFAULT_SHUTDOWN = "shutdown -h now"
APT_LOCK_TIMEOUT_S = 300  # cloud images run unattended-upgrades at boot


def request_uuid(key: str) -> str:
    """A stable UUIDv5 for an idempotency key (GCE ``requestId``)."""
    return str(uuid.uuid5(REQUEST_NAMESPACE, key))


def token(key: str, length: int = 64) -> str:
    """A stable hex token for an idempotency key (EC2 ``ClientToken`` allows 64 ASCII chars)."""
    return hashlib.sha256(key.encode()).hexdigest()[:length]


def label_value(value: str) -> str:
    """A GCP label value (<= 63 of ``a-z 0-9 _ -``): lower-cased; other values become a hash."""
    lower = value.lower()
    ok = len(lower) <= 63 and re.fullmatch(r"[a-z0-9_-]*", lower)
    return lower if ok else f"h-{token(value, 40)}"


def tags(request: LaunchRequest, broker_id: str, rank: int | None = None) -> dict[str, str]:
    """A launch's tags; ``rank``: the node's own, for a VM made on its own (``node_rank``)."""
    return {
        BROKER_TAG: broker_id,
        JOB_TAG: request.job_id,
        KEY_TAG: request.idempotency_key,
        MARKET_TAG: request.market.value,
        ACCELERATOR_TAG: request.accelerator.value,
        GPUS_TAG: str(request.gpus_per_node),
        FIRST_RANK_TAG: str(request.first_rank),
        **({RANK_TAG: str(rank)} if rank is not None else {}),
    }


def node_rank(request: LaunchRequest, index: int) -> int:
    """The rank of the launch's node ``index`` (0-based), for providers that make each node
    with its own start script (one VM per node)."""
    if not 0 <= index < request.nodes:
        raise ValueError(f"node index {index}: a launch of {request.nodes} nodes has 0.."
                         f"{request.nodes - 1}")
    return request.first_rank + index


def tagged_rank(tags: dict[str, str], index: int | None = None) -> int | None:
    """A node's rank from its tags: its own ``RANK_TAG``, else the launch's first rank plus the
    node's ``index`` in the launch; None where the tags (or the index) do not tell."""
    if RANK_TAG in tags:
        return int(tags[RANK_TAG])
    if FIRST_RANK_TAG in tags and index is not None:
        return int(tags[FIRST_RANK_TAG]) + index
    return None


def agent_env(request: LaunchRequest, cloud: str, rank: int | None = None) -> dict[str, str]:
    """The FLEET_* environment of the agent: the request's own env plus where it runs, on spot
    the cloud's metadata URL for preemption notices, and the node's rank: ``rank`` where the
    provider starts each node with its own script, the first rank for a one-node launch (a lost
    node's replacement), else none (each node adds its index in the launch to FLEET_FIRST_RANK:
    ``rank_step``, SkyPilot's task)."""
    bad = [k for k in request.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        raise InvalidInput(f"env: {bad} are not valid variable names (use letters, digits, "
                           "'_')")
    # Where the agent on a spot VM polls for the preemption notice (its cloud's metadata); none
    # where the cloud is not known yet (SkyPilot choosing it).
    home = registry.clouds().get(cloud)
    notice = home.notice if home and request.market is Market.SPOT else None
    if rank is None and request.nodes == 1:
        rank = request.first_rank
    # The provider owns the rank: one from the request's env would give every node the same.
    job = {k: v for k, v in request.env.items() if k != RANK_ENV}
    return {
        **(dict([notice]) if notice else {}),  # the request's env may point elsewhere
        **job,
        Env.JOB_ID: request.job_id,
        Env.IDEMPOTENCY_KEY: request.idempotency_key,
        Env.CLOUD: cloud,
        Env.REGION: request.region,
        Env.MARKET: request.market.value,
        Env.ACCELERATOR: request.accelerator.value,
        Env.GPUS_PER_NODE: str(request.gpus_per_node),
        Env.NODES: str(request.nodes),
        Env.FIRST_RANK: str(request.first_rank),
        **({RANK_ENV: str(rank)} if rank is not None else {}),
    }


def agent_install_spec(option: str | None = None) -> str:
    """The pip requirement a start script installs when the image has no agent: the cloud's
    ``agent_install`` option, else ``$FLEET_AGENT_INSTALL``, else this broker's own release
    (``fleetbroker==<version>``), so the agent matches the broker that starts it.

    One argument to ``pip install``: a requirement (``fleetbroker==0.1.0``) or a wheel URL/path.
    """
    spec = option or os.environ.get(AGENT_INSTALL_ENV)
    if spec is None:
        try:
            return f"fleetbroker=={metadata.version('fleetbroker')}"
        except metadata.PackageNotFoundError:  # run from a source tree: the newest release
            return "fleetbroker"
    if not spec.strip() or re.search(r"\s", spec) or spec.startswith("-"):
        raise InvalidInput(
            f"agent_install {redact(spec)!r}: give one pip requirement or wheel URL with no "
            "spaces or pip flags, e.g. 'fleetbroker==0.1.0' or 'https://host/fleetbroker.whl'"
        )
    return spec


def redact(spec: str) -> str:
    """``spec`` fit for a log: a URL's user:password and query string (tokens, signatures) go."""
    spec = re.sub(r"//[^/@]*@", "//****@", spec)
    return re.sub(r"\?.*$", "?****", spec)


def install_step(spec: str) -> str:
    """Shell lines that pip-install the agent unless ``python3`` can already import it (a
    prepared image, or a rerun of the script): a stock GPU image has no fleetbroker."""
    apt = f"DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"
    return (
        "if ! python3 -c 'import broker.runtime.agent' 2>/dev/null; then\n"
        f"  echo {shlex.quote(f'fleet: installing the agent: {redact(spec)}')} >&2\n"
        # Ubuntu's python3 comes without pip; the cloud images run user data as root. At boot
        # unattended-upgrades holds the dpkg lock for minutes: wait for it, do not fail.
        "  if ! python3 -m pip --version >/dev/null 2>&1 && command -v apt-get >/dev/null; then\n"
        f"    {apt} update -q && {apt} install -y -q python3-pip\n"
        "  fi\n"
        # The VM exists for this job: installing into the image's python (PEP 668) is intended.
        "  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet "
        f"--disable-pip-version-check {shlex.quote(spec)}\n"
        "fi\n"
    )


def agent_invocation(request: LaunchRequest) -> str:
    """The shell words that run the agent around ``request.command``."""
    command = " ".join(shlex.quote(part) for part in request.command)
    return f"python3 -m broker.runtime.agent -- {command}"


# The attempt token leaves the environment before the agent starts: it goes to a 0600 file the
# agent reads and deletes before any of the job's code runs (``broker.runtime.agent``), so
# neither the agent's environment (/proc/PID/environ, readable by the job) nor the job's holds
# it. ``printf`` is a bash builtin: the token is on no command line. The shell keeps it as an
# unexported variable for the exit trap's report.
TOKEN_TO_FILE = shell(r"""if [ -n "${@AGENT_TOKEN:-}" ]; then
  @AGENT_TOKEN_FILE=$(umask 077 && mktemp "${TMPDIR:-/tmp}/fleet-agent-token.XXXXXX")
  printf '%s' "$@AGENT_TOKEN" > "$@AGENT_TOKEN_FILE"
  export @AGENT_TOKEN_FILE
  export -n @AGENT_TOKEN
fi
""")


def agent_command(request: LaunchRequest) -> str:
    """The lines that replace the shell with the agent running ``request.command`` (the
    token moved to a file first: ``TOKEN_TO_FILE``)."""
    return f"{TOKEN_TO_FILE}exec {agent_invocation(request)}\n"


def env_function(request: LaunchRequest, cloud: str, rank: int | None = None) -> str:
    """``fleet_job_env``: a shell function exporting the agent's environment, so the script can
    apply it after the install (a job's PYTHONPATH or PIP_* must not reach pip) and in the exit
    trap's report."""
    exports = "".join(
        f"  export {k}={shlex.quote(v)}\n"
        for k, v in sorted(agent_env(request, cloud, rank).items())
    )
    return f"fleet_job_env() {{\n{exports}}}\n"




def rank_step(request: LaunchRequest, cloud: str, rank: int | None) -> str:
    """Shell lines, run after ``fleet_job_env``, that set FLEET_NODE_RANK where the script does
    not carry it: a node of a multi-node launch that shares one script (``Cloud.rank_step``:
    AWS)."""
    if rank is not None or request.nodes == 1:
        return ""
    home = registry.clouds().get(cloud)
    if home is None or (step := home.rank_step()) is None:
        raise ValueError(f"{cloud}: a start script for a {request.nodes}-node launch needs each "
                         "node's rank (pass rank=bootstrap.node_rank(request, index))")
    return step


# The exit trap. A failure the agent may not have reported itself (the install failed, the agent
# crashed or was killed) goes to the broker as the agent's last heartbeat: ``state: failed`` and
# the exit code, in the node's rendezvous round (a stand-in's start failure belongs to the round
# it was launched for, which the broker reads). The token reaches curl on stdin, never on a
# command line or in the output. Then the VM powers off: a VM whose job ended must not bill until
# the reconciler notices.
EXIT_TRAP = shell(r"""fleet_report_failure() {
  [ -n "${@BROKER_URL:-}" ] || return 0
  command -v curl >/dev/null || { echo "fleet: no curl to report the failure" >&2; return 1; }
  local body
  body=$(printf '{"job_id": "%s", "attempt": %d, "round": %d, "node_rank": %d, ' \
    "$@JOB_ID" "${@ATTEMPT:-0}" "${@ROUND:-0}" "${@NODE_RANK:-0}")
  # the node's key: the broker takes a report only from the node that holds its rank now
  [ -z "${@LAUNCH_KEY:-}" ] || body+=$(printf '"launch_key": "%s", ' "$@LAUNCH_KEY")
  body+=$(printf '"state": "failed", "exit_code": %d}' "$1")
  printf 'Authorization: Bearer %s\n' "${@AGENT_TOKEN:-}" | curl -fsS -m 10 --retry 3 \
    -o /dev/null -H @- -H 'Content-Type: application/json' --data-binary "$body" \
    "${@BROKER_URL%/}@HEARTBEAT_PATH"
}
fleet_exit() {
  local code=$?
  trap - EXIT
  trap '' TERM INT  # a signal now must not cut the report or the power-off short
  if [ "$code" != 0 ] && [ "$code" != @EXIT_STOPPED ]; then
    echo "fleet: the agent exited with $code; reporting the failure to the broker" >&2
    ( fleet_job_env; fleet_report_failure "$code" ) || echo "fleet: could not report it" >&2
  fi
  # the agent deletes the token file when it starts; one that never started leaves it
  [ -z "${@AGENT_TOKEN_FILE:-}" ] || rm -f "$@AGENT_TOKEN_FILE"
  if [ -n "$fleet_shutdown" ]; then
    echo "fleet: powering off: $fleet_shutdown" >&2
    sh -c "$fleet_shutdown" || echo "fleet: the power-off command failed" >&2
  fi
  exit "$code"
}
trap fleet_exit EXIT
""")


def run_agent(request: LaunchRequest) -> str:
    """Shell lines that run the agent in the background so that a TERM or INT to the script (a
    service stop, the final kill of a shutdown) reaches it: the agent checkpoints and exits, and
    the script exits with the agent's own code, which the exit trap then judges. (Run in the
    foreground, bash ran the trap at once with the last command's status, 0: a power-off under
    a running agent, and no report.) TERM for both: a background job of a non-interactive shell
    starts with INT ignored, and the agent stops the same way for either."""
    return (
        f"{TOKEN_TO_FILE}"
        "fleet_stop() {\n"
        "  local code=0\n"
        '  kill -TERM "$fleet_agent" 2>/dev/null || true\n'
        '  wait "$fleet_agent" || code=$?\n'
        '  exit "$code"\n'
        "}\n"
        f"{agent_invocation(request)} &\n"
        "fleet_agent=$!\n"
        "trap fleet_stop TERM INT\n"
        'wait "$fleet_agent"\n'
    )


def shutdown_line(request: LaunchRequest, command: str | None = None) -> str:
    """``fleet_shutdown``: ``$FLEET_SHUTDOWN_COMMAND`` on the machine, else the provider's
    ``shutdown_command`` option (``command``), else the launch's, else ``shutdown -h now``
    (empty: stay up, e.g. to debug)."""
    default = command if command is not None else request.env.get(SHUTDOWN_ENV, DEFAULT_SHUTDOWN)
    return (f"fleet_shutdown={shlex.quote(default)}\n"
            f"fleet_shutdown=${{{SHUTDOWN_ENV}-$fleet_shutdown}}\n")


def container_step(request: LaunchRequest) -> str:
    """For a job with a container image: make sure the node's Docker answers (the clouds' GPU
    images ship it with the NVIDIA container toolkit, its daemon may still be starting), else
    fail the attempt naming the cause (the exit trap reports it): the job never runs on the
    host instead. Nothing for other jobs."""
    if not request.env.get(Env.CONTAINER_IMAGE):
        return ""
    return (
        "if ! docker info >/dev/null 2>&1; then\n"
        "  systemctl start docker >/dev/null 2>&1 || true\n"
        "  for _ in $(seq 30); do docker info >/dev/null 2>&1 && break; sleep 2; done\n"
        "fi\n"
        "if ! docker info >/dev/null 2>&1; then\n"
        "  echo 'fleet: the job runs in a container image and this node has no usable Docker "
        "(docker info fails): boot an image with Docker and the NVIDIA container toolkit' >&2\n"
        "  exit 1\n"
        "fi\n"
    )


def agent_script(request: LaunchRequest, cloud: str, agent_install: str,
                 shutdown_command: str | None = None, rank: int | None = None) -> str:
    """A shell start script (user data / startup-script / custom data): install the agent from
    ``agent_install`` where the image lacks it, with the image's own environment; then export
    the job's, with the node's rank (``rank``: this VM's, where each node has its own script;
    see ``agent_env`` and ``rank_step``), and run the agent (``run_agent``); on exit report a
    failure and power the VM off (``EXIT_TRAP``). A job with a container image first needs a
    working Docker (``container_step``)."""
    return (
        "#!/bin/bash\nset -euo pipefail\n"
        f"{shutdown_line(request, shutdown_command)}"
        f"{env_function(request, cloud, rank)}"
        f"{EXIT_TRAP}"
        f"{install_step(agent_install)}"
        f"{container_step(request)}"
        "fleet_job_env\n"
        f"{rank_step(request, cloud, rank)}"
        f"{run_agent(request)}"
    )
