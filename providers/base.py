"""The one interface every capacity backend implements: local, simulated, AWS, GCP, Azure, SkyPilot.

Modelled on SkyPilot's ``sky/clouds``: one class per backend behind one small surface.
Launches are idempotent by ``LaunchRequest.idempotency_key`` (job id + fence + attempt): a
second call with the same key returns the node the first one made, never a second node.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from broker.errors import ProviderFailure
from policies.models import Accelerator, Market, Offer


class ProviderError(ProviderFailure):
    """Base of the errors a provider maps its backend's failures to."""


class CapacityError(ProviderError):
    """The backend has no capacity for the request now (stock-out, spot unavailable).

    ``zone``: only that zone of the pool refused and others may still have room (an AWS spot
    launch tries one AZ per attempt); ``None``: the whole pool is out."""

    def __init__(self, message: str, *, zone: str | None = None) -> None:
        super().__init__(message)
        self.zone = zone


class QuotaError(ProviderError):
    """The request would exceed an account quota."""


class NotConfiguredError(ProviderError):
    """The backend has no credentials; the message names the cloud and how to configure it."""


class NodeState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PREEMPTING = "preempting"  # a notice was delivered; the node goes away after the grace period
    TERMINATED = "terminated"


class LaunchRequest(BaseModel):
    """Ask for ``nodes`` x ``gpus_per_node`` accelerators in one region and market for one job."""

    model_config = ConfigDict(frozen=True)

    idempotency_key: str = Field(min_length=1, max_length=128)
    job_id: str
    cloud: str | None = None  # the pool's cloud: a provider serving several routes by it
    region: str
    zone: str | None = None
    # Zones of the pool that just refused a launch (capacity): an unpinned spot launch picks
    # another, so an AZ fallback is a new attempt, never a second launch in one.
    avoid_zones: tuple[str, ...] = ()
    accelerator: Accelerator
    gpus_per_node: int = Field(ge=1)
    nodes: int = Field(default=1, ge=1)
    # The launch's nodes are ranks first_rank .. first_rank + nodes - 1 of the job (a lost
    # node's replacement is one node of its rank); each node's agent gets its own as
    # FLEET_NODE_RANK, and the node reports it as ``Node.rank``.
    first_rank: int = Field(default=0, ge=0)
    market: Market = Market.ON_DEMAND
    instance_type: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    # The names in env whose values are the job's secrets: a backend that keeps secrets apart
    # (SkyPilot's task ``secrets``, redacted in its logs and dashboard) puts them there. A
    # launch whose agent fetches them from the broker has none here (``Provider.keeps_secrets``).
    secret_names: frozenset[str] = frozenset()
    command: Sequence[str] = ()


class Node(BaseModel):
    """A node (VM or local process group) the provider owns, as its inventory reports it."""

    node_id: str
    provider: str
    region: str
    zone: str | None = None
    job_id: str | None = None
    idempotency_key: str | None = None
    accelerator: Accelerator
    gpus: int
    market: Market
    state: NodeState
    launched_at: datetime | None = None
    exit_code: int | None = None  # of the job's command, once TERMINATED (None: unknown/killed)
    ended_at: datetime | None = None
    # USD per GPU-hour where the launch landed (an AWS spot AZ's price), when the backend knows
    # it better than the pool's price; set on the nodes ``launch`` returns.
    price_per_gpu_hour: float | None = None
    rank: int | None = None  # its node rank in the job (``LaunchRequest.first_rank``); None: 0


class PreemptionNotice(BaseModel):
    """A backend's warning that a node will be reclaimed at ``deadline``."""

    node_id: str
    region: str
    deadline: datetime
    reason: str = "spot-reclaim"


@dataclass(frozen=True)
class Quota:
    """One account quota's headroom and the pools that draw on it: ``free`` units left (an AWS
    instance family's vCPUs, a GCP region's GPUs of one type) and, per pool id, the units one GPU
    there takes. Pools under one quota share it: the fleet must not promise it to each in full.
    ``per_instance``: per pool id, the units one instance of each size (GPUs) takes, where that
    is not the size times ``per_gpu`` (a vCPU quota: each size's instance type has its own
    vCPUs per GPU)."""

    free: float
    per_gpu: Mapping[str, float]
    per_instance: Mapping[str, Mapping[int, float]] = field(default_factory=dict)

    def units(self, pool: str, gpus: int) -> float:
        """What one instance of ``gpus`` GPUs in ``pool`` takes of this quota."""
        return self.per_instance.get(pool, {}).get(gpus, gpus * self.per_gpu[pool])


def share(quotas: Iterable[Quota], pools: Container[str] | None = None,
          sizes: Mapping[str, Sequence[int]] | None = None,
          caps: Mapping[str, int] | None = None) -> dict[str, int]:
    """Whole GPUs of free quota per pool, in whole instances: each quota's headroom is dealt out
    one instance per pool a round (of ``pools`` only, when given: the pools a fleet declares),
    the pool with the biggest instance first, each taking the largest of its instance sizes
    (GPUs per instance, ``sizes``; unknown: 1) that what is left still holds. Together they
    never exceed the quota, and an 8-GPU instance is not starved by the rounding of an even
    split. A pool is dealt no more than its ``caps`` GPUs (what the fleet lets it hold), so a
    capped pool leaves the rest to the others. A pool under several quotas (either may serve
    it) gets the sum."""
    out: dict[str, int] = {}
    for quota in quotas:
        mine = [p for p, units in quota.per_gpu.items()
                if units > 0 and (pools is None or p in pools)]
        for pool, gpus in _deal(quota, mine, sizes or {}, caps or {}).items():
            out[pool] = out.get(pool, 0) + gpus
    return out


