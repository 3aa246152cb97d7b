"""Writes the held-out spot clusters of ``tests/bench/bench_spot_heldout.py`` into this folder.

The spot pools of a held-out cluster replay public traces (``providers/data/spot-traces/``,
SOURCE.md there) that the shipped clusters (``examples/clusters/spot-v100*.yaml``, the policy's
tuning side) do not use, re-sampled and scaled:

- Re-sampling: a trace is cut into 12 h blocks (``round(12 h / gap)`` samples; the last block
  keeps the remainder) and the blocks are put in a seeded random order
  (``random.Random(f"{cluster}/{collection}")``). One order per cluster and collection (the
  traces' folder, recorded together), shared by its pools, so zones recorded side by side keep
  their correlation. The order is a permutation: every sample is kept once, so a trace's
  availability over its whole length does not change; what a workload of a day sees does.
- Scaling: a value ``v`` of a collection that held ``capacity`` instances (1, 4 or 16, from the
  folder name) becomes ``round(v * nodes / capacity)`` (half up) nodes of the pool. The 16-node
  and 4-node traces are all-or-nothing most of the time (us-west-2a: 97% of its samples are 0 or
  16), so a 1-node 0/1 trace scaled to all of a pool's nodes or none is closer to the data than a
  sum of ``nodes`` independent re-sampled sequences, which would smooth the drops away.

``probe-16node-raw`` is the issue's own probe, not re-sampled: the three 16-node zones as recorded,
each a pool of 4 nodes holding ``min(4, v)`` (the simulator's reading). Its traces also feed the
tuning side (``spot-v100.yaml``, ``spot-v100-zones.yaml``), so it is reported apart from the
held-out clusters. ``aws-16node-west-scaled`` replays us-west-2a and us-west-2c, which
``spot-v100-zones.yaml`` replays as recorded (2-node pools holding ``min(2, v)``, and us-west-2c
for its Azure pool): held out as re-sampled and scaled, not as data never seen. The other three
clusters' traces are used nowhere else.

Deterministic. Run from the repository root: ``python -m examples.clusters.heldout.make_clusters``.
"""

from __future__ import annotations

import json
import random
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
TRACES = ROOT / "providers" / "data" / "spot-traces"
BLOCK_S = 12 * 3600
ONDEMAND_NODES = 4
HORIZON_S = 24 * 3600  # what one workload of the bench sees of a trace (header comments)


@dataclass(frozen=True)
class SpotPool:
    trace: str  # under providers/data/spot-traces/
    cloud: str
    region: str
    zone: str | None
    nodes: int

    @property
    def collection(self) -> str:
        return str(Path(self.trace).parent)

    @property
    def capacity(self) -> int:
        """Instances the collection held at most: the folder's ``N-node``."""
        m = re.search(r"(\d+)-node", self.trace)
        if m is None:
            raise ValueError(f"{self.trace}: no N-node folder")
        return int(m.group(1))


@dataclass(frozen=True)
class Cluster:
    name: str
    about: str
    spot: tuple[SpotPool, ...]
    ondemand: tuple[tuple[str, str], ...]  # (cloud, region), ONDEMAND_NODES nodes of 8 V100 each
    resample: bool = True


def _aws(trace: str, zone: str, nodes: int) -> SpotPool:
    return SpotPool(trace, "aws", zone[:-1], zone, nodes)


A23 = "availability/1-node/aws-02-15-2023"
A22 = "availability/1-node/aws-10-26-2022"
P23 = "preemption/1-node/aws-04-22-2023"
GCP = "preemption/1-node/gcp-04-30-2023"
N16 = "availability/16-node/aws-08-27-2023"

CLUSTERS = (
    Cluster("aws-1node-2023-zones",
            "six AWS zones of the 1-node availability traces of 2023-02-15, from the rarest "
            "(us-east-1a) to the most available (us-west-2b), 2 nodes each",
            tuple(_aws(f"{A23}/{z}_v100_1.json", z, 2)
                  for z in ("us-east-1a", "us-east-1c", "us-east-2a", "us-east-2b", "us-west-2b",
                            "us-west-2c")),
            (("aws", "us-east-1"), ("gcp", "us-central1"))),
    Cluster("aws-1node-2022-v100x8",
            "one spot region: two us-west-2 zones of the 2022-10-26 1-node traces of whole "
            "p3.16xlarge (8 V100) instances, 4 nodes each",
            tuple(_aws(f"{A22}/{z}_v100_8.json", z, 4) for z in ("us-west-2a", "us-west-2b")),
            (("aws", "us-west-2"), ("aws", "us-east-1"))),
    Cluster("gcp-aws-1node-zones",
            "two clouds: three GCP zones of the 2023-04-30 1-node traces (c3-highcpu-88, a CPU "
            "instance's availability standing in for V100s) and three AWS zones of the 2023-04-22 "
            "1-node preemption traces, 2 nodes each",
            (*(SpotPool(f"{GCP}/{z}_c3-88.json", "gcp", z[:-2], z, 2)
               for z in ("us-central1-a", "us-central1-b", "us-east1-b")),
             *(_aws(f"{P23}/{z}_v100_1.json", z, 2)
               for z in ("us-east-1c", "us-east-1f", "us-west-2b"))),
            (("gcp", "us-central1"), ("aws", "us-east-1"))),
    Cluster("aws-16node-west-scaled",
            "one spot region: the 16-node us-west-2a and us-west-2c traces, scaled to 4 nodes each",
            tuple(_aws(f"{N16}/{z}_v100_1.json", z, 4) for z in ("us-west-2a", "us-west-2c")),
            (("aws", "us-east-1"),)),
    Cluster("probe-16node-raw",
            "the issue's probe: three 16-node zones as recorded, 4 nodes each, and one "
            "on-demand pool",
            tuple(_aws(f"{N16}/{z}_v100_1.json", z, 4)
                  for z in ("us-east-2b", "us-west-2a", "us-west-2c")),
            (("aws", "us-east-1"),), resample=False),
)


