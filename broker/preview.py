"""What a job would get if it were submitted now (``fleet launch --dryrun``): the pools its
spec may use, cheapest first, each with its price, its free GPUs and the job's estimated cost
per hour there. Pure: the API hands in the pools and the GPUs in use.

This is a preview, not the round: the allocator may give the job fewer GPUs than it asks for
when others wait, and placement weighs preemption risk and checkpoint moves besides price.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.models import JobSpec, Market, Pool
from policies.placement import region_allowed
from policies.spot import must_not_preempt


def placement_preview(spec: JobSpec, pools: Sequence[Pool], used: Mapping[str, int],
                      ) -> list[dict[str, Any]]:
    """One row per pool the spec may use: pool id, market, GPUs (the spec's default, else its
    minimum) and the nodes they come on, USD per GPU-hour and per hour at that size, free GPUs,
    and whether it fits now;
    cheapest per hour first, those with room ahead of those without."""
    gpus = spec.gpus.default or spec.gpus.min
    rows = []
    for pool in pools:
        if pool.accelerator not in spec.accelerators or pool.capacity < gpus or not \
                region_allowed(pool, spec.regions.allow, spec.regions.deny) or \
                (must_not_preempt(spec.spot) and pool.market is Market.SPOT) or \
                not pool.launchable(gpus):
            continue
        price = pool.price_for(gpus)
        free = max(0, pool.capacity - used.get(pool.id, 0))
        nodes, per_node = pool.shape(gpus) or (1, gpus)
        rows.append({"pool": pool.id, "market": pool.market.value,
                     "accelerator": pool.accelerator.value, "gpus": gpus, "nodes": nodes,
                     "gpus_per_node": per_node,
                     "price_per_gpu_hour": price, "cost_per_hour": round(price * gpus, 6),
                     "free_gpus": free, "fits_now": free >= gpus})
    rows.sort(key=lambda r: (not r["fits_now"], r["cost_per_hour"], r["pool"]))
    return rows
