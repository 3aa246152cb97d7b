"""GCP: Compute Engine through google-cloud-compute (``provider.py``), the catalog's host and GPU
join (``catalog.py``), prices from the Cloud Billing Catalog (``refresh.py``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from broker.protocol import Env
from providers.cloud import Cloud

if TYPE_CHECKING:
    from providers.base import Provider
    from providers.catalog import CatalogOffer


class Gcp(Cloud):
    name = "gcp"
    aliases = ("google", "gce")
    region_shape = re.compile(r"^[a-z]+-[a-z]+\d+$")  # europe-west4
    region_example = "europe-west4"
    object_store = "gcs"
    notice = (Env.NOTICE_GCP_URL,
              "http://metadata.google.internal/computeMetadata/v1/instance/preempted")
    not_configured = (
        "gcp is not configured: google.auth.default() found no credentials or no project. Run "
        "`gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a "
        "service-account key) and set GOOGLE_CLOUD_PROJECT.")
    capacity_codes = frozenset({
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "RESOURCE_POOL_EXHAUSTED",
        "STOCKOUT",
        "resourcePoolExhausted",
    })
    quota_codes = frozenset({"QUOTA_EXCEEDED", "quotaExceeded", "rateLimitExceeded"})
    auth_codes = frozenset({"Unauthorized", "PermissionDenied"})  # google.api_core's classes

    def error_codes(self, exc: Exception) -> tuple[set[str], str] | None:
        """A google.api_core HTTP error's reasons, the codes its message names and its class."""
        from google.api_core import exceptions as gexc

        if not isinstance(exc, gexc.GoogleAPICallError):
            return None
        reasons = {e.get("reason", "") for e in (exc.errors or []) if isinstance(e, dict)}
        codes = (reasons | {getattr(exc, "reason", "") or "", type(exc).__name__}
                 | set(re.findall(r"[A-Z_]{8,}", exc.message)))
        return codes, exc.message

    def tag_value(self, value: str) -> str:
        """GCE labels allow only ``a-z 0-9 _ -``, at most 63 of them."""
        from providers.bootstrap import label_value

        return label_value(value)

    def snapshot(self) -> list[CatalogOffer]:
        from providers.gcp.catalog import snapshot

        return snapshot()

    def refresh(self) -> list[CatalogOffer]:
        from providers.gcp.refresh import offers_now

        return offers_now()

    def provider(self, **options: Any) -> Provider:
        from providers.gcp.provider import GcpProvider

        return GcpProvider(**options)


CLOUD = Gcp()
