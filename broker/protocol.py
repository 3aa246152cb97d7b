"""The broker-agent protocol, in one place: the ``FLEET_*`` environment names, the agent's exit
codes, the actions the broker answers with, the agent endpoints and the bodies they take and
return (heartbeat, final report, rendezvous).

Both sides import this module: the control plane (API, actuator, reconciler, providers' start
scripts) and the node agent. It imports the standard library, pydantic and the shared types of
``policies.models`` (themselves pydantic only), so an agent runs without the control plane's
dependencies. The prose contract (defaults, what each variable means) is in
:mod:`broker.runtime`.
"""

from __future__ import annotations

import ipaddress
import math
import re
import string
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.models import Accelerator

ENV_PREFIX = "FLEET_"


class Env:
    """Environment names the broker and providers set for a job's agent and workers."""

    # the assignment
    JOB_ID = "FLEET_JOB_ID"
    ATTEMPT = "FLEET_ATTEMPT"
    LAUNCH_KEY = "FLEET_LAUNCH_KEY"  # the node's idempotency key: whose rank it holds
    IDEMPOTENCY_KEY = "FLEET_IDEMPOTENCY_KEY"
    NPROC = "FLEET_NPROC"
    NNODES = "FLEET_NNODES"
    NODE_RANK = "FLEET_NODE_RANK"
    FIRST_RANK = "FLEET_FIRST_RANK"
    ROUND = "FLEET_ROUND"
    MASTER_ADDR = "FLEET_MASTER_ADDR"
    MASTER_PORT = "FLEET_MASTER_PORT"
    NODE_ADDR = "FLEET_NODE_ADDR"
    GLOBAL_BATCH_SIZE = "FLEET_GLOBAL_BATCH_SIZE"
    BATCH_MODE = "FLEET_BATCH_MODE"
    RUN = "FLEET_RUN"
    SETUP = "FLEET_SETUP"  # a SkyPilot task's setup, run once per node before run
    PER_NODE = "FLEET_PER_NODE"  # "1": one worker per node, with SkyPilot's rank and IPs
    CPU_ONLY = "FLEET_CPU_ONLY"  # "1": a CPU job on a CPU node: its process sees no GPU
    WORKDIR = "FLEET_WORKDIR"
    FILES = "FLEET_FILES"  # the workdir and file mounts the agent places before setup
    FILES_ROOT = "FLEET_FILES_ROOT"  # where ~ and relative node paths point (default: $HOME)
    # a job's container (JobSpec.container_image): the image its per-node process runs in, and
    # the job's own env names (comma-separated) passed into it (broker.runtime.container)
    CONTAINER_IMAGE = "FLEET_CONTAINER_IMAGE"
    CONTAINER_ENV = "FLEET_CONTAINER_ENV"
    # a job's secret names (comma-separated) whose values are not in the launch's env (a cloud's
    # start script, which the cloud keeps in clear): the agent fetches them from the broker
    # (SECRETS_PATH) with its attempt token before any of the job's code runs
    SECRET_ENVS = "FLEET_SECRET_ENVS"
    # where it runs (providers' start scripts)
    CLOUD = "FLEET_CLOUD"
    REGION = "FLEET_REGION"
    MARKET = "FLEET_MARKET"
    ACCELERATOR = "FLEET_ACCELERATOR"
    GPUS_PER_NODE = "FLEET_GPUS_PER_NODE"
    NODES = "FLEET_NODES"
    AGENT_INSTALL = "FLEET_AGENT_INSTALL"
    SHUTDOWN_COMMAND = "FLEET_SHUTDOWN_COMMAND"
    METADATA_AWS_URL = "FLEET_METADATA_AWS_URL"
    # checkpoints and progress (the runtime library)
    CHECKPOINT_URI = "FLEET_CHECKPOINT_URI"
    CHECKPOINT_EVERY_STEPS = "FLEET_CHECKPOINT_EVERY_STEPS"
    CHECKPOINT_EVERY_SECONDS = "FLEET_CHECKPOINT_EVERY_SECONDS"
    CHECKPOINT_KEEP = "FLEET_CHECKPOINT_KEEP"
    CHECKPOINT_CACHE = "FLEET_CHECKPOINT_CACHE"
    PROGRESS_FILE = "FLEET_PROGRESS_FILE"
    PROGRESS_INTERVAL = "FLEET_PROGRESS_INTERVAL"
    # seconds the workers may run without writing the progress file before the agent reports
    # the job as one that restarts from the beginning (a plain script)
    PROGRESS_GRACE = "FLEET_PROGRESS_GRACE"
    ERROR_FILE = "FLEET_ERROR_FILE"
    INTEGRATIONS = "FLEET_INTEGRATIONS"  # "off": the agent injects no framework integration
    # in-place resize (the agent and the runtime; docs/runtime.md)
    RESIZE_FILE = "FLEET_RESIZE_FILE"  # the agent's resize order, read on SIGUSR2
    RESIZE_JOIN = "FLEET_RESIZE_JOIN"  # a worker joining a running group: its generation
    RESIZE_READY = "FLEET_RESIZE_READY"  # a joining worker touches it once its imports are done
    RESIZE_TIMEOUT = "FLEET_RESIZE_TIMEOUT"  # seconds an in-place resize may take (default 60)
    # talking to the broker
    BROKER_URL = "FLEET_BROKER_URL"
    AGENT_TOKEN = "FLEET_AGENT_TOKEN"
    AGENT_TOKEN_FILE = "FLEET_AGENT_TOKEN_FILE"
    AGENT_TOKEN_FD = "FLEET_AGENT_TOKEN_FD"  # a local node's pipe holding the token
    HEARTBEAT_INTERVAL = "FLEET_HEARTBEAT_INTERVAL"
    REPORT_TIMEOUT = "FLEET_REPORT_TIMEOUT"
    REPORT_MAX_WAIT = "FLEET_REPORT_MAX_WAIT"
    RENDEZVOUS_POLL = "FLEET_RENDEZVOUS_POLL"
    RENDEZVOUS_TIMEOUT = "FLEET_RENDEZVOUS_TIMEOUT"
    REJOIN_TIMEOUT = "FLEET_REJOIN_TIMEOUT"
    GRACE_PERIOD = "FLEET_GRACE_PERIOD"
    # preemption notices
    NOTICE_INTERVAL = "FLEET_NOTICE_INTERVAL"
    NOTICE_AWS_URL = "FLEET_NOTICE_AWS_URL"
    NOTICE_GCP_URL = "FLEET_NOTICE_GCP_URL"
    NOTICE_AZURE_URL = "FLEET_NOTICE_AZURE_URL"


