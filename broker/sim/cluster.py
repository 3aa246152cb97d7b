"""Cluster specs: ``t4:16x4``, ``t4:6x4,2080ti:3x8,a100:2x8`` or a YAML file of pools.

YAML form (every key of ``policies.models.Pool``; cloud/region default to ``sim``)::

    pools:
      - {accelerator: T4, nodes: 6, gpus_per_node: 4}
      - {accelerator: A100, nodes: 2, gpus_per_node: 8, cloud: aws, region: us-east-1,
         market: spot, price_per_gpu_hour: 1.2}
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from policies.apps import ACCELERATOR_TRACES
from policies.choices import TypeCapacity
from policies.models import Accelerator, Pool


class ClusterError(ValueError):
    """A cluster spec the simulator cannot use; the message says what to fix."""


_ITEM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*:\s*(\d+)\s*x\s*(\d+)\s*$")


def parse_cluster(spec: str) -> list[Pool]:
    """Pools from a compact spec or a YAML file path."""
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
        pools.append(_pool({"accelerator": acc, "nodes": int(m.group(2)),
                            "gpus_per_node": int(m.group(3))}, item.strip()))
    return pools


def _accelerator(name: str) -> Accelerator:
    try:
        return Accelerator.parse(name)
    except ValueError as e:
        raise ClusterError(str(e)) from None


def _pool(fields: dict, where: str) -> Pool:
    fields = {"cloud": "sim", "region": "sim", **fields}
    try:
        return Pool.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ClusterError(f"{where}: field {loc!r}: {err['msg']}") from None


def _from_yaml(path: Path) -> list[Pool]:
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
        unknown = set(raw) - set(Pool.model_fields)
        if unknown:
            raise ClusterError(f"{where}: unknown field(s) {sorted(unknown)}; "
                               f"known: {sorted(Pool.model_fields)}")
        fields = dict(raw)
        if "accelerator" in fields:
            fields["accelerator"] = _accelerator(str(fields["accelerator"]))
        pools.append(_pool(fields, where))
    return pools


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
