"""Build the configured cloud providers; skip unconfigured ones with a warning naming the fix."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from providers.base import NotConfiguredError, Provider

log = logging.getLogger(__name__)


def _aws(**kw: Any) -> Provider:
    from providers.aws import AwsProvider

    return AwsProvider(**kw)


def _gcp(**kw: Any) -> Provider:
    from providers.gcp import GcpProvider

    return GcpProvider(**kw)


def _azure(**kw: Any) -> Provider:
    from providers.azure import AzureProvider

    return AzureProvider(**kw)


def _skypilot(**kw: Any) -> Provider:
    from providers.skypilot import SkyPilotProvider

    return SkyPilotProvider(**kw)


FACTORIES: dict[str, Callable[..., Provider]] = {
    "aws": _aws,
    "gcp": _gcp,
    "azure": _azure,
    "skypilot": _skypilot,
}


def build_providers(
    names: Iterable[str] = ("aws", "gcp", "azure"),
    options: dict[str, dict[str, Any]] | None = None,
    launchers: Mapping[str, str] | None = None,
) -> tuple[dict[str, Provider], dict[str, str]]:
    """``(providers, skipped)``: each configured cloud's provider, and why the others were skipped.

    ``launchers`` names another factory for a cloud (``{"gcp": "skypilot"}``: GCP through
    SkyPilot, which is then told the cloud).

    Credentials come only from each cloud's standard chain (boto3's default chain,
    ``google.auth.default()``, ``DefaultAzureCredential``); nothing about them is logged.
    """
    built: dict[str, Provider] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name not in FACTORIES:
            raise ValueError(f"unknown provider {name!r}; use one of: {', '.join(FACTORIES)}")
        launcher = (launchers or {}).get(name, name)
        kw = (options or {}).get(name, {})
        if launcher != name:
            kw = {**kw, "cloud": name}
        try:
            built[name] = FACTORIES[launcher](**kw)
        except NotConfiguredError as exc:
            skipped[name] = str(exc)
            log.warning("skipping %s: %s", name, exc)
    return built, skipped
