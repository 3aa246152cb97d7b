"""Cluster specs: ``t4:16x4``, ``t4:6x4,2080ti:3x8,a100:2x8`` or a YAML file of pools.

YAML form (every key of ``policies.models.Pool``; cloud/region default to ``sim``), plus an
optional ``trace:`` per pool, a spot availability file (path relative to the YAML file, format in
``broker/sim/traces.py``)::

    pools:
      - {accelerator: T4, nodes: 6, gpus_per_node: 4}
      - {accelerator: V100, nodes: 4, gpus_per_node: 8, cloud: aws, region: us-east-2,
         market: spot, trace: traces/us-east-2a_v100_1.json}

``price_per_gpu_hour`` left out means the catalog's price (``catalog_price``) in the spot
simulation, and 0 in the classic one (whose report has no costs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from broker.errors import InvalidInput
from broker.sim.traces import SpotTrace, TraceError, read_trace
from policies.apps import ACCELERATOR_TRACES
from policies.models import Accelerator, Market, Pool, UnknownAccelerator
from policies.type_assignment import TypeCapacity
from providers import registry
from providers.catalog import CatalogOffer, load_offers, pool_prior


class ClusterError(InvalidInput):
    """A cluster spec the simulator cannot use; the message says what to fix."""


_ITEM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*:\s*(\d+)\s*x\s*(\d+)\s*$")


@dataclass(frozen=True)
class PoolSpec:
    """A pool as the cluster file gave it: its spot trace, and whether it named a price."""

    pool: Pool
    trace: SpotTrace | None = None
    priced: bool = False
    where: str = ""


def parse_cluster(spec: str) -> list[Pool]:
    """Pools from a compact spec or a YAML file path."""
    return [s.pool for s in read_pool_specs(spec)]


def read_pool_specs(spec: str) -> list[PoolSpec]:
    """Like ``parse_cluster``, keeping each pool's trace and whether its price was given."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or path.is_file():
        return _from_yaml(path)
    pools = []
    for item in spec.split(","):
        m = _ITEM.match(item)
        if not m:
            raise ClusterError(
                f"cluster item {item.strip()!r} is not TYPE:NODESxGPUS (e.g. t4:16x4), "
                "nor a YAML file"
            )
        acc = _accelerator(m.group(1))
        pools.append(PoolSpec(_pool({"accelerator": acc, "nodes": int(m.group(2)),
                                     "gpus_per_node": int(m.group(3))}, item.strip()),
                              where=item.strip()))
    return pools


def _accelerator(name: str) -> Accelerator:
    try:
        return Accelerator.parse(name)
    except UnknownAccelerator as e:
        raise ClusterError(str(e)) from None


def _pool(fields: dict, where: str) -> Pool:
    fields = {"cloud": "sim", "region": "sim", **fields}
    try:
        return Pool.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ClusterError(f"{where}: field {loc!r}: {err['msg']}") from None


def _from_yaml(path: Path) -> list[PoolSpec]:
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"cluster file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"cluster file {path} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pools"), list) or not doc["pools"]:
        raise ClusterError(f"cluster file {path} needs a non-empty list under 'pools:'")
    pools = []
    for i, raw in enumerate(doc["pools"]):
        where = f"{path} pools[{i}]"
        if not isinstance(raw, dict):
            raise ClusterError(f"{where}: each pool is a mapping of fields")
        known = {*Pool.model_fields, "trace"} - {"gpu_prices"}  # the simulator places any count
        unknown = set(raw) - known
        if unknown:
            raise ClusterError(f"{where}: unknown field(s) {sorted(unknown)}; "
                               f"known: {sorted(known)}")
        fields = dict(raw)
        trace_name = fields.pop("trace", None)
        if "accelerator" in fields:
            fields["accelerator"] = _accelerator(str(fields["accelerator"]))
        pool = _pool(fields, where)
        where = f"{where} ({pool.id})"
        trace = None
        if trace_name is not None:
            try:
                trace = read_trace(path.parent / str(trace_name))
            except TraceError as e:
                raise ClusterError(f"{where}: field 'trace': {e}") from None
        pools.append(PoolSpec(pool, trace, "price_per_gpu_hour" in fields, where))
    return pools


@cache
def _offers(cloud: str) -> tuple[CatalogOffer, ...]:
    return tuple(load_offers([cloud]))


def catalog_price(pool: Pool, market: Market) -> float | None:
    """The catalog's USD per GPU-hour for the pool's (cloud, region, accelerator, GPUs per node)
    in ``market``: the cheapest matching instance type, in the pool's zone when the catalog
    names that zone, else the cheapest zone of the region (as SkyPilot's optimizer would pick);
    None when the catalog has no such offer (or does not know the cloud)."""
    if pool.cloud not in registry.priced():
        return None
    fits = [o for o in _offers(pool.cloud)
            if o.region == pool.region and o.accelerator is pool.accelerator
            and o.accelerator_count == pool.gpus_per_node and o.per_gpu(market) is not None]
    in_zone = [o for o in fits if pool.zone and o.zone == pool.zone]
    prices = [o.per_gpu(market) for o in in_zone or fits]
    return min(p for p in prices if p is not None) if prices else None


def catalog_prior(pool: Pool) -> float | None:
    """The Spot Advisor's monthly reclaim fraction for the pool's node type in its region
    (None where the advisor lists none: GCP, Azure, unknown types; the round then assumes
    ``SchedulerConfig.unknown_reclaim_rate``). The region's figure serves its zones: the
    advisor publishes no per-zone rates."""
    if pool.cloud not in registry.priced():
        return None
    nodes = [o for o in _offers(pool.cloud) if o.accelerator_count == pool.gpus_per_node]
    return pool_prior(pool.model_copy(update={"zone": None}), nodes)


def fleet_capacity(pools: list[Pool]) -> list[TypeCapacity]:
    """One capacity per accelerator type; node sizes must match the measurements."""
    by_type: dict[Accelerator, TypeCapacity] = {}
    for p in pools:
        if p.accelerator not in ACCELERATOR_TRACES:
            known = ", ".join(a.value for a in ACCELERATOR_TRACES)
            raise ClusterError(f"no throughput measurements for {p.accelerator.value}; "
                               f"the simulator knows: {known}")
        measured = ACCELERATOR_TRACES[p.accelerator][1]
        if p.gpus_per_node != measured:
            raise ClusterError(
                f"{p.accelerator.value} nodes were measured with {measured} GPUs per node, "
                f"got {p.gpus_per_node}; use {p.accelerator.value.lower()}:NODESx{measured}"
            )
        prev = by_type.get(p.accelerator)
        nodes = p.nodes + (prev.nodes if prev else 0)
        by_type[p.accelerator] = TypeCapacity(p.accelerator, nodes, p.gpus_per_node)
    caps = [c for c in by_type.values() if c.gpus > 0]
    if not caps:
        raise ClusterError("the cluster has no GPUs")
    return caps
