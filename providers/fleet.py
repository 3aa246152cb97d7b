"""The broker's one provider over the whole fleet: the local pretend regions and the cloud
providers a fleet file declares (``clouds:``), each call routed by the pool's cloud.

A declared cloud without credentials is skipped with one log line naming the cloud and the fix
(``providers.registry.build_providers``); the broker keeps using the others. A backend that
fails while running (API down, network) is reported by ``unreachable()`` so the reconciler
leaves its jobs as they are, and the other backends go on. A backend's failure text passes
through ``reason`` before it leaves as a ``ProviderError``: the broker gives its secret
scrubber (``broker.secrets.reason``), which this layer cannot import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.errors import InvalidInput
from policies.models import Accelerator, Market, Offer, Pool, pool_id
from providers import registry
from providers.base import (
    LaunchRequest,
    Node,
    NodeState,
    PreemptionNotice,
    Provider,
    ProviderError,
    Quota,
    share,
)
from providers.catalog import interruption_priors, pool_prior
from providers.local.provider import LocalFleet, LocalProvider, LocalRegion

log = logging.getLogger(__name__)
T = TypeVar("T")


def one_line(text: object) -> str:
    """A failure text on one line, at most 300 characters (``FleetProvider``'s default
    ``reason``)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= 300 else flat[:299] + "…"


class CloudConfig(BaseModel):
    """One cloud of the fleet: where the broker may buy which GPUs, and at most how many."""

    model_config = ConfigDict(extra="forbid")

    regions: list[str] = Field(min_length=1)
    accelerators: list[Accelerator] = Field(default_factory=lambda: [Accelerator.T4],
                                            min_length=1)
    markets: list[Market] = Field(default_factory=lambda: [Market.SPOT, Market.ON_DEMAND],
                                  min_length=1)
    launcher: Literal["native", "skypilot"] = Field(
        default="native",
        description="native: the cloud's own SDK (boto3, google-cloud-compute, "
        "azure-mgmt-compute); skypilot: launch through SkyPilot pinned to the broker's choice")
    max_gpus: int = Field(default=8, ge=1, le=4096,
                          description="GPUs the broker may hold per pool (a budget cap; the "
                          "provider's quota headroom lowers it when known)")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="extra provider arguments (image_id, broker_id, endpoint_url); never "
        "credentials: those come from the cloud's standard chain")

    @model_validator(mode="after")
    def _no_credentials(self) -> CloudConfig:
        words = ("secret", "password", "key_id", "token", "credential")
        bad = [k for k in self.options if any(w in k.lower() for w in words)]
        if bad:
            raise ValueError(f"options: {bad} look like credentials; remove them and use the "
                             "cloud's standard credential chain (AWS_PROFILE, gcloud auth "
                             "application-default login, az login)")
        return self


