"""Cloud SDK environments for tests: nothing of this machine's cloud configuration leaks in."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from botocore.awsrequest import AWSResponse

_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "GOOGLE_CLOUD_PROJECT", "AZURE_SUBSCRIPTION_ID",
    "FLEET_AZURE_RESOURCE_GROUP", "FLEET_AZURE_SUBNET_ID",
)


def no_cloud_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials, config files, instance metadata or gcloud config: every cloud is
    unconfigured until a test says otherwise."""
    for var in _CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "true")


def fake_aws_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Unconfigured clouds, then the dummy keys moto accepts."""
    no_cloud_config(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


class RawBody:
    """A reply body botocore reads as it reads a real endpoint's."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def aws_quotas(client: Any, values: Mapping[str, float]) -> None:
    """Answer ``client``'s (Service Quotas) GetServiceQuota as AWS does, from ``values`` (quota
    code -> vCPUs; read at each call, so a test may change it), NoSuchResourceException for the
    other codes: moto knows no EC2 quotas. botocore parses the replies as real ones."""

    def reply(request: Any, **_: Any) -> AWSResponse:
        code = json.loads(request.body)["QuotaCode"]
        if code in values:
            status, body = 200, {"Quota": {"ServiceCode": "ec2", "QuotaCode": code,
                                           "Value": values[code]}}
        else:
            status, body = 400, {"__type": "NoSuchResourceException",
                                 "message": f"no quota {code}"}
        return AWSResponse(request.url, status, {}, RawBody(json.dumps(body).encode()))

    client.meta.events.register("before-send.service-quotas.GetServiceQuota", reply)


def ec2_params(request: Any) -> dict[str, str]:
    """An EC2 (query protocol) request's form parameters."""
    body = request.body.decode() if isinstance(request.body, bytes) else request.body or ""
    return {k: v[0] for k, v in parse_qs(body).items()}


def record_launches(ec2: Any) -> dict[str, set[str]]:
    """The AZs ``ec2``'s RunInstances go to, in order, each with the ClientTokens sent there
    (botocore itself retries a refusal with HTTP 500, as InsufficientInstanceCapacity)."""
    sent: dict[str, set[str]] = {}

    def record(request: Any, **_: Any) -> None:
        params = ec2_params(request)
        sent.setdefault(params["Placement.AvailabilityZone"], set()).add(params["ClientToken"])

    ec2.meta.events.register("before-send.ec2.RunInstances", record)
    return sent


def ec2_refuses(client: Any, code: str, zone: str | None = None) -> None:
    """Make ``client``'s (EC2) RunInstances fail with error ``code`` in EC2's XML shape (HTTP
    500 for the Insufficient* capacity codes, 400 else): moto never runs out of anything.
    ``zone``: only the launches placed in that AZ fail; the others reach moto."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
        f"<Message>injected {code}</Message></Error></Errors><RequestID>r-1</RequestID></Response>"
    ).encode()

    def reply(request: Any, **_: Any) -> AWSResponse | None:
        if zone is not None and ec2_params(request).get("Placement.AvailabilityZone") != zone:
            return None
        refusal = AWSResponse(request.url, 500 if "Insufficient" in code else 400, {},
                              RawBody(body))
        # botocore offers the request to every before-send handler, moto's too, and takes the
        # first reply: point it nowhere, or moto would launch what EC2 refused.
        request.url = "https://refused.invalid/"
        return refusal

    client.meta.events.register("before-send.ec2.RunInstances", reply)


def ec2_honours_client_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make moto's RunInstances idempotent by ``ClientToken`` as EC2 is: a token seen before
    returns that launch's reservation (same AZ) or fails with IdempotentParameterMismatch (another
    AZ) and never starts an instance; moto launches again for any token."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.instances import InstanceBackend

    launch = InstanceBackend.run_instances

    def run_instances(backend: Any, *args: Any, **kwargs: Any) -> Any:
        token = kwargs.get("client_token")
        for reservation in backend.reservations.values():
            first = reservation.instances[0] if reservation.instances else None
            if token is None or first is None or first.client_token != token:
                continue
            if kwargs.get("placement") not in (None, first.placement.zone):
                raise EC2ClientError("IdempotentParameterMismatch",
                                     f"token {token} was used with other parameters")
            return reservation
        return launch(backend, *args, **kwargs)

    monkeypatch.setattr(InstanceBackend, "run_instances", run_instances)
