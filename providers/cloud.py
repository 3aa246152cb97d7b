"""What the broker knows about one cloud, behind one base class (as SkyPilot's ``sky/clouds``).

Each cloud lives in its own folder under ``providers/`` (``providers/aws/`` ...): its package
defines one ``Cloud`` subclass and exports an instance as ``CLOUD``, holding everything about
that cloud: its names and aliases, the shape of its region names with an example, where a spot
VM polls for the preemption notice, its price catalog snapshot and refresh, how its SDK's errors
map to the broker's, and the factory of its provider. ``providers.registry`` lists the clouds;
nothing else names them.

The package's ``__init__`` stays light (the standard library only, so the local cloud's node
supervisor starts at once, and no SDK): the registry imports every cloud's to learn names and
region shapes; the provider, catalog, refresh and error classes are imported on use.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from providers.base import Provider, ProviderError
    from providers.catalog import CatalogOffer

DATA = Path(__file__).parent / "data"  # the vendored snapshots, each with its SOURCE.md


class Cloud(abc.ABC):
    """One cloud. Subclasses set the class attributes and implement ``provider``; a cloud with
    a price catalog implements ``snapshot`` (and ``refresh`` where its prices can be fetched),
    a cloud with an SDK implements ``error_codes``."""

    name: ClassVar[str]
    # What people call it beyond near-typos of its name (difflib finds those).
    aliases: ClassVar[tuple[str, ...]] = ()
    # The shape of its region names, and one to show in an error; None: any name (the local
    # cloud's regions are whatever the fleet file calls them).
    region_shape: ClassVar[re.Pattern[str] | None] = None
    region_example: ClassVar[str] = "region-1"
    # (agent environment variable, URL): where the agent on a spot VM polls for the preemption
    # notice; None where the cloud delivers no notice to the node.
    notice: ClassVar[tuple[str, str] | None] = None
    # How to configure it, appended to every "not configured" error.
    not_configured: ClassVar[str] = ""
    # The SDK's error codes that mean no capacity now, an account quota, or bad credentials;
    # ``error_hints``: code -> what the user should know besides the message.
    capacity_codes: ClassVar[frozenset[str]] = frozenset()
    quota_codes: ClassVar[frozenset[str]] = frozenset()
    auth_codes: ClassVar[frozenset[str]] = frozenset()
    error_hints: ClassVar[Mapping[str, str]] = {}
    # Whether the broker buys capacity from it (a fleet file's ``clouds:``) rather than running
    # it itself (the local cloud, the fleet file's ``regions:``).
    rented: ClassVar[bool] = True
    # Its object store, as SkyPilot's ``store`` names it (``s3``, ``gcs``, ``azure``): where a
    # task's named bucket with no ``store`` lands when the job is placed here; None: it has none.
    object_store: ClassVar[str | None] = None

    def __repr__(self) -> str:
        return f"<cloud {self.name}>"

    # --- regions -----------------------------------------------------------------------------

    def region_problem(self, region: str) -> str | None:
        """Why ``region`` cannot be one of this cloud's regions (``aws:us-east1``), or None."""
        if self.region_shape is None or self.region_shape.match(region):
            return None
        return (f"{region!r} is not a {self.name} region name; write one like "
                f"{self.name}:{self.region_example}")

    def has_region_shape(self, region: str) -> bool:
        """Whether ``region`` looks like one of this cloud's (never true without a shape)."""
        return self.region_shape is not None and bool(self.region_shape.match(region))

    # --- start scripts -----------------------------------------------------------------------

    def rank_step(self) -> str | None:
        """Shell lines that set FLEET_NODE_RANK on a node of a multi-node launch whose nodes
        share one start script; None where each node is started with its own (its rank in it)."""
        return None

    # --- tags --------------------------------------------------------------------------------

    def tag_value(self, value: str) -> str:
        """``value`` as this cloud accepts it in a tag or label (most take any string)."""
        return value

    # --- errors ------------------------------------------------------------------------------

    def error_codes(self, exc: Exception) -> tuple[set[str], str] | None:
        """``(codes, detail)`` of an error raised by this cloud's SDK, None for any other
        exception (which then passes through ``map_error`` unchanged)."""
        return None

    def map_error(self, exc: Exception, what: str) -> Exception:
        """The broker's error for ``exc`` raised while doing ``what`` (others pass through)."""
        found = self.error_codes(exc)
        if found is None:
            return exc
        codes, detail = found
        return self.classify(codes, f"{self.name} {what}: {detail}")

    def classify(self, codes: Iterable[str], message: str) -> ProviderError:
        """The broker's error for a failure with these codes: no capacity, quota, credentials,
        else a plain ``ProviderError`` (with the hint of a code that has one)."""
        from providers.base import CapacityError, NotConfiguredError, ProviderError, QuotaError

        found = set(codes)
        if found & self.capacity_codes:
            return CapacityError(message)
        if found & self.quota_codes:
            return QuotaError(message)
        if found & self.auth_codes:
            return NotConfiguredError(f"{message}. {self.not_configured}")
        hint = next((h for code, h in self.error_hints.items() if code in found), None)
        return ProviderError(f"{message}. {hint}" if hint else message)

    # --- catalog -----------------------------------------------------------------------------

    def snapshot(self) -> list[CatalogOffer] | None:
        """The vendored price snapshot's offers (``providers/data/``), None for a cloud without
        a price catalog."""
        return None

    def refresh(self) -> list[CatalogOffer]:
        """Offers with prices fetched now from the cloud's own API; ``NotConfiguredError`` where
        it cannot be asked."""
        from providers.base import NotConfiguredError

        raise NotConfiguredError(f"{self.name} has no price API to refresh from")

    @property
    def priced(self) -> bool:
        """Whether the cloud has a price catalog (``snapshot``)."""
        return type(self).snapshot is not Cloud.snapshot

    # --- factory -----------------------------------------------------------------------------

    @abc.abstractmethod
    def provider(self, **options: Any) -> Provider:
        """A provider for this cloud; ``NotConfiguredError`` where credentials are missing."""
