"""The GPU price catalog: offers in SkyPilot's ``vms.csv`` schema for AWS, GCP and Azure.

Built from the vendored snapshots under ``providers/data/`` (see their SOURCE.md); a refreshed or
user-edited ``vms.csv`` under the config dir (``<config>/catalogs/<cloud>/vms.csv``) replaces a
cloud's snapshot. Refreshes never overwrite a user's edits (see ``write_user_catalog``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from broker.errors import InvalidInput
from broker.protocol import BrokerEnv
from policies.models import Accelerator, Market, Offer, Pool, UnknownAccelerator, pool_id
from providers import registry
from providers.base import CapacityError, LaunchRequest, Quota
from providers.cloud import DATA

SPOT_ADVISOR_CSV = DATA / "aws-spot-advisor" / "accelerated_instances_linux.csv"

VMS_COLUMNS = (
    "InstanceType",
    "AcceleratorName",
    "AcceleratorCount",
    "vCPUs",
    "MemoryGiB",
    "GpuInfo",
    "Price",
    "SpotPrice",
    "Region",
    "AvailabilityZone",
)


class CatalogOffer(Offer):
    """An ``Offer`` plus the cloud's own accelerator name and SkyPilot's ``GpuInfo`` column."""

    accelerator_name: str
    gpu_info: str | None = None

    def per_gpu(self, market: Market) -> float | None:
        price = self.hourly(market)
        return None if price is None else price / self.accelerator_count


# --- config dir and the user's catalog files -------------------------------------------------


def config_dir() -> Path:
    """``$FLEET_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/fleetbroker`` (``~/.config/fleetbroker``)."""
    if env := os.environ.get(BrokerEnv.CONFIG_DIR):
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "fleetbroker"


def user_catalog_path(cloud: str, root: Path | None = None) -> Path:
    return (root or config_dir()) / "catalogs" / cloud / "vms.csv"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class WriteResult:
    """Where a refresh went; ``kept_user_file`` says the user's edited file was left alone."""

    path: Path
    kept_user_file: bool