def _deal(quota: Quota, pools: Sequence[str], sizes: Mapping[str, Sequence[int]],
          caps: Mapping[str, int]) -> dict[str, int]:
    """``quota``'s free units dealt to ``pools`` as whole instances, each charged what its
    size takes (``Quota.units``), round by round (see :func:`share`)."""
    free = quota.free
    counts = {p: sorted(sizes.get(p) or (1,), reverse=True) for p in pools}
    order = sorted(pools, key=lambda p: (-quota.units(p, counts[p][0]), p))
    got = dict.fromkeys(pools, 0)
    dealt = True
    while dealt:
        dealt = False
        for p in order:
            room = caps.get(p, math.inf) - got[p]
            n = next((n for n in counts[p] if quota.units(p, n) <= free and n <= room), 0)
            if n:
                free -= quota.units(p, n)
                got[p] += n
                dealt = True
    return got


def replacement_key(launch_key: str, rank: int, round_: int) -> str:
    """The idempotency key of the node that replaces rank ``rank`` of a multi-node launch in
    rendezvous round ``round_``: its own key (one replacement per round), under the launch's."""
    return f"{launch_key}~r{rank}.{round_}"


def launch_key_of(key: str | None) -> str | None:
    """The launch a node's idempotency key belongs to (a replacement's key names it)."""
    return None if key is None else key.split("~", 1)[0]


class Provider(abc.ABC):
    """One capacity backend. Implementations must be safe to call again after any failure."""

    name: str
    # Whether the backend's start script runs ``broker.runtime.agent`` around
    # ``LaunchRequest.command`` (cloud VMs); when False the caller wraps the command itself.
    starts_agent: bool = False
    # Whether a job's secret values may travel in ``LaunchRequest.env`` (named there by
    # ``secret_names``) although the backend's start script runs the agent: the backend keeps
    # them apart from what it stores in clear (SkyPilot's task ``secrets``). Where the backend
    # starts the agent and this is False (a cloud's user data, which the cloud keeps in clear),
    # the env names the secrets only and the agent fetches their values from the broker.
    keeps_secrets: bool = False
    # Whether one node of a multi-node launch can be lost, stopped and replaced alone; False
    # where a launch is one unit (a SkyPilot cluster goes down whole).
    separable_nodes: bool = True

    @abc.abstractmethod
    def offers(self) -> list[Offer]:
        """Purchasable instance types with on-demand and spot prices."""

    @abc.abstractmethod
    def capacity(self) -> dict[str, int]:
        """Free accelerators (or quota headroom) per pool id, as far as the backend knows."""

    def quotas(self) -> list[Quota]:
        """The quota headroom behind ``capacity()``, one entry per quota, so pools that share
        one (an AWS family's vCPUs cover its V100, A100 and H100 pools) can split it. The
        default: each pool its own quota of ``capacity()`` GPUs."""
        return [Quota(free, {pool: 1.0}) for pool, free in self.capacity().items()]

    @abc.abstractmethod
    def launch(self, request: LaunchRequest) -> list[Node]:
        """Start the nodes for ``request``; idempotent by ``request.idempotency_key``."""

    @abc.abstractmethod
    def terminate(self, node_id: str) -> None:
        """Stop a node; terminating an already gone node is not an error."""

    @abc.abstractmethod
    def nodes(self) -> list[Node]:
        """Every node this broker owns in the backend (found by tag or label)."""

    def resized(self, node_id: str, gpus: int) -> None:
        """The job on ``node_id`` runs ``gpus`` workers from now on, its processes kept (an
        in-place resize), so ``capacity()`` counts that many on the node. Backends that sell
        whole instances keep this default: the instance is billed and held as launched."""
        return None

    def notices(self) -> list[PreemptionNotice]:
        """Pending preemption notices; backends without notices return none."""
        return []

    def forget(self, node_id: str) -> None:
        """Drop a TERMINATED node from the inventory once the broker recorded its outcome;
        backends whose inventory forgets ended nodes by themselves keep this default."""
        return None

    def for_cloud(self, cloud: str) -> Provider:
        """The backend that serves ``cloud``'s pools (itself, for a single backend)."""
        return self

    def unreachable(self) -> frozenset[str]:
        """Clouds whose inventory the last ``nodes()`` could not read (their nodes are missing
        from it, not gone); a single backend raises instead and returns none."""
        return frozenset()

    def outlives_agent(self, node: Node) -> bool:
        """Whether ``node`` keeps running after its agent exited (a cloud VM does), so the
        broker must terminate it once the agent reported how the job ended."""
        return self.starts_agent

    def bucket_region(self, uri: str) -> str | None:
        """``cloud:region`` of the bucket behind a checkpoint ``uri`` this backend's cloud
        stores (``s3://`` for AWS), None when it holds no such bucket or cannot tell."""
        return None

    def read_log(self, node_id: str, offset: int = 0) -> tuple[list[str], int]:
        """Complete output lines of a node from byte ``offset``; backends without logs: none."""
        return [], offset
