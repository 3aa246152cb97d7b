"""The one list of clouds, and building their providers.

Each cloud lives in its own folder under ``providers/`` with a ``Cloud`` subclass exported as
``CLOUD`` (see ``providers.cloud``); ``HOMES`` names those folders, one line per cloud. Adding a
cloud is its folder and its line here: the spec's region checks, the fleet file, the catalog,
the agent's notice URL and ``build_providers`` all read the clouds from here.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from broker.errors import InvalidInput
from providers.base import NotConfiguredError, Provider
from providers.cloud import Cloud

log = logging.getLogger(__name__)

HOMES: tuple[str, ...] = (
    "providers.aws",
    "providers.gcp",
    "providers.azure",
    "providers.local",
)


@functools.cache
def _load(homes: tuple[str, ...]) -> dict[str, Cloud]:
    found: dict[str, Cloud] = {}
    for home in homes:
        cloud = importlib.import_module(home).CLOUD
        if not isinstance(cloud, Cloud) or cloud.name in found:
            raise TypeError(f"{home}.CLOUD must be a Cloud with a name of its own")
        found[cloud.name] = cloud
    return found


def clouds() -> dict[str, Cloud]:
    """Every cloud by name, in ``HOMES`` order."""
    return _load(HOMES)


def names() -> tuple[str, ...]:
    return tuple(clouds())


def priced() -> tuple[str, ...]:
    """The clouds with a price catalog."""
    return tuple(n for n, c in clouds().items() if c.priced)


def rented() -> tuple[str, ...]:
    """The clouds the broker buys capacity from (a fleet file's ``clouds:``)."""
    return tuple(n for n, c in clouds().items() if c.rented)


def get(name: str) -> Cloud:
    """The cloud called ``name``; an ``InvalidInput`` naming the clouds (and the closest) if
    none."""
    found = clouds().get(name)
    if found is None:
        raise InvalidInput(f"unknown cloud {name!r}{_suggest(name)}; use one of: "
                           f"{', '.join(names())}")
    return found


def meant(word: str) -> str | None:
    """The cloud a word most likely means: an alias (``google`` -> ``gcp``) or a near-typo."""
    by_alias = {alias: c.name for c in clouds().values() for alias in c.aliases}
    return by_alias.get(word) or next(iter(difflib.get_close_matches(word, names(), 1)), None)


def _suggest(word: str) -> str:
    close = meant(word)
    return f" (did you mean {close!r}?)" if close else ""


def _skypilot(**kw: Any) -> Provider:
    from providers.skypilot import SkyPilotProvider

    return SkyPilotProvider(**kw)


# Launch backends other than a cloud's own SDK; each is told which cloud it launches on.
LAUNCHERS: dict[str, Callable[..., Provider]] = {"skypilot": _skypilot}


def build_providers(
    names: Iterable[str] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    launchers: Mapping[str, str] | None = None,
) -> tuple[dict[str, Provider], dict[str, str]]:
    """``(providers, skipped)``: each configured cloud's provider (default: every rented cloud),
    and why the others were skipped.

    ``launchers`` names another launch backend for a cloud (``{"gcp": "skypilot"}``: GCP through
    SkyPilot, which is then told the cloud).

    Credentials come only from each cloud's standard chain (boto3's default chain,
    ``google.auth.default()``, ``DefaultAzureCredential``); nothing about them is logged.
    """
    built: dict[str, Provider] = {}
    skipped: dict[str, str] = {}
    for name in rented() if names is None else names:
        if name not in rented():
            raise InvalidInput(f"unknown cloud {name!r} to rent from{_suggest(name)}; use one of: "
                               f"{', '.join(rented())}")
        cloud = get(name)
        launcher = (launchers or {}).get(name, name)
        kw = (options or {}).get(name, {})
        try:
            if launcher == name:
                built[name] = cloud.provider(**kw)
            elif launcher in LAUNCHERS:
                built[name] = LAUNCHERS[launcher](**{**kw, "cloud": name})
            else:
                raise InvalidInput(f"unknown launcher {launcher!r} for {name}; use {name} itself "
                                   f"or one of: {', '.join(LAUNCHERS)}")
        except NotConfiguredError as exc:
            skipped[name] = str(exc)
            log.warning("skipping %s: %s", name, exc)
    return built, skipped
