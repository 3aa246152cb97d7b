"""Shared data types of every layer (pydantic v2): accelerators, markets, offers and pools.

Every package may import this module; it holds types only, no I/O.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Accelerator(StrEnum):
    """Accelerator types FleetBroker knows, named as the clouds' catalogs name them."""

    T4 = "T4"
    V100 = "V100"
    A100 = "A100"
    RTX6000 = "RTX6000"
    RTX2080TI = "2080Ti"
    L4 = "L4"
    A10G = "A10G"
    H100 = "H100"

    @classmethod
    def parse(cls, name: str) -> Accelerator:
        """Case- and punctuation-insensitive lookup: ``t4``, ``A100-80GB``, ``rtx_2080ti``."""
        key = _norm(name)
        for member in cls:
            if _norm(member.value) == key:
                return member
        for alias, member in _ALIASES.items():
            if key.startswith(alias):
                return member
        known = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown accelerator {name!r}; use one of: {known}")


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


_ALIASES: dict[str, Accelerator] = {
    "a10080gb": Accelerator.A100,
    "a10040gb": Accelerator.A100,
    "a100": Accelerator.A100,
    "v10032gb": Accelerator.V100,
    "v100": Accelerator.V100,
    "rtx2080ti": Accelerator.RTX2080TI,
    "geforcertx2080ti": Accelerator.RTX2080TI,
    "quadrortx6000": Accelerator.RTX6000,
    "teslat4": Accelerator.T4,
    "h10080gb": Accelerator.H100,
}


class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


class Offer(BaseModel):
    """One purchasable instance type in one zone (a row of SkyPilot's ``vms.csv`` schema)."""

    model_config = ConfigDict(frozen=True)

    cloud: str
    region: str
    zone: str | None = None
    instance_type: str
    accelerator: Accelerator
    accelerator_count: int = Field(ge=1)
    vcpus: float | None = None
    memory_gib: float | None = None
    price: float | None = Field(default=None, ge=0, description="on-demand USD per instance-hour")
    spot_price: float | None = Field(default=None, ge=0, description="spot USD per instance-hour")

    def hourly(self, market: Market) -> float | None:
        return self.spot_price if market is Market.SPOT else self.price


class Pool(BaseModel):
    """A place GPUs come from: one accelerator type in one (cloud, region, market)."""

    model_config = ConfigDict(frozen=True)

    cloud: str
    region: str
    zone: str | None = None
    accelerator: Accelerator
    market: Market = Market.ON_DEMAND
    nodes: int = Field(ge=0)
    gpus_per_node: int = Field(ge=1)
    price_per_gpu_hour: float = Field(default=0.0, ge=0)

    @field_validator("cloud", "region")
    @classmethod
    def _simple_name(cls, v: str) -> str:
        if not v or any(ch in v for ch in "/\\ \t\n\r\0"):
            raise ValueError(f"{v!r} must be a plain name without spaces or path separators")
        return v

    @property
    def id(self) -> str:
        zone = f"/{self.zone}" if self.zone else ""
        return f"{self.cloud}:{self.region}{zone}:{self.market.value}:{self.accelerator.value}"

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node
