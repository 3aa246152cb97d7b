"""What a job would get if it were submitted now (``fleet launch --dryrun``): the pools its
spec may use, cheapest first, each with its price, its free GPUs and the job's estimated cost
per hour there. Pure: the API hands in the pools and the GPUs in use.

This is a preview, not the round: the allocator may give the job fewer GPUs than it asks for
when others wait, and placement weighs preemption risk and checkpoint moves besides price.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from broker.waiting import Needs
from policies.models import JobSpec, Pool


def placement_preview(spec: JobSpec, pools: Sequence[Pool], used: Mapping[str, int],
                      ) -> list[dict[str, Any]]:
    """One row per pool the spec may use (its ``Needs``, and room for its GPUs): pool id,
    market, GPUs (the spec's default, else its minimum) and the nodes they come on, USD per
    GPU-hour and per hour at that size, free GPUs, and whether it fits now; cheapest per hour
    first, those with room ahead of those without."""
    gpus = spec.gpus.default or spec.gpus.min
    needs = Needs.of(spec)
    rows = []
    for pool in pools:
        # A fixed node count (a SkyPilot num_nodes) is that many nodes with an equal share,
        # never the pool's own split: 2 GPUs on one node are not 2 nodes of 1.
        shape = (spec.nodes, gpus // spec.nodes) if spec.nodes else pool.shape(gpus)
        if shape is None or needs.unmet(pool) is not None or pool.capacity < gpus:
            continue
        nodes, per_node = shape
        price = pool.price_for(per_node)  # a gang of instances costs what one does per GPU
        free = max(0, pool.capacity - used.get(pool.id, 0))
        rows.append({"pool": pool.id, "market": pool.market.value,
                     "accelerator": pool.accelerator.value, "gpus": gpus, "nodes": nodes,
                     "gpus_per_node": per_node,
                     "price_per_gpu_hour": price, "cost_per_hour": round(price * gpus, 6),
                     "free_gpus": free, "fits_now": free >= gpus})
    rows.sort(key=lambda r: (not r["fits_now"], r["cost_per_hour"], r["pool"]))
    return rows
