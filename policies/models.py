"""Shared data types of every layer (pydantic v2): accelerators, markets, offers and pools.

Every package may import this module; it holds types only, no I/O.
"""

from __future__ import annotations

import difflib
import functools
import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class UnknownAccelerator(ValueError):
    """A name no accelerator type matches; the message gives the closest and the known names.
    A ``ValueError`` so that validators calling ``Accelerator.parse`` still give pydantic's
    ValidationError; ``broker.errors`` maps it to ``InvalidInput`` (this package imports no
    broker)."""


class SpecFieldError(ValueError):
    """A check across a spec's fields whose fix lies in one of them: ``field`` names it, so
    that the error reaches the user at that field, not at the spec as a whole."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    # Added for the clouds' catalogs (AWS, GCP, Azure GPU types beyond the measured ones).
    A10 = "A10"
    K80 = "K80"
    P4 = "P4"
    P100 = "P100"
    H200 = "H200"
    B200 = "B200"
    M60 = "M60"
    MI25 = "MI25"
    MI300X = "MI300X"
    # Not an accelerator: a CPU node. A pool of this type sells whole nodes (one unit each, see
    # ``Pool``), and a job of this type (``JobSpec.cpu_only``) takes exactly ``nodes`` of them.
    CPU = "CPU"

    @classmethod
    def parse(cls, name: str) -> Accelerator:
        """Case- and punctuation-insensitive lookup: ``t4``, ``A100-80GB``, ``rtx_2080ti``."""
        # Stored records name their types canonically; a round parses thousands of them.
        if (exact := cls._value2member_map_.get(name)) is not None:
            return exact  # type: ignore[return-value]
        key = _norm(name)
        # A name is a known one, or one with a variant suffix (A100-80GB-SXM4, H100-PCIe);
        # anything else (A100X) is refused rather than read as its prefix.
        for known, member in (*((_norm(m.value), m) for m in cls), *_ALIASES.items()):
            if key == known or (key.startswith(known)
                                and _VARIANT.fullmatch(key[len(known):])):
                return member
        names = [m.value for m in cls]
        close = difflib.get_close_matches(name.strip().upper(), [n.upper() for n in names], 1, 0.75)
        hint = f"did you mean {names[[n.upper() for n in names].index(close[0])]}? " \
            if close else ""
        raise UnknownAccelerator(f"unknown accelerator {name!r}; {hint}use one of: "
                                 f"{', '.join(names)}")


# What clouds append to an accelerator's name: memory size, form factor, interconnect.
_VARIANT = re.compile(r"(\d+gb)?(sxm\d?|pcie|nvl|mega)?")


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
    "h100mega": Accelerator.H100,
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


@functools.lru_cache(maxsize=65_536)
def pool_id(cloud: str, region: str, market: Market, accelerator: Accelerator,
            zone: str | None = None) -> str:
    """A pool's id, ``cloud:region[/zone]:market:accelerator`` (``Pool.id``), for code that
    knows a pool's coordinates but holds no ``Pool``."""
    where = f"{region}/{zone}" if zone else region
    return f"{cloud}:{where}:{market.value}:{accelerator.value}"


