"""What the cloud providers share: launch tags, idempotency tokens, the agent's start script."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import uuid
from importlib import metadata

from policies.models import Market
from providers.base import LaunchRequest

BROKER_TAG = "fleet-broker"  # value: the broker's id, so several brokers can share an account
JOB_TAG = "fleet-job"
KEY_TAG = "fleet-idempotency-key"
MARKET_TAG = "fleet-market"
ACCELERATOR_TAG = "fleet-accelerator"
GPUS_TAG = "fleet-gpus"

# UUIDv5 namespace for request ids derived from idempotency keys (fixed forever: changing it
# would make retried launches after an upgrade look new).
REQUEST_NAMESPACE = uuid.UUID("6f1c2b8e-3f4a-5d6e-8a9b-0c1d2e3f4a5b")

# Where the agent on a spot VM polls for the preemption notice (each cloud's metadata service).
NOTICE_URLS = {
    "aws": ("FLEET_NOTICE_AWS_URL", "http://169.254.169.254/latest/meta-data/spot/instance-action"),
    "gcp": ("FLEET_NOTICE_GCP_URL",
            "http://metadata.google.internal/computeMetadata/v1/instance/preempted"),
    "azure": ("FLEET_NOTICE_AZURE_URL",
              "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"),
}


# What a start script pip-installs when the image lacks the agent (see ``agent_install_spec``).
AGENT_INSTALL_ENV = "FLEET_AGENT_INSTALL"


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


def tags(request: LaunchRequest, broker_id: str) -> dict[str, str]:
    return {
        BROKER_TAG: broker_id,
        JOB_TAG: request.job_id,
        KEY_TAG: request.idempotency_key,
        MARKET_TAG: request.market.value,
        ACCELERATOR_TAG: request.accelerator.value,
        GPUS_TAG: str(request.gpus_per_node),
    }


def agent_env(request: LaunchRequest, cloud: str) -> dict[str, str]:
    """The FLEET_* environment of the agent: the request's own env plus where it runs, and on
    spot the cloud's metadata URL for preemption notices."""
    bad = [k for k in request.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        raise ValueError(f"env: {bad} are not valid variable names (use letters, digits, '_')")
    notice = NOTICE_URLS.get(cloud) if request.market is Market.SPOT else None
    return {
        **(dict([notice]) if notice else {}),  # the request's env may point elsewhere
        **request.env,
        "FLEET_JOB_ID": request.job_id,
        "FLEET_IDEMPOTENCY_KEY": request.idempotency_key,
        "FLEET_CLOUD": cloud,
        "FLEET_REGION": request.region,
        "FLEET_MARKET": request.market.value,
        "FLEET_ACCELERATOR": request.accelerator.value,
        "FLEET_GPUS_PER_NODE": str(request.gpus_per_node),
        "FLEET_NODES": str(request.nodes),
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
        raise ValueError(
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
    return (
        "if ! python3 -c 'import broker.runtime.agent' 2>/dev/null; then\n"
        f"  echo {shlex.quote(f'fleet: installing the agent: {redact(spec)}')} >&2\n"
        # Ubuntu's python3 comes without pip; the cloud images run user data as root.
        "  if ! python3 -m pip --version >/dev/null 2>&1 && command -v apt-get >/dev/null; then\n"
        "    apt-get update -q && apt-get install -y -q python3-pip\n"
        "  fi\n"
        # The VM exists for this job: installing into the image's python (PEP 668) is intended.
        "  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet "
        f"--disable-pip-version-check {shlex.quote(spec)}\n"
        "fi\n"
    )


def agent_command(request: LaunchRequest) -> str:
    """The line that replaces the shell with the agent running ``request.command``."""
    command = " ".join(shlex.quote(part) for part in request.command)
    return f"exec python3 -m broker.runtime.agent -- {command}\n"


def agent_script(request: LaunchRequest, cloud: str, agent_install: str) -> str:
    """A shell start script (user data / startup-script / custom data) that installs the agent
    from ``agent_install`` where the image lacks it, then runs it."""
    exports = "\n".join(
        f"export {k}={shlex.quote(v)}" for k, v in sorted(agent_env(request, cloud).items())
    )
    return (
        "#!/bin/bash\nset -euo pipefail\n"
        f"{exports}\n"
        f"{install_step(agent_install)}"
        f"{agent_command(request)}"
    )