class BrokerEnv:
    """Environment names of the broker's and the client's own settings: never a job's."""

    ADMIN_TOKEN = "FLEET_ADMIN_TOKEN"
    AGENT_TOKEN = Env.AGENT_TOKEN  # the broker's key, from which each attempt's token derives
    TEAM_TOKENS = "FLEET_TEAM_TOKENS"
    METRICS_TOKEN = "FLEET_METRICS_TOKEN"  # reads /metrics only
    REDIS_URL = "FLEET_REDIS_URL"
    URL = "FLEET_URL"
    TOKEN = "FLEET_TOKEN"
    CONFIG = "FLEET_CONFIG"  # the client's config file
    CONFIG_DIR = "FLEET_CONFIG_DIR"  # the catalog's folder
    BROKER_CONFIG = "FLEET_BROKER_CONFIG"  # the broker's config file (broker.config)
    AZURE_RESOURCE_GROUP = "FLEET_AZURE_RESOURCE_GROUP"
    AZURE_SUBNET_ID = "FLEET_AZURE_SUBNET_ID"
    FLEET_FILE = "FLEET_FILE"  # fleet up's options, for a container's environment
    HOST = "FLEET_HOST"
    PORT = "FLEET_PORT"
    STATE_DIR = "FLEET_STATE_DIR"
    LOG_FORMAT = "FLEET_LOG_FORMAT"
    LOG_LEVEL = "FLEET_LOG_LEVEL"
    SECRETS_KEY = "FLEET_SECRETS_KEY"  # the key that seals jobs' secrets (broker.sealed)
    JOB_USER = "FLEET_JOB_USER"  # who a root broker's local jobs run as (providers.job_user)

    SECRETS = frozenset({ADMIN_TOKEN, AGENT_TOKEN, TEAM_TOKENS, METRICS_TOKEN, REDIS_URL, TOKEN,
                         SECRETS_KEY})


# Exit codes of the agent (and of a worker, which the agent passes on)
EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped cleanly after a checkpoint; resume later


class Action(StrEnum):
    """What the broker tells an agent in a heartbeat or rendezvous reply."""

    CONTINUE = "continue"
    CHECKPOINT_EXIT = "checkpoint-exit"  # checkpoint, then exit EXIT_STOPPED
    RESIZE = "resize"  # run ``nproc`` workers on this node from now on, in place if it can


CHECKPOINT_EXIT = Action.CHECKPOINT_EXIT.value
CONTINUE = Action.CONTINUE.value
RESIZE = Action.RESIZE.value

HEARTBEAT_PATH = "/v1/agent/heartbeat"
RENDEZVOUS_PATH = "/v1/agent/rendezvous"
SECRETS_PATH = "/v1/agent/secrets"

