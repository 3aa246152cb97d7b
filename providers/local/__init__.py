"""The local cloud: pretend regions on this machine (``provider.py``), each node a process group
under a supervisor (``node.py``). The embedded default the demo runs on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from providers.cloud import Cloud

if TYPE_CHECKING:
    from providers.base import Provider


class Local(Cloud):
    """Regions are whatever the fleet file names them; no SDK, no price catalog (each region
    states its price), and reclaims arrive as SIGTERM rather than through a metadata URL."""

    name = "local"
    rented = False

    def provider(self, **options: Any) -> Provider:
        from providers.local.provider import LocalProvider

        return LocalProvider(**options)


CLOUD = Local()