class Pool(BaseModel):
    """A place GPUs come from: one accelerator type in one (cloud, region, market). A CPU pool
    (``Accelerator.CPU``) counts nodes instead: ``gpus_per_node`` is 1, one unit per node,
    ``price_per_gpu_hour`` is per node-hour and ``gpu_prices`` ``{1: price}``, so a launch of
    n units is a gang of n whole nodes."""

    model_config = ConfigDict(frozen=True)

    cloud: str
    region: str
    zone: str | None = None
    accelerator: Accelerator
    market: Market = Market.ON_DEMAND
    nodes: int = Field(ge=0)
    gpus_per_node: int = Field(ge=1)
    price_per_gpu_hour: float = Field(default=0.0, ge=0)
    # A cloud pool's instance sizes: GPUs of one launch -> its USD per GPU-hour (sizes differ:
    # AWS V100 spot is $0.52/GPU-h on 1 GPU, $0.34 on 8). None: any count that fits, at
    # price_per_gpu_hour (the cheapest size's price where sizes are known).
    gpu_prices: dict[int, float] | None = None
    # Can its nodes run a job's container image (JobSpec.container_image)? Cloud nodes boot GPU
    # images with Docker and the NVIDIA container toolkit; a local fleet only where its machine
    # has a working Docker.
    containers: bool = True
    # What each node has besides GPUs, where known: a CPU pool states them (its nodes are what
    # a CPU job's ``cpus`` and ``memory`` are held against); None: unknown, no such ask fits.
    cpus_per_node: float | None = Field(default=None, gt=0)
    memory_gib_per_node: float | None = Field(default=None, gt=0)

    @field_validator("cloud", "region")
    @classmethod
    def _simple_name(cls, v: str) -> str:
        if not v or any(ch in v for ch in "/\\ \t\n\r\0"):
            raise ValueError(f"{v!r} must be a plain name without spaces or path separators")
        return v

    @property
    def id(self) -> str:
        return pool_id(self.cloud, self.region, self.market, self.accelerator, self.zone)

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_counts(self) -> tuple[int, ...] | None:
        """GPU counts one launch here can have (see :meth:`shape`) up to the pool's capacity;
        None: any count that fits."""
        if self.gpu_prices is None:
            return None
        big = max(self.gpu_prices)
        gangs = range(2 * big, self.capacity + 1, big)
        return tuple(sorted({*self.gpu_prices, *gangs}))

    def shape(self, gpus: int) -> tuple[int, int] | None:
        """(nodes, GPUs per node) of a launch of ``gpus`` GPUs here: one instance of a size the
        pool sells, or a gang of its largest instance (16 GPUs: two 8-GPU instances, in one
        region); None when no launch has that count. A pool with no sizes: one node."""
        if gpus < 1:
            return None
        if self.gpu_prices is None or gpus in self.gpu_prices:
            return 1, gpus
        big = max(self.gpu_prices)
        return (gpus // big, big) if gpus % big == 0 else None

    def launchable(self, gpus: int) -> bool:
        """Can one launch here have ``gpus`` GPUs (an instance type of that size, or a gang of
        the largest)?"""
        return self.shape(gpus) is not None

    def price_for(self, gpus: int) -> float:
        """USD per GPU-hour of a launch of ``gpus`` GPUs here (a gang: its instances' price)."""
        shape = self.shape(gpus)
        per_node = shape[1] if shape else gpus
        return (self.gpu_prices or {}).get(per_node, self.price_per_gpu_hour)


class SpotPolicy(StrEnum):
    NEVER = "never"
    ALLOWED = "allowed"
    PREFERRED = "preferred"


class BatchMode(StrEnum):
    FIXED = "fixed"  # global batch constant across resizes (gradient accumulation)
    ELASTIC = "elastic"  # the allocator picks the global batch inside [min, max]


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def check_name(value: str, field: str = "name") -> str:
    """A job/team name: 1-63 of ``a-z 0-9 - _ .``, starting with a letter or digit."""
    if not 1 <= len(value) <= 63 or not set(value) <= _NAME_CHARS or not value[0].isalnum():
        raise ValueError(
            f"{field} {value!r} is invalid: use 1-63 lowercase letters, digits, '-', '_' or '.', "
            "starting with a letter or digit"
        )
    return value


# A container image reference as docker reads it: [registry[:port]/]path[:tag][@sha256:digest],
# the path's parts lowercase. Nothing else (no spaces, quotes, `$`, `;`) can be one, so an image
# never carries shell syntax, even where a start script writes it into a command line.
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REF = re.compile(rf"(?:[A-Za-z0-9.-]+(?::[0-9]{{1,5}})?/)?{_IMAGE_PART}(?:/{_IMAGE_PART})*"
                       r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?",
                       re.ASCII)
MAX_IMAGE_CHARS = 512


def check_image(value: str) -> str:
    """A container image reference (``winglian/axolotl:main-py3.10``, ``nvcr.io/nvidia/pytorch:
    24.01-py3``, ``repo@sha256:...``); ValueError naming the shape otherwise."""
    if len(value) > MAX_IMAGE_CHARS or not IMAGE_REF.fullmatch(value):
        raise ValueError(f"{value[:80]!r} is not a container image reference: write "
                         "[registry/]name[:tag][@sha256:digest], like "
                         "winglian/axolotl:main-py3.10 (lowercase name, no spaces or quotes)")
    return value


class GpuRange(BaseModel):
    """GPU counts the job accepts; ``default`` is the size it asks for (a deadline's pace is
    judged at it; none: ``max``)."""

    model_config = ConfigDict(extra="forbid")

    min: int = Field(default=1, ge=1, le=4096)
    max: int = Field(default=1, ge=1, le=4096)
    default: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _ordered(self) -> GpuRange:
        if self.min > self.max:
            raise ValueError(f"gpus.min ({self.min}) must not exceed gpus.max ({self.max})")
        if self.default is not None and not self.min <= self.default <= self.max:
            raise ValueError(f"gpus.default ({self.default}) must lie in [{self.min}, {self.max}]")
        return self

    @property
    def requested(self) -> int:
        return self.max if self.default is None else self.default


class BatchRange(BaseModel):
    """Global batch sizes the job accepts; ``per_gpu_max`` is the largest batch one GPU holds."""

    model_config = ConfigDict(extra="forbid")

    min: int = Field(ge=1, le=1_000_000)
    max: int = Field(ge=1, le=1_000_000)
    default: int | None = Field(default=None, ge=1, le=1_000_000)
    per_gpu_max: int | None = Field(default=None, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _ordered(self) -> BatchRange:
        if self.min > self.max:
            raise ValueError(
                f"batch_size.min ({self.min}) must not exceed batch_size.max ({self.max})"
            )
        if self.default is not None and not self.min <= self.default <= self.max:
            raise ValueError(
                f"batch_size.default ({self.default}) must lie in [{self.min}, {self.max}]"
            )
        return self

    @property
    def initial(self) -> int:
        return self.default if self.default is not None else self.min


class Regions(BaseModel):
    """``cloud:region`` glob patterns (``aws:us-*``, ``gcp:*``, ``local:*``)."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=lambda: ["*"])
    deny: list[str] = Field(default_factory=list)


CLOUD_REGION = r"^[a-z][a-z0-9-]*:[a-z0-9-]+$"  # one 'cloud:region', no patterns


class CheckpointSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = None
    region: str | None = Field(
        default=None, pattern=CLOUD_REGION,
        description="'cloud:region' of the bucket behind uri: a move restores from there and "
        "every checkpoint written from another region crosses to it (the egress placement "
        "prices); none: the checkpoint sits in the region of the last pool")
    interval: str = Field(default="100s", pattern=r"^[1-9][0-9]*(s|steps)$",
                          description="'<n>s' seconds or '<n>steps' (the spec parser "
                          "writes other forms such as 5m in this one)")

    @property
    def every(self) -> tuple[int, bool]:
        """``(n, True)`` for every ``n`` steps, ``(seconds, False)`` for a time."""
        in_steps = self.interval.endswith("steps")
        return int(self.interval.removesuffix("steps" if in_steps else "s")), in_steps


class MountMode(StrEnum):
    """SkyPilot's file_mounts modes: copy once onto the node, or mount the bucket (FUSE)."""

    COPY = "COPY"
    MOUNT = "MOUNT"
    MOUNT_CACHED = "MOUNT_CACHED"


BLOB_PREFIX = "blob:sha256:"  # a local path packed at launch and kept in the broker's store
REMOTE_SCHEMES = ("s3://", "gs://", "az://", "https://")


# SkyPilot's ``store`` names and the bucket URL scheme of each.
STORE_SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}


class FileMount(BaseModel):
    """One file_mounts entry: ``source`` (a bucket path, an https URL, or a packed local path:
    ``blob:sha256:<hex>``; a local path before it is packed) put at ``path`` on every node.
    With ``name``, a bucket of that name on ``store`` (else on the placed job's cloud), made
    if absent and filled from the local ``source`` if one is given (SkyPilot's storage)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=1024)
    source: str | None = Field(default=None, min_length=1, max_length=2048)
    mode: MountMode = MountMode.COPY
    name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
    store: str | None = Field(default=None, pattern="^(" + "|".join(STORE_SCHEMES) + ")$")

    @model_validator(mode="after")
    def _source_or_name(self) -> FileMount:
        if self.source is None and self.name is None:
            raise ValueError("a file mount needs a source, or a bucket name")
        return self

    @property
    def local(self) -> bool:
        """A path on the launching machine, not yet packed and stored."""
        return self.source is not None and not self.source.startswith(
            (BLOB_PREFIX, *REMOTE_SCHEMES))


# SkyPilot's spelling of a per-node size: ``4`` exactly 4, ``4+`` at least 4.
NODE_SIZE = r"^[0-9]+(\.[0-9]+)?\+?$"


def size_fits(asked: str | None, have: float | None) -> bool:
    """Does a node with ``have`` (vCPUs or GiB; None: unknown) meet ``asked`` (``NODE_SIZE``;
    None: no ask)? As SkyPilot reads it: ``N+`` at least N, ``N`` exactly N."""
    if asked is None:
        return True
    if have is None:
        return False
    at_least = asked.endswith("+")
    want = float(asked.removesuffix("+"))
    return have >= want if at_least else have == want


class JobSpec(BaseModel):
    """What a user submits: the project's own job YAML (SkyPilot task YAML is translated to it)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    run: str = Field(min_length=1, max_length=65_536)
    setup: str | None = None
    envs: dict[str, str] = Field(default_factory=dict)
    accelerators: list[Accelerator] = Field(default_factory=lambda: [Accelerator.T4], min_length=1)
    gpus: GpuRange = Field(default_factory=GpuRange)
    batch_size: BatchRange
    batch_mode: BatchMode = BatchMode.ELASTIC
    work_samples: int = Field(ge=1, le=10**15, description="samples to process until done")
    spot: SpotPolicy = SpotPolicy.ALLOWED
    regions: Regions = Field(default_factory=Regions)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    priority: int = Field(default=0, ge=-100, le=100)
    team: str = "default"
    deadline_s: float | None = Field(default=None, gt=0, description="seconds after submission")
    model: str | None = Field(default=None, description="throughput-table model name, if known")
    # A SkyPilot task's meaning: exactly ``nodes`` nodes (its num_nodes), each with an equal share
    # of the GPUs, and setup and run once per node (not once per GPU) with SkyPilot's SKYPILOT_*
    # environment. None: the pool's instance sizes decide the nodes, and run starts per GPU.
    nodes: int | None = Field(default=None, ge=1, le=512,
                              description="run as exactly this many nodes (SkyPilot num_nodes)")
    run_per_node: bool = Field(default=False, description="setup and run execute once per node "
                               "(SkyPilot semantics), not once per GPU worker")
    workdir: str | None = Field(default=None, max_length=4096, description="SkyPilot's "
                                "workdir: setup and run start in it on every node; a local path "
                                "until launch packs it (then blob:sha256:<hex>)")
    file_mounts: list[FileMount] = Field(default_factory=list, max_length=64)
    secret_envs: list[str] = Field(default_factory=list, max_length=256,
                               description="names of secret environment variables: their values "
                               "travel beside the spec, encrypted at rest, never shown")
    # SkyPilot's ``image_id: docker:<image>``: every node's setup and run execute in this image
    # (broker.runtime.container); only pools whose nodes can run containers take the job.
    container_image: str | None = Field(default=None, description="a docker image reference: "
                                        "setup and run execute in it on every node")
    # A CPU job's size of each node (SkyPilot's resources.cpus / memory), held against the CPU
    # pool's cpus_per_node / memory_gib_per_node. GPU jobs are sized by their accelerator.
    cpus: str | None = Field(default=None, pattern=NODE_SIZE, description="vCPUs per node of "
                             "a CPU job: '4' exactly, '4+' at least")
    memory: str | None = Field(default=None, pattern=NODE_SIZE, description="GiB of memory "
                               "per node of a CPU job: '16' exactly, '16+' at least")

    @property
    def cpu_only(self) -> bool:
        """A job for CPU nodes (``accelerators: [CPU]``): it never gets a GPU."""
        return Accelerator.CPU in self.accelerators

    @model_validator(mode="after")
    def _cpu_job(self) -> JobSpec:
        """A CPU job takes whole CPU nodes, rigidly: the allocator counts one unit per node, so
        ``gpus`` is exactly ``nodes``; CPU and GPU types never mix (a GPU job never lands on
        a CPU node, nor a CPU job on a GPU)."""
        if not self.cpu_only:
            if self.cpus is not None or self.memory is not None:
                raise SpecFieldError("cpus" if self.cpus is not None else "memory",
                                     "cpus and memory size the nodes of a CPU job only "
                                     "(accelerators: [CPU]); a GPU job is sized by its "
                                     "accelerator")
            return self
        if self.accelerators != [Accelerator.CPU]:
            raise SpecFieldError("accelerators", "CPU cannot be listed with GPU types; a job runs "
                                 "on CPU nodes or on GPUs")
        if self.nodes is None or not self.gpus.min == self.gpus.max == self.nodes:
            raise SpecFieldError("gpus" if self.nodes else "nodes",
                                 "a CPU job (accelerators: [CPU]) takes whole nodes: give nodes: N "
                                 "and leave gpus out (or give the same N: one unit per CPU "
                                 "node)")
        return self

    @model_validator(mode="after")
    def _gpus_split_over_nodes(self) -> JobSpec:
        if self.nodes is not None and (self.gpus.min % self.nodes or self.gpus.max % self.nodes):
            raise SpecFieldError("gpus", f"gpus ({self.gpus.min}..{self.gpus.max}) must split "
                                 f"evenly over nodes ({self.nodes}); give a multiple of nodes")
        if self.container_image is not None and not self.run_per_node:
            raise SpecFieldError("run_per_node", "container_image runs setup and run once per "
                                 "node inside the image; set run_per_node: true (as a SkyPilot "
                                 "task has it)")
        clash = set(self.secret_envs) & set(self.envs)
        if clash:
            raise SpecFieldError("secret_envs", f"{sorted(clash)[0]} is both in envs and "
                                 "secret_envs; keep it in one")
        return self

    @field_validator("container_image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else check_image(v)

    @field_validator("name", "team")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info.field_name or "name")

    @field_validator("accelerators", mode="before")
    @classmethod
    def _accelerators(cls, v: object) -> object:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [Accelerator.parse(a) if isinstance(a, str) else a for a in v]
        return v
