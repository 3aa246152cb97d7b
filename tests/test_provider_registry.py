"""The registry builds configured clouds and skips the others with a warning that names the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from providers import registry
from providers.aws.provider import AwsProvider
from providers.registry import build_providers
from tests.cloud_env import no_cloud_config

SECRET = "wJalrXUtnFEMI-not-a-real-secret"


@pytest.fixture(autouse=True)
def unconfigured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_cloud_config(monkeypatch, tmp_path)



def test_nothing_configured_skips_every_cloud_with_a_reason(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="providers.registry"):
        built, skipped = build_providers()
    assert built == {}
    assert set(skipped) == set(registry.rented())
    for cloud in registry.rented():
        assert f"{cloud} is not configured" in skipped[cloud]
        assert any(f"skipping {cloud}" in r.getMessage() for r in caplog.records)


def test_configured_cloud_is_built_and_secrets_stay_out_of_logs(monkeypatch, caplog) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFLEETTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with caplog.at_level(logging.DEBUG):
        built, skipped = build_providers(options={"aws": {"regions": ["us-east-1"]}})
    assert isinstance(built["aws"], AwsProvider) and built["aws"].regions == ["us-east-1"]
    assert set(skipped) == set(registry.rented()) - {"aws"}
    assert SECRET not in caplog.text and "AKIAFLEETTEST" not in caplog.text


def test_unknown_provider_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown cloud 'ibm' to rent from; use one of: aws, "):
        build_providers(["ibm"])
    with pytest.raises(ValueError, match="unknown cloud 'gpc' to rent from \\(did you mean 'gcp'"):
        build_providers(["gpc"])
