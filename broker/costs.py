"""What jobs cost: the on-demand reference price recorded with each placement, and the cost report
(per job and per team, summed across recoveries and regions, with the saving against on-demand).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from pydantic import BaseModel

from broker.models import JobRecord, Placement
from policies.models import Accelerator, Market, Pool


def ondemand_reference(pool: Pool, pools: Iterable[Pool]) -> float | None:
    """The price per GPU-hour the same GPUs would cost on on-demand, recorded at launch.

    An on-demand pool is its own reference. Else the cheapest on-demand pool of the same
    accelerator in this fleet (what the broker could have bought instead); else the catalog's
    on-demand price in the same region, then the same cloud, then any cloud; else None.
    """
    if pool.market is Market.ON_DEMAND:
        return pool.price_per_gpu_hour
    fleet = [p.price_per_gpu_hour for p in pools
             if p.market is Market.ON_DEMAND and p.accelerator is pool.accelerator]
    if fleet:
        return min(fleet)
    prices = _catalog_ondemand()
    for key in ((pool.accelerator, pool.cloud, pool.region), (pool.accelerator, pool.cloud, None),
                (pool.accelerator, None, None)):
        if key in prices:
            return prices[key]
    return None


@lru_cache(maxsize=1)
def _catalog_ondemand() -> dict[tuple[Accelerator, str | None, str | None], float]:
    """Cheapest on-demand $/GPU-h by (accelerator, cloud, region), (acc, cloud, -), (acc, -, -).
    Read once per process: a refreshed catalog (``fleet prices --refresh``) counts for
    placements opened after the broker restarts; recorded intervals keep their reference."""
    from providers.catalog import load_offers

    best: dict[tuple[Accelerator, str | None, str | None], float] = {}
    for offer in load_offers():
        price = offer.per_gpu(Market.ON_DEMAND)
        if price is None:
            continue
        for key in ((offer.accelerator, offer.cloud, offer.region),
                    (offer.accelerator, offer.cloud, None), (offer.accelerator, None, None)):
            best[key] = min(best.get(key, price), price)
    return best


class CostLine(BaseModel):
    """Cost of one job, or the sum over a team's jobs or the whole report."""

    gpu_hours: float = 0.0
    cost_usd: float = 0.0
    ondemand_cost_usd: float = 0.0
    intervals: int = 0

    @property
    def saving(self) -> float | None:
        """Fraction saved against on-demand (None when there is nothing to compare)."""
        if self.ondemand_cost_usd <= 0:
            return None
        return 1 - self.cost_usd / self.ondemand_cost_usd

    def add(self, other: CostLine) -> CostLine:
        return CostLine(gpu_hours=self.gpu_hours + other.gpu_hours,
                        cost_usd=self.cost_usd + other.cost_usd,
                        ondemand_cost_usd=self.ondemand_cost_usd + other.ondemand_cost_usd,
                        intervals=self.intervals + other.intervals)

    def view(self) -> dict[str, float | int | None]:
        return {**self.model_dump(), "saving": self.saving}


def interval_cost(p: Placement) -> tuple[float, float, float]:
    """One placement interval's GPU-hours, cost and on-demand cost (an open one: until now).

    An interval recorded without an on-demand reference counts at its own price (no saving).
    """
    reference = p.price_per_gpu_hour if p.ondemand_price_per_gpu_hour is None \
        else p.ondemand_price_per_gpu_hour
    gpu_hours = p.gpu_hours
    return gpu_hours, gpu_hours * p.price_per_gpu_hour, gpu_hours * reference


def job_cost(placements: Sequence[Placement]) -> CostLine:
    """Every placement interval of one job: each attempt, region and market, open ones until
    now (``interval_cost``)."""
    line = CostLine()
    for p in placements:
        gpu_hours, cost, ondemand = interval_cost(p)
        line = line.add(CostLine(gpu_hours=gpu_hours, cost_usd=cost, ondemand_cost_usd=ondemand,
                                 intervals=1))
    return line


def reference_price(p: Placement) -> float:
    """The on-demand $/GPU-h an interval is compared with: the one recorded at launch, else (a
    record from before it was kept) its own price, which shows no saving."""
    return p.price_per_gpu_hour if p.ondemand_price_per_gpu_hour is None \
        else p.ondemand_price_per_gpu_hour


def cost_report(jobs: Sequence[JobRecord], placements: Mapping[str, Sequence[Placement]],
                rows: int | None = None) -> dict[str, object]:
    """Per job (with the regions it ran in and its recoveries), per team, and in all.

    ``rows`` keeps only the newest that many per-job rows (``jobs`` are oldest first); the team
    sums and the total always count every job given, so a short listing never shrinks them.
    """
    lines, teams, total = [], {}, CostLine()
    for job in jobs:
        line = job_cost(placements.get(job.id, []))
        lines.append(line)
        teams[job.team] = teams.get(job.team, CostLine()).add(line)
        total = total.add(line)
    first = 0 if rows is None else max(0, len(jobs) - rows)
    return {"jobs": [_row(job, placements.get(job.id, []), line)
                     for job, line in zip(jobs[first:], lines[first:], strict=True)],
            "teams": [{"team": t, **teams[t].view()} for t in sorted(teams)],
            "total": total.view()}


def _row(job: JobRecord, ps: Sequence[Placement], line: CostLine) -> dict[str, object]:
    """One job's line of the report, with the regions it ran in and its recoveries."""
    regions = list(dict.fromkeys(f"{p.cloud}:{p.region}" for p in ps))
    return {"job": job.id, "team": job.team, "state": job.state.value, "regions": regions,
            "preemptions": job.preemptions, "migrations": job.migrations, **line.view()}
