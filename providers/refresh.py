"""Refresh catalog prices from the clouds' own APIs and write them as the user's catalog files.

Each cloud fetches its own prices (``Cloud.refresh``, in its folder: AWS spot prices per AZ, GCP's
Cloud Billing Catalog, Azure's Retail Prices API); this module runs them and writes the results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from providers import catalog, registry
from providers.base import NotConfiguredError

# --- what `fleet prices --refresh` runs ----------------------------------------------------------


def http_get_json(session: Any) -> Callable[[str, dict], dict]:
    def get_json(url: str, params: dict) -> dict:
        resp = session.get(url, params=params, timeout=60)
        resp.raise_for_status()
        return resp.json()

    return get_json


@dataclass
class RefreshReport:
    """What ``refresh_clouds`` did: a one-line outcome per cloud, and which clouds failed."""

    outcome: dict[str, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    refreshed: list[str] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        """Every cloud that could be tried failed (unconfigured, skipped clouds do not count)."""
        return bool(self.failed) and not self.refreshed


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def refresh_clouds(clouds: list[str], root: Any = None) -> RefreshReport:
    """Refresh each cloud that can be refreshed; one cloud's failure keeps its previous offers
    and does not stop the others."""
    report = RefreshReport()
    for cloud in clouds:
        try:
            offers = registry.get(cloud).refresh()
        except NotConfiguredError as exc:
            report.outcome[cloud] = f"skipped: {exc}"
            continue
        except Exception as exc:  # network, HTTP, API or parse errors: any of them, per cloud
            report.outcome[cloud] = f"failed: {_one_line(exc)}; kept the previous offers"
            report.failed.append(cloud)
            continue
        result = catalog.write_user_catalog(cloud, offers, root)
        note = " (your edited vms.csv was kept)" if result.kept_user_file else ""
        report.outcome[cloud] = f"{len(offers)} offers -> {result.path}{note}"
        report.refreshed.append(cloud)
    return report