class FleetFile(LocalFleet):
    """A fleet file: local pretend ``regions`` (optional once ``clouds`` are declared) and
    ``clouds: {aws: {regions: [...], ...}}``."""

    regions: list[LocalRegion] = Field(default_factory=list)  # type: ignore[assignment]
    clouds: dict[str, CloudConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _routable(self) -> FleetFile:
        unknown = sorted(set(self.clouds) - set(registry.rented()))
        if unknown:
            raise ValueError(f"clouds: unknown cloud {unknown[0]!r}; use one of: "
                             f"{', '.join(registry.rented())}")
        if not self.regions and not self.clouds:
            raise ValueError("declare local pretend regions under `regions:` or real clouds "
                             "under `clouds:` (or both)")
        for i, r in enumerate(self.regions):
            if r.cloud in self.clouds:
                raise ValueError(f"regions.{i}.cloud: {r.cloud!r} is also declared under "
                                 f"clouds:; give pretend regions another cloud name (e.g. "
                                 f"local) so launches route unambiguously")
        return self

    def local_fleet(self) -> LocalFleet | None:
        if not self.regions:
            return None
        return LocalFleet.model_validate(self.model_dump(exclude={"clouds"}))


def cloud_pools(cloud: str, config: CloudConfig, offers: list[Offer],
                quotas: Sequence[Quota] = (), held: Mapping[str, int] | None = None,
                ) -> list[Pool]:
    """One pool per (region, accelerator, market) that the provider's offers price: the
    cheapest per-GPU price among instance types of at most ``max_gpus`` GPUs there, each size's
    own cheapest price (``Pool.gpu_prices``: the launchable counts), and ``max_gpus`` GPUs, fewer
    where a quota is known: the GPUs the broker ``held`` there (its live nodes, which the
    headroom already counts as used) plus the pool's share of its quota's headroom among the
    fleet's pools that draw on it, in whole instances of its sizes (``providers.base.share``)."""
    priced = []
    for region in config.regions:
        for acc in config.accelerators:
            for market in config.markets:
                sizes = [(o.accelerator_count, h / o.accelerator_count) for o in offers
                         if o.region == region and o.accelerator is acc
                         and o.accelerator_count <= config.max_gpus  # a node it may hold
                         and (h := o.hourly(market)) is not None]
                if not sizes:
                    log.info("%s %s: no %s %s offer in the catalog; no pool", cloud, region,
                             acc.value, market.value)
                    continue
                priced.append((Pool(cloud=cloud, region=region, accelerator=acc, market=market,
                                    nodes=0, gpus_per_node=1), sizes))
    held = held or {}
    free = share(quotas, {pool.id for pool, _ in priced},
                 {pool.id: [n for n, _ in sizes] for pool, sizes in priced},
                 {pool.id: max(0, config.max_gpus - held.get(pool.id, 0)) for pool, _ in priced})
    pools = []
    for pool, sizes in priced:
        gpus = config.max_gpus if pool.id not in free else \
            min(config.max_gpus, held.get(pool.id, 0) + free[pool.id])
        pools.append(pool.model_copy(update={
            "nodes": int(gpus > 0), "gpus_per_node": max(gpus, 1),
            "price_per_gpu_hour": round(min(price for _, price in sizes), 6),
            "gpu_prices": _cheapest_per_size(sizes)}))
    return pools


def held_gpus(cloud: str, nodes: Sequence[Node]) -> dict[str, int]:
    """GPUs of ``cloud``'s live nodes per pool id: what the broker holds there."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.state is not NodeState.TERMINATED:
            pool = pool_id(cloud, n.region, n.market, n.accelerator)
            out[pool] = out.get(pool, 0) + n.gpus
    return out


def _cheapest_per_size(sizes: list[tuple[int, float]]) -> dict[int, float]:
    """GPUs per instance -> the cheapest per-GPU price of a type that size."""
    best: dict[int, float] = {}
    for n, price in sizes:
        best[n] = min(best.get(n, price), round(price, 6))
    return dict(sorted(best.items()))


class FleetProvider(Provider):
    """Routes every call to the backend of the pool's cloud (launch by ``request.cloud``, the
    rest by which backend owns the node), so the actuator and reconciler see one provider."""

    name = "fleet"

    def __init__(self, local: LocalProvider | None, clouds: dict[str, Provider],
                 configs: dict[str, CloudConfig], *, grace_period_s: float = 10.0,
                 pool_ttl_s: float = 30.0, reason: Callable[[object], str] = one_line) -> None:
        self.local = local
        self.reason = reason
        self.clouds = clouds
        self.configs = configs
        self.grace_period_s = grace_period_s
        self.pool_ttl_s = pool_ttl_s
        self._owner: dict[str, Provider] = {}  # node id -> backend, from launches and listings
        self._lock = threading.Lock()
        self._cloud_pools: tuple[float, dict[str, list[Pool]]] | None = None
        self._local_clouds = {r.cloud for r in local.fleet.regions} if local else set()
        self._down: dict[str, str] = {}  # backend (_named) -> why its last listing failed
        self._advisor: dict[tuple[str, str], float] | None = None  # Spot Advisor, read once
        self._priors: dict[str, float | None] = {}  # pool id -> prior monthly reclaim rate

    @property
    def backends(self) -> list[Provider]:
        return [backend for _, backend in self._named()]

    def _named(self) -> list[tuple[str, Provider]]:
        """Each backend under the name its outages are reported by: ``local``, else its
        cloud's (a cloud launched through SkyPilot is still that cloud)."""
        return ([("local", self.local)] if self.local else []) + list(self.clouds.items())

    def for_cloud(self, cloud: str) -> Provider:
        if self.local is not None and cloud in self._local_clouds:
            return self.local
        if cloud in self.clouds:
            return self.clouds[cloud]
        raise ProviderError(f"no provider serves cloud {cloud!r} (declared: "
                            f"{', '.join(sorted(self._local_clouds | set(self.clouds)))})")

    # ---- pools, offers, capacity ----------------------------------------------------------

    def pools(self) -> list[Pool]:
        """The local regions' pools (live: reclaims change them) and the clouds' pools
        (recomputed every ``pool_ttl_s``: prices and quotas move slowly)."""
        now = time.monotonic()
        if self._cloud_pools is None or now - self._cloud_pools[0] >= self.pool_ttl_s:
            last = self._cloud_pools[1] if self._cloud_pools else {}
            found: dict[str, list[Pool]] = {}
            for name, provider in self.clouds.items():
                try:
                    # Nodes before quotas: a launch in between then counts in the quota's use
                    # and not yet as held (a pool a bit small), never twice (one too large).
                    held = held_gpus(name, provider.nodes())
                    found[name] = cloud_pools(name, self.configs[name], provider.offers(),
                                              provider.quotas(), held)
                except Exception as exc:  # keep what it last offered; the others go on
                    log.warning("%s: cannot read offers/capacity (%s); keeping its last pools",
                                name, exc)
                    found[name] = last.get(name, [])
            self._cloud_pools = (now, found)
        cloud = [p for pools in self._cloud_pools[1].values() for p in pools]
        return (self.local.pools() if self.local else []) + cloud

    def ceiling(self) -> list[Pool]:
        """The pools the fleet file declares at their most: every local region unreclaimed,
        every cloud's (region, accelerator, market) at its ``max_gpus``, priced or not. A job
        that none of them can host never runs on this fleet (``broker.waiting.never_runs``)."""
        local = [r.pool(containers=self.local.containers) for r in self.local.fleet.regions] \
            if self.local else []
        return local + [
            Pool(cloud=name, region=region, accelerator=acc, market=market, nodes=1,
                 gpus_per_node=config.max_gpus)
            for name, config in self.configs.items() for region in config.regions
            for acc in config.accelerators for market in config.markets]

    def offers(self) -> list[Offer]:
        return [o for b in self.backends for o in b.offers()]

    def capacity(self) -> dict[str, int]:
        return {k: v for b in self.backends for k, v in b.capacity().items()}

    def interruption_priors(self, pools: Sequence[Pool]) -> dict[str, float]:
        """Each pool's prior monthly reclaim rate from the Spot Advisor (``catalog.pool_prior``
        over its backend's offers, those of at most ``max_gpus`` GPUs for a cloud), worked out
        once per pool: offers and the advisor's table do not change while this fleet runs.
        Pools the advisor has no figure for are left out (the round assumes the scheduler's
        ``unknown_reclaim_rate`` there)."""
        for pool in pools:
            if pool.id not in self._priors:
                if self._advisor is None:
                    self._advisor = interruption_priors()
                self._priors[pool.id] = pool_prior(pool, self._offers_of(pool.cloud),
                                                   self._advisor)
        return {p.id: rate for p in pools if (rate := self._priors[p.id]) is not None}

    def _offers_of(self, cloud: str) -> list[Offer]:
        try:
            offers = self.for_cloud(cloud).offers()
        except ProviderError:  # a pool of a cloud nobody serves: no data, the unknown rate
            return []
        cap = self.configs[cloud].max_gpus if cloud in self.configs else None
        return [o for o in offers if cap is None or o.accelerator_count <= cap]

    def reclaim(self, region: str, duration_s: float = 60.0) -> int:
        """Chaos: reclaim a local pretend spot region (real clouds reclaim on their own)."""
        if self.local is None:
            raise InvalidInput(f"cannot reclaim {region!r}: chaos reclaims act on local pretend "
                               "regions only, and this fleet has none")
        return self.local.reclaim(region, duration_s)

    def node_chaos(self, node_id: str, how: str) -> None:
        """Chaos: reclaim (notice, grace period) or kill one node of a local pretend region."""
        if self.local is None or node_id not in {n.node_id for n in self.local.nodes()}:
            raise InvalidInput(f"cannot {how} node {node_id!r}: chaos acts on nodes of local "
                               "pretend regions only")
        if how == "kill":
            self.local.lose(node_id)
        else:
            self.local.reclaim_node(node_id)

    # ---- nodes ------------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> list[Node]:
        if request.cloud is None:
            if len(self.backends) != 1:
                raise ProviderError(f"launch {request.idempotency_key}: the request names no "
                                    "cloud and the fleet has several providers")
            backend = self.backends[0]
        else:
            backend = self.for_cloud(request.cloud)
        nodes = self._call(backend, "launch", backend.launch, request)
        self._remember(backend, nodes)
        return nodes

    def nodes(self) -> list[Node]:
        """Every backend's nodes; a backend that fails is left out and named by
        ``unreachable()`` until a listing succeeds again."""
        out = []
        for name, backend in self._named():
            try:
                found = backend.nodes()
            except Exception as exc:  # one cloud's outage must not stop the others
                if name not in self._down:
                    log.warning("%s: cannot list nodes (%s); its jobs wait until it answers",
                                name, exc)
                self._down[name] = self.reason(exc)
                continue
            self._down.pop(name, None)
            self._remember(backend, found)
            out += found
        return out

    def bucket_region(self, uri: str) -> str | None:
        """The first cloud that stores the bucket behind ``uri`` names its region; a cloud
        whose lookup fails is passed over."""
        for backend in self.clouds.values():
            try:
                found = self._call(backend, "bucket lookup", backend.bucket_region, uri)
            except ProviderError as exc:
                log.info("%s", exc)
                continue
            if found is not None:
                return found
        return None

    def unreachable(self) -> frozenset[str]:
        down = set()
        for name, backend in self._named():
            if name in self._down:
                down |= self._local_clouds if backend is self.local else {name}
        return frozenset(down)

    def notices(self) -> list[PreemptionNotice]:
        out = []
        for backend in self.backends:
            try:
                out += backend.notices()
            except Exception as exc:  # the agents' reports still arrive through the API
                log.warning("%s: cannot read preemption notices (%s)", backend.name, exc)
        return out

    def terminate(self, node_id: str) -> None:
        backend = self._backend(node_id)
        if backend is not None:  # unknown everywhere: already gone
            self._call(backend, "terminate", backend.terminate, node_id)

    def resized(self, node_id: str, gpus: int) -> None:
        backend = self._backend(node_id)
        if backend is not None:
            backend.resized(node_id, gpus)

    def forget(self, node_id: str) -> None:
        backend = self._backend(node_id)
        if backend is not None:
            self._call(backend, "forget", backend.forget, node_id)

    def read_log(self, node_id: str, offset: int = 0) -> tuple[list[str], int]:
        backend = self._backend(node_id)
        return backend.read_log(node_id, offset) if backend else ([], offset)

    def outlives_agent(self, node: Node) -> bool:
        backend = self._backend(node.node_id)
        return backend is not None and backend.outlives_agent(node)

    def _call(self, backend: Provider, what: str, call: Callable[[Any], T], arg: Any) -> T:
        """``call(arg)`` with any failure as a ``ProviderError`` (an endpoint unreachable, an
        SDK's own exception type): the callers handle that one kind, so one cloud's trouble
        stays a failed launch or a node to retry, not a crash of the broker's pass."""
        try:
            return call(arg)
        except ProviderError:
            raise
        except Exception as exc:
            # a launch request is named by its key: its env holds the attempt token
            name = getattr(arg, "idempotency_key", arg)
            raise ProviderError(self.reason(f"{backend.name} {what} {name}: {exc}")) from exc

    def _remember(self, backend: Provider, nodes: list[Node]) -> None:
        with self._lock:
            self._owner.update({n.node_id: backend for n in nodes})

    def _backend(self, node_id: str) -> Provider | None:
        with self._lock:
            known = self._owner.get(node_id)
        if known is None:  # e.g. a restarted broker asked before its first listing
            self.nodes()
            with self._lock:
                known = self._owner.get(node_id)
        return known