JOB_ID = r"^[a-z0-9][a-z0-9_.-]{0,80}$"
# A node's idempotency key (Env.LAUNCH_KEY): "<job>:<fence>:<attempt>", a stand-in's with
# "~r<rank>.<round>" after it (providers.base.replacement_key).
LAUNCH_KEY = r"^[A-Za-z0-9:~._-]{1,160}$"
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


_LAUNCH_KEY_FIELD = Field(
    default=None, max_length=160, pattern=LAUNCH_KEY,
    description=f"the node's {Env.LAUNCH_KEY} (letters, digits, ':', '~', '.', '-', '_'; at most "
                "160): a node the broker replaced no longer holds its rank's key and is told to "
                "stop; a report without one is refused for a job launched with keys")


# What a heartbeat takes from the runtime's progress file, when the file has it (a field the
# node does not know is left out: the broker keeps what it has).
PROGRESS_FIELDS = ("step", "samples_done", "samples_per_sec", "world_size", "global_batch_size",
                   "checkpoint_step", "checkpoint_bytes", "checkpoint_seconds", "grad_noise_scale",
                   "even_batch")


class Heartbeat(BaseModel):
    """What a job's agent reports (rank 0 reports progress; every rank reports liveness). The
    final report is the last heartbeat, with ``exit_code`` (and ``error`` after a failure)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(pattern=JOB_ID)
    attempt: int = Field(ge=0, le=10**9)
    node_rank: int = Field(default=0, ge=0, le=4096)
    round: int = Field(default=0, ge=0, le=10**9, description="the agent's rendezvous round")
    launch_key: str | None = _LAUNCH_KEY_FIELD
    state: str = Field(default="running", max_length=32)
    step: int | None = Field(default=None, ge=0, le=10**15)
    samples_done: int | None = Field(default=None, ge=0, le=10**18)
    samples_per_sec: float | None = Field(default=None, ge=0, le=1e12)
    world_size: int | None = Field(default=None, ge=1, le=4096)
    global_batch_size: int | None = Field(default=None, ge=1, le=10**7)
    checkpoint_step: int | None = Field(default=None, ge=0, le=10**15)
    # strict: a size sent as a string or a fraction is a broken agent, not something to coerce
    checkpoint_bytes: int | None = Field(
        default=None, ge=0, le=10**16, strict=True,
        description="size in bytes of the checkpoint of checkpoint_step: every rank's files and "
                    "the manifest (placement prices its egress on a move)")
    checkpoint_seconds: float | None = Field(
        default=None, ge=0, le=10**7, description="how long writing and committing the "
        "checkpoint of checkpoint_step took (fleet_checkpoint_duration_seconds)")
    checkpoint_age_seconds: float | None = Field(
        default=None, ge=0, le=10**9, description="sent only for a script that commits its own "
        "DCP checkpoints (no progress file; the agent found checkpoint_step's folder with its "
        f"'.metadata' under {Env.CHECKPOINT_URI}): seconds since the agent first saw that "
        "checkpoint committed, by its own clock. Such a script takes no checkpoint at a stop, "
        "so a restart loses the work since then (the scheduler prices it so); absent for the "
        "runtime, which checkpoints at the stop")
    grad_noise_scale: float | None = Field(
        default=None, ge=0, le=1e15, description="the gradient noise scale in samples, as the "
        "runtime measures it (per-replica and all-reduced gradients): the batch beyond which a "
        "larger one buys little progress per sample")
    resumable: bool | None = Field(
        default=None, description="whether the job's workers report progress through the "
        "runtime or a supported framework with checkpoints on, or commit DCP checkpoints of "
        f"their own under {Env.CHECKPOINT_URI} (true: a move resumes from the latest "
        f"checkpoint), or ran {Env.PROGRESS_GRACE} seconds with neither (false: a plain "
        "script, which a move, resize or preemption restarts from the beginning); absent: not "
        "known yet")
    resize_in_place: bool | None = Field(
        default=None, description="whether a resize on the job's node keeps its workers' "
        "processes (true: one node, one worker per GPU, and the runtime's own loop over a DDP "
        "or plain model re-forms the group in place; false: the agent checkpoints and restarts "
        "the workers at the new size, as for a framework integration, an FSDP model or a "
        "plain script); absent: not known yet, which the scheduler prices as a restart")
    even_batch: bool | None = Field(
        default=None, description="whether the job needs a global batch that divides evenly "
        "over its workers (true for the Hugging Face and Lightning integrations, which average "
        "equal micro-batches: the scheduler then offers only such batches); false or absent: "
        "any batch of at least one sample per worker (the runtime's own loop weighs uneven "
        "shares)")
    accelerator: Accelerator | None = Field(
        default=None, description=f"the node's accelerator type ({Env.ACCELERATOR}): the "
        "throughput measured is kept per type")
    exit_code: int | None = Field(default=None, ge=-255, le=255,
                                  description="the command's exit code, in the last report")
    notice: str | None = Field(default=None, max_length=500,
                               description="the node's preemption notice, once it came")
    error: str | None = Field(default=None, max_length=500,
                              description="why the command failed, as the runtime named it "
                              "(e.g. 'checkpoint write failed: no space left on device'), in "
                              "a failed last report")

    @field_validator("samples_per_sec", "grad_noise_scale", "checkpoint_seconds",
                     "checkpoint_age_seconds")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class HeartbeatReply(BaseModel):
    action: Action | None = Field(description=f"null: keep going; '{CHECKPOINT_EXIT}': "
                                              f"checkpoint, then exit {EXIT_STOPPED}")
    round: int = Field(description="the job's rendezvous round; above the agent's: stop the "
                                   "workers and re-form the group in that round")
    brokers: list[str] = Field(default_factory=list, description="every live broker "
                               "replica's API URL: the agent reports to any of them, also to "
                               "one started after its launch")
    nproc: int | None = Field(default=None, ge=1, le=4096, description=f"with '{RESIZE}': the "
                              "workers this node runs from now on (the workers re-form their "
                              "group in place where the job runs the runtime, else they "
                              "checkpoint and restart at that size)")


class Rendezvous(BaseModel):
    """A node's visit to its job's rendezvous: it checks in for its round (rank 0 with the
    master's address)."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(pattern=JOB_ID)
    attempt: int = Field(ge=0, le=10**9)
    round: int = Field(ge=0, le=10**9)
    node_rank: int = Field(ge=0, le=4096)
    addr: str | None = Field(default=None, max_length=270,
                             description="this node's 'host:port' (host: an IP address, IPv6 in "
                                         "brackets, or a DNS name; port 1-65535); rank 0's is "
                                         "the round's master and required for its check-in")
    launch_key: str | None = _LAUNCH_KEY_FIELD

    @field_validator("addr")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None and not _is_host_port(v):
            raise ValueError("must be host:port, e.g. 10.0.0.5:29500 or [fd00::5]:29500 (host: "
                             "an IP address or DNS name, port 1-65535)")
        return v


class RendezvousReply(BaseModel):
    round: int = Field(description="the job's current round (above the node's: move to it)")
    nnodes: int = Field(description="nodes in the job")
    master: str | None = Field(description="'host:port' rank 0 registered for that round, "
                                           "once every node checked in for it; null until then")
    addrs: list[str] | None = Field(default=None, description="every node's 'host:port' by "
                                    "rank ('' where a node gave none), with master")
    action: Action | None = Field(description=f"null: keep going; '{CHECKPOINT_EXIT}': exit "
                                              f"{EXIT_STOPPED}")


class SecretsRequest(BaseModel):
    """An agent's request for its job's secrets (Env.SECRET_ENVS names them), with its attempt
    token: the broker answers only for the job's current attempt while it launches or runs."""

    model_config = ConfigDict(extra="ignore")

    job_id: str = Field(pattern=JOB_ID)
    attempt: int = Field(ge=0, le=10**9)


class SecretsReply(BaseModel):
    secrets: dict[str, str] = Field(description="the job's secret values by name (empty for a "
                                                "job without secrets); never logged")


def agent_action(action: str) -> Action | None:
    """A reply's ``action``: null to keep going, or ``checkpoint-exit``."""
    return Action.CHECKPOINT_EXIT if action == CHECKPOINT_EXIT else None


def _is_host_port(addr: str) -> bool:
    """Is ``addr`` "host:port" with an IP address ("[...]" around IPv6) or DNS name as host
    and a port in 1-65535?"""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_DNS_LABEL.fullmatch(x) for x in labels) and \
        not labels[-1].isdigit()


class _Shell(string.Template):
    delimiter = "@"


_SHELL_NAMES = {name: value for name, value in vars(Env).items() if name.isupper()} | {
    "EXIT_STOPPED": str(EXIT_STOPPED), "HEARTBEAT_PATH": HEARTBEAT_PATH}


def shell(template: str) -> str:
    """A start-script fragment with the protocol's names filled in: ``@NAME`` is ``Env.NAME``
    (``$@AGENT_TOKEN`` is ``$FLEET_AGENT_TOKEN``), ``@EXIT_STOPPED`` and ``@HEARTBEAT_PATH``
    their values; any other ``@`` (``"${a[@]}"``, ``curl -H @-``) stays as it is."""
    return _Shell(template).safe_substitute(_SHELL_NAMES)