def read_values(trace: str) -> tuple[float, list[int]]:
    """A vendored trace's gap (seconds) and samples."""
    doc = json.loads((TRACES / trace).read_text())
    return float(doc["metadata"]["gap_seconds"]), [int(v) for v in doc["data"]]


def block_order(n_blocks: int, seed: str) -> list[int]:
    order = list(range(n_blocks))
    random.Random(seed).shuffle(order)
    return order


def resample(values: Sequence[int], gap_s: float, order: Sequence[int]) -> list[int]:
    """``values`` cut into 12 h blocks, concatenated in ``order`` (a permutation of the blocks)."""
    size = round(BLOCK_S / gap_s)
    blocks = [values[i:i + size] for i in range(0, len(values), size)]
    if sorted(order) != list(range(len(blocks))):
        raise ValueError(f"order {list(order)} is not a permutation of {len(blocks)} blocks")
    return [v for b in order for v in blocks[b]]


def n_blocks(n_values: int, gap_s: float) -> int:
    return -(-n_values // round(BLOCK_S / gap_s))


def scale(values: Sequence[int], capacity: int, nodes: int) -> list[int]:
    """Each value of a ``capacity``-instance trace as nodes of a ``nodes``-node pool, half up."""
    return [(2 * v * nodes + capacity) // (2 * capacity) for v in values]


def availability(values: Sequence[int], capacity: int) -> float:
    """Mean fraction of the capacity available."""
    return sum(min(v, capacity) for v in values) / (capacity * len(values))


def pool_trace(cluster: Cluster, pool: SpotPool) -> tuple[float, list[int]]:
    """The pool's re-sampled, scaled trace (gap, values)."""
    gap, values = read_values(pool.trace)
    siblings = {len(read_values(p.trace)[1]) for p in cluster.spot
                if p.collection == pool.collection}
    if len(siblings) != 1:
        raise ValueError(f"{cluster.name}: the traces of {pool.collection} differ in length")
    order = block_order(n_blocks(len(values), gap), f"{cluster.name}/{pool.collection}")
    return gap, scale(resample(values, gap, order), pool.capacity, pool.nodes)


def _trace_name(cluster: Cluster, pool: SpotPool) -> str:
    return f"traces/{cluster.name}/{Path(pool.trace).name}"


def render(cluster: Cluster) -> dict[Path, str]:
    """Every file of the cluster (its YAML, its traces) by path, and their text."""
    files: dict[Path, str] = {}
    head = [f"# Held-out cluster {cluster.name} (written by make_clusters.py; do not edit):",
            *textwrap.wrap(f"{cluster.about}.", 98, initial_indent="# ",
                           subsequent_indent="# ")]
    lines = ["pools:"]
    for p in cluster.spot:
        gap, source = read_values(p.trace)
        src = availability(source, p.capacity)
        if cluster.resample:
            gap, values = pool_trace(cluster, p)
            name = _trace_name(cluster, p)
            meta = {"gap_seconds": gap, "source": p.trace, "block_seconds": BLOCK_S,
                    "block_order_seed": f"{cluster.name}/{p.collection}",
                    "scaled": f"round(v * {p.nodes} / {p.capacity})"}
            files[HERE / name] = json.dumps({"metadata": meta, "data": values}) + "\n"
            cap = p.nodes
        else:
            values, cap = source, min(p.nodes, p.capacity)
            name = f"../../../providers/data/spot-traces/{p.trace}"
        first = values[:round(HORIZON_S / gap)]
        head += [f"# {p.zone}: {p.trace}",
                 f"#   available {100 * src:.0f}% of {p.capacity}; as replayed "
                 f"{100 * availability(values, cap):.0f}% of {cap} overall, "
                 f"{100 * availability(first, cap):.0f}% in the first 24 h"]
        zone = f", zone: {p.zone}" if p.zone else ""
        lines.append(f"  - {{cloud: {p.cloud}, region: {p.region}{zone}, accelerator: V100, "
                     f"nodes: {p.nodes}, gpus_per_node: 8,\n     market: spot, trace: {name}}}")
    for cloud, region in cluster.ondemand:
        lines.append(f"  - {{cloud: {cloud}, region: {region}, accelerator: V100, "
                     f"nodes: {ONDEMAND_NODES}, gpus_per_node: 8, market: on-demand}}")
    files[HERE / f"{cluster.name}.yaml"] = "\n".join(head + lines) + "\n"
    return files


def main() -> None:
    for cluster in CLUSTERS:
        for path, text in render(cluster).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