def build_fleet_provider(path: Path, state_dir: Path, workdir: Path, *,
                         reason: Callable[[object], str] = one_line) -> tuple[
        FleetProvider, dict[str, str]]:
    """The fleet file's providers: ``(provider, skipped clouds -> why)``. Raises
    ``InvalidInput`` naming the file and field for a bad file."""
    fleet = FleetFile.load(path)
    local_fleet = fleet.local_fleet()
    local = LocalProvider(local_fleet, state_dir / "provider", workdir=workdir,
                          checkpoint_root=state_dir / "checkpoints") if local_fleet else None
    options = {name: {"regions": c.regions, **c.options} for name, c in fleet.clouds.items()}
    try:
        clouds, skipped = registry.build_providers(list(fleet.clouds), options, launchers={
            name: c.launcher for name, c in fleet.clouds.items() if c.launcher != "native"})
    except TypeError as exc:  # an option the provider does not take
        raise InvalidInput(f"{path}: clouds: options: {exc}") from None
    if fleet.clouds and not clouds and local is None:
        log.warning("no cloud of %s is configured and it has no local regions: the broker has "
                    "no capacity until one is", path)
    provider = FleetProvider(local, clouds, fleet.clouds, grace_period_s=fleet.grace_period_s,
                             reason=reason)
    return provider, skipped
