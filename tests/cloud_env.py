"""Cloud SDK environments for tests: nothing of this machine's cloud configuration leaks in."""

from __future__ import annotations

from pathlib import Path

import pytest

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