def write_user_catalog(
    cloud: str, offers: Iterable[CatalogOffer], root: Path | None = None
) -> WriteResult:
    """Write a refreshed catalog, never clobbering a file the user edited.

    Every file we write gets a ``vms.csv.sha256`` stamp of its content. ``vms.csv`` is replaced only
    when it is absent or still matches our stamp; otherwise (the user changed it, or wrote it by
    hand) the refresh goes to ``vms.refreshed.csv`` next to it and the user's file stays as it is.
    """
    path = user_catalog_path(cloud, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = to_vms_csv(offers)
    stamp = path.with_name(path.name + ".sha256")
    if path.exists():
        current = _digest(path.read_text())
        ours = stamp.read_text().strip() if stamp.exists() else None
        if current != ours:
            target = path.with_name("vms.refreshed.csv")
            target.write_text(text)
            return WriteResult(target, kept_user_file=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    stamp.write_text(_digest(text) + "\n")
    return WriteResult(path, kept_user_file=False)


# --- vms.csv reading and writing ---------------------------------------------------------------


def _num(text: str | None) -> float | None:
    text = (text or "").strip()
    return float(text) if text else None


def to_vms_csv(offers: Iterable[CatalogOffer]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(VMS_COLUMNS)
    for o in offers:
        writer.writerow(
            [
                o.instance_type,
                o.accelerator_name,
                o.accelerator_count,
                "" if o.vcpus is None else o.vcpus,
                "" if o.memory_gib is None else o.memory_gib,
                o.gpu_info or "",
                "" if o.price is None else o.price,
                "" if o.spot_price is None else o.spot_price,
                o.region,
                o.zone or "",
            ]
        )
    return out.getvalue()


def read_vms_csv(text: str, cloud: str, source: str = "vms.csv") -> list[CatalogOffer]:
    """Parse a ``vms.csv``; rows with no GPU, a fractional GPU or an unknown GPU are skipped."""
    reader = csv.DictReader(io.StringIO(text))
    missing = {"InstanceType", "AcceleratorName", "AcceleratorCount", "Region"} - set(
        reader.fieldnames or ()
    )
    if missing:
        raise InvalidInput(
            f"{source}: missing column(s) {sorted(missing)}; expected {list(VMS_COLUMNS)}"
        )
    offers = []
    for line, row in enumerate(reader, start=2):
        offer = _row_offer(cloud, row, f"{source}:{line}")
        if offer is not None:
            offers.append(offer)
    return offers


def _row_offer(cloud: str, row: dict[str, str], where: str) -> CatalogOffer | None:
    name = (row.get("AcceleratorName") or "").strip()
    count = _num(row.get("AcceleratorCount"))
    if not name or count is None or count < 1 or count != int(count):
        return None
    try:
        accelerator = Accelerator.parse(name)
    except UnknownAccelerator:
        return None
    try:
        return CatalogOffer(
            cloud=cloud,
            region=row["Region"].strip(),
            zone=(row.get("AvailabilityZone") or "").strip() or None,
            instance_type=row["InstanceType"].strip(),
            accelerator=accelerator,
            accelerator_name=name,
            accelerator_count=int(count),
            vcpus=_num(row.get("vCPUs")),
            memory_gib=_num(row.get("MemoryGiB")),
            gpu_info=(row.get("GpuInfo") or "").strip() or None,
            price=_num(row.get("Price")),
            spot_price=_num(row.get("SpotPrice")),
        )
    except ValueError as exc:
        raise InvalidInput(f"{where}: bad row ({exc})") from exc


# --- the vendored snapshots --------------------------------------------------------------------


def sum_prices(a: str | None, b: str | None) -> float | None:
    x, y = _num(a), _num(b)
    return None if x is None or y is None else x + y


def rows_to_offers(rows: list[dict[str, str]], cloud: str) -> list[CatalogOffer]:
    """``vms.csv``-shaped dict rows to offers (through the one parser, so the rules are shared)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(VMS_COLUMNS), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return read_vms_csv(out.getvalue(), cloud, f"{cloud} rows")


def load_offers(clouds: Iterable[str] | None = None, root: Path | None = None
                ) -> list[CatalogOffer]:
    """The offers of ``clouds`` (default: every cloud with a price catalog): the user catalog
    file when there is one, else the vendored snapshot."""
    offers: list[CatalogOffer] = []
    for cloud in registry.priced() if clouds is None else clouds:
        home = registry.get(cloud)
        if not home.priced:
            raise InvalidInput(f"cloud {cloud!r} has no price catalog; use one of: "
                               f"{', '.join(registry.priced())}")
        user = user_catalog_path(cloud, root)
        if user.exists():
            offers.extend(read_vms_csv(user.read_text(), cloud, str(user)))
        else:
            offers.extend(home.snapshot() or [])
    return offers


def cheapest(
    offers: Iterable[CatalogOffer], market: Market, per: str = "gpu"
) -> dict[Accelerator, CatalogOffer]:
    """The cheapest offer per accelerator in ``market``, by price per GPU-hour (or per instance)."""
    best: dict[Accelerator, tuple[tuple, CatalogOffer]] = {}
    for o in offers:
        price = o.per_gpu(market) if per == "gpu" else o.hourly(market)
        if price is None:
            continue
        # Ties break on location so the answer is stable across runs.
        key = (price, o.cloud, o.region, o.zone or "", o.instance_type)
        if o.accelerator not in best or key < best[o.accelerator][0]:
            best[o.accelerator] = (key, o)
    return {acc: best[acc][1] for acc in sorted(best, key=lambda a: a.value)}


# --- interruption priors -----------------------------------------------------------------------

# Midpoints of the Spot Advisor buckets (<5%, 5-10%, 10-15%, 15-20%, >20% reclaimed per month).
BUCKET_RATE = (0.025, 0.075, 0.125, 0.175, 0.25)


def cheapest_type_for(offers: Iterable[Offer], request: LaunchRequest, cloud: str) -> str:
    """The cheapest instance type in the request's region with its accelerators and market."""
    if request.instance_type:
        return request.instance_type
    fits = [
        o
        for o in offers
        if o.region == request.region
        and o.accelerator is request.accelerator
        and o.accelerator_count == request.gpus_per_node
        and o.hourly(request.market) is not None
    ]
    if not fits:
        raise CapacityError(
            f"{cloud} {request.region}: no instance type with {request.gpus_per_node}x "
            f"{request.accelerator.value} on {request.market.value} in the catalog"
        )
    return _cheapest(fits, request.market).instance_type


def _cheapest(fits: Iterable[Offer], market: Market) -> Offer:
    """The offer a launch picks among ``fits`` (all priced on ``market``): the cheapest, ties
    broken by type name."""
    return min(fits, key=lambda o: (o.hourly(market), o.instance_type))


def vcpus_per_gpu(
    offers: Iterable[Offer], region: str, family: str = ""
) -> dict[Accelerator, float]:
    """Fewest vCPUs per accelerator among a region's types (``family`` prefix): turns a vCPU
    quota into GPUs."""
    best: dict[Accelerator, float] = {}
    for o in offers:
        if o.region == region and o.instance_type.startswith(family) and o.vcpus:
            ratio = o.vcpus / o.accelerator_count
            best[o.accelerator] = min(best.get(o.accelerator, ratio), ratio)
    return best


def vcpu_quota(cloud: str, offers: Iterable[Offer], region: str, market: Market, free: float,
               family: str = "") -> Quota | None:
    """A vCPU quota with ``free`` vCPUs left, shared by the pools of the region's accelerators
    (of ``family``) on ``market``: each pool's fewest vCPUs a GPU and each size's instance vCPUs
    (``vcpus_per_instance``). ``None`` where no type in the catalog has vCPUs."""
    offers = list(offers)

    def pool(acc: Accelerator) -> str:
        return pool_id(cloud, region, market, acc)

    per_gpu = {pool(acc): v for acc, v in vcpus_per_gpu(offers, region, family).items()}
    if not per_gpu:
        return None
    sizes = vcpus_per_instance(offers, region, market, family)
    return Quota(free, per_gpu, {pool(acc): vcpus for acc, vcpus in sizes.items()})


def vcpus_per_instance(
    offers: Iterable[Offer], region: str, market: Market, family: str = ""
) -> dict[Accelerator, dict[int, float]]:
    """vCPUs of the instance a launch of each size picks (GPUs per instance -> the vCPUs of the
    cheapest type that size on ``market``, as ``cheapest_type_for``), per accelerator in a
    region (``family`` prefix): what one instance takes of a vCPU quota. Per size, not the
    fewest per GPU: a small type often has more vCPUs a GPU (Azure NC24ads_A100_v4, 24 for its
    one A100; ND96asr_v4, 12 for each of 8)."""
    sizes: dict[tuple[Accelerator, int], list[Offer]] = {}
    for o in offers:
        if (o.region == region and o.instance_type.startswith(family)
                and o.hourly(market) is not None):
            sizes.setdefault((o.accelerator, o.accelerator_count), []).append(o)
    out: dict[Accelerator, dict[int, float]] = {}
    for (acc, gpus), fits in sizes.items():
        vcpus = _cheapest(fits, market).vcpus
        if vcpus:
            out.setdefault(acc, {})[gpus] = float(vcpus)
    return out


def instance_sizes(cloud: str, offers: Iterable[Offer]) -> dict[str, list[int]]:
    """GPUs per instance of the priced types behind each of ``cloud``'s pools (pool id ->
    counts): the instances a shared quota is dealt in (``providers.base.share``)."""
    sizes: dict[str, set[int]] = {}
    for o in offers:
        for market in Market:
            if o.hourly(market) is not None:
                pool = pool_id(cloud, o.region, market, o.accelerator)
                sizes.setdefault(pool, set()).add(o.accelerator_count)
    return {pool: sorted(counts) for pool, counts in sizes.items()}


def interruption_priors() -> dict[tuple[str, str], float]:
    """``(region, instance_type) -> monthly interruption fraction`` from the AWS Spot Advisor."""
    priors = {}
    with SPOT_ADVISOR_CSV.open() as fh:
        for row in csv.DictReader(fh):
            bucket = int(row["interruption_range_index"])
            priors[(row["region"], row["instance_type"])] = BUCKET_RATE[bucket]
    return priors


def interruption_prior(offer: Offer, priors: dict[tuple[str, str], float] | None = None,
                       ) -> float | None:
    """The advisor's monthly interruption fraction for the offer's type in its region; None
    where it lists none (GCP, Azure, unlisted types: the scheduler's
    ``unknown_reclaim_rate`` serves)."""
    table = interruption_priors() if priors is None else priors
    return table.get((offer.region, offer.instance_type))


def pool_prior(pool: Pool, offers: Iterable[Offer],
               priors: dict[tuple[str, str], float] | None = None) -> float | None:
    """A pool's monthly interruption fraction: the prior of the offer whose price it carries (the
    cheapest per GPU in its cloud, region, zone, accelerator and market), None when
    no offer matches or the advisor has no data for it."""
    fits = [
        (price / o.accelerator_count, o.instance_type, o)
        for o in offers
        if (o.cloud, o.region, o.accelerator) == (pool.cloud, pool.region, pool.accelerator)
        and (pool.zone is None or o.zone in (None, pool.zone))
        and (price := o.hourly(pool.market)) is not None
    ]
    if not fits:
        return None
    return interruption_prior(min(fits, key=lambda f: f[:2])[2], priors)
