"""What the cloud providers share: launch tags, idempotency tokens, the agent's start script."""

from __future__ import annotations

import hashlib
import re
import shlex
import uuid

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


def agent_script(request: LaunchRequest, cloud: str) -> str:
    """A shell start script (user data / startup-script / custom data) that runs the agent."""
    exports = "\n".join(
        f"export {k}={shlex.quote(v)}" for k, v in sorted(agent_env(request, cloud).items())
    )
    command = " ".join(shlex.quote(part) for part in request.command)
    return (
        "#!/bin/bash\nset -euo pipefail\n"
        f"{exports}\n"
        f"exec python3 -m broker.runtime.agent -- {command}\n"
    )
