"""The registry builds configured clouds and skips the others with a warning that names the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from providers.aws import AwsProvider
from providers.registry import build_providers

SECRET = "wJalrXUtnFEMI-not-a-real-secret"


@pytest.fixture(autouse=True)
def no_cloud_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN",
                "AZURE_SUBSCRIPTION_ID", "FLEET_AZURE_RESOURCE_GROUP", "FLEET_AZURE_SUBNET_ID",
                "GOOGLE_CLOUD_PROJECT"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))
    monkeypatch.setenv("NO_GCE_CHECK", "true")


def test_nothing_configured_skips_every_cloud_with_a_reason(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="providers.registry"):
        built, skipped = build_providers()
    assert built == {}
    assert set(skipped) == {"aws", "gcp", "azure"}
    for cloud in ("aws", "gcp", "azure"):
        assert f"{cloud} is not configured" in skipped[cloud]
        assert any(f"skipping {cloud}" in r.getMessage() for r in caplog.records)


def test_configured_cloud_is_built_and_secrets_stay_out_of_logs(monkeypatch, caplog) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFLEETTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with caplog.at_level(logging.DEBUG):
        built, skipped = build_providers(options={"aws": {"regions": ["us-east-1"]}})
    assert isinstance(built["aws"], AwsProvider) and built["aws"].regions == ["us-east-1"]
    assert set(skipped) == {"gcp", "azure"}
    assert SECRET not in caplog.text and "AKIAFLEETTEST" not in caplog.text


def test_unknown_provider_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown provider 'ibm'"):
        build_providers(["ibm"])
