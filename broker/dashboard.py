"""The web dashboard: static pages under ``/ui`` and the few JSON series they need beyond the API.

The pages (``broker/ui``: HTML, one script, Chart.js vendored) hold no data; they keep the token
the user types in ``sessionStorage`` and call the API with it as a bearer token, so the API's
own auth decides what each user sees, and a token never travels in a URL. The routes here add
what the API does not already answer: cost over time (spot, on-demand, and what all-on-demand
would have cost), preemptions and migrations per region over time, and the catalog's prices.
"""

# No `from __future__ import annotations`: FastAPI resolves the local Annotated aliases.

import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

from broker.auth import Principal
from broker.costs import reference_price
from broker.models import Event, JobRecord, JobState, Placement
from broker.store import Store
from policies.models import Market
from providers import registry
from providers.catalog import CatalogOffer, cheapest, load_offers, user_catalog_path

UI_DIR = Path(__file__).with_name("ui")
TEAM = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
MAX_BUCKETS = 1000
EVENTS_LISTED = 500  # the newest preemptions and migrations listed one by one (all are counted)
# The pages load only their own files and talk only to this origin: an injected script or a
# framing page gets nowhere.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _edges(start: float, end: float, buckets: int) -> list[float]:
    """``buckets`` equal intervals from ``start`` to ``end``: their ``buckets + 1`` edges."""
    step = (end - start) / buckets
    return [start + i * step for i in range(buckets + 1)]


def cost_series(placements: Sequence[Placement], *, now: float, buckets: int = 60,
                ) -> dict[str, Any]:
    """Cumulative USD over time: spent on spot, spent on on-demand, and what the same GPU-hours
    would have cost all on on-demand (each interval's recorded reference, as ``job_cost``), from
    the first placement to the last interval's end (``now`` while one is open)."""
    if not placements:
        return {"t": [], "spot_usd": [], "ondemand_usd": [], "all_ondemand_usd": [],
                "saving_usd": [], "buckets": 0}
    start = min(p.start for p in placements)
    end = max(now if p.end is None else p.end for p in placements)
    edges = np.array(_edges(start, max(end, start + 1.0), buckets))
    begin = np.array([p.start for p in placements])
    stop = np.array([now if p.end is None else p.end for p in placements])
    # seconds of each interval (rows) inside each bucket (columns)
    inside = np.clip(np.minimum(edges[None, 1:], stop[:, None])
                     - np.maximum(edges[None, :-1], begin[:, None]), 0.0, None)
    gpu_s = np.array([p.gpus / 3600.0 for p in placements])  # GPU-hours per second held
    price = np.array([p.price_per_gpu_hour for p in placements])
    spot = np.array([p.market is Market.SPOT for p in placements])
    reference = np.array([reference_price(p) for p in placements])
    spot_c = np.cumsum((gpu_s * price * spot) @ inside)
    od_c = np.cumsum((gpu_s * price * ~spot) @ inside)
    ref_c = np.cumsum((gpu_s * reference) @ inside)
    return {"t": edges[1:].tolist(), "spot_usd": spot_c.tolist(), "ondemand_usd": od_c.tolist(),
            "all_ondemand_usd": ref_c.tolist(), "saving_usd": (ref_c - spot_c - od_c).tolist(),
            "buckets": buckets}


def is_preemption(event: Event) -> bool:
    """Did ``event`` count a preemption of its job (a reclaim seen before or after the nodes
    went, or nodes lost to one)?"""
    return event.data.get("preempted") is True or event.type == "preempted"


def _region_at(placements: Sequence[Placement], ts: float) -> str:
    """The cloud:region a job held GPUs in at ``ts`` (the interval open then, else the last one
    that started before)."""
    before = [p for p in placements if p.start <= ts]
    holding = [p for p in before if p.end is None or p.end >= ts]
    chosen = (holding or before or [None])[-1]
    return "unknown" if chosen is None else f"{chosen.cloud}:{chosen.region}"


def recovery_timeline(placements: Mapping[str, Sequence[Placement]],
                      preempted: Mapping[str, Sequence[Event]], *, now: float,
                      buckets: int = 60) -> dict[str, Any]:
    """Preemptions (each job's events that counted one, in the region it held then) and migrations
    (a relaunch in another pool than the job's previous interval, counted in the region it
    left, as ``JobRecord.migrations`` counts them) per region: totals, counts per bucket, and
    the newest ``EVENTS_LISTED`` one by one."""
    found: list[dict[str, Any]] = []
    for job_id, events in preempted.items():
        ps = sorted(placements.get(job_id, []), key=lambda p: p.start)
        found += [{"ts": e.ts, "kind": "preemption", "job": job_id,
                   "region": _region_at(ps, e.ts)} for e in events]
    for job_id, ps in placements.items():
        ordered = sorted(ps, key=lambda p: (p.attempt, p.start))
        for prev, nxt in pairwise(ordered):
            if nxt.pool != prev.pool:
                found.append({"ts": nxt.start, "kind": "migration", "job": job_id,
                              "region": f"{prev.cloud}:{prev.region}",
                              "to": f"{nxt.cloud}:{nxt.region}"})
    found.sort(key=lambda e: (e["ts"], e["job"]))
    regions = sorted({e["region"] for e in found})
    totals = {r: {"preemptions": 0, "migrations": 0} for r in regions}
    for e in found:
        totals[e["region"]][e["kind"] + "s"] += 1
    if not found:
        return {"t": [], "regions": [], "series": {}, "totals": {}, "events": [],
                "events_total": 0}
    start = min(e["ts"] for e in found)
    end = max(now, start + 1.0)
    edges = _edges(start, end, buckets)
    step = edges[1] - edges[0]
    series = {r: {"preemptions": [0] * buckets, "migrations": [0] * buckets} for r in regions}
    for e in found:
        i = min(buckets - 1, int((e["ts"] - start) / step))
        series[e["region"]][e["kind"] + "s"][i] += 1
    return {"t": edges[1:], "regions": regions, "series": series, "totals": totals,
            "events": found[-EVENTS_LISTED:], "events_total": len(found)}


def _catalog_stamp() -> tuple[int | None, ...]:
    """The user catalog files' modification times: a refresh changes the stamp."""
    stamps = []
    for cloud in registry.priced():
        try:
            stamps.append(user_catalog_path(cloud).stat().st_mtime_ns)
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def _offer_view(o: CatalogOffer | None, market: Market) -> dict[str, Any] | None:
    if o is None:
        return None
    return {"cloud": o.cloud, "region": o.region, "zone": o.zone,
            "instance_type": o.instance_type, "accelerator_count": o.accelerator_count,
            "price_per_gpu_hour": o.per_gpu(market)}


@lru_cache(maxsize=2)
def _catalog_prices(stamp: tuple[int | None, ...]) -> list[dict[str, Any]]:
    offers = load_offers()
    od, spot = cheapest(offers, Market.ON_DEMAND), cheapest(offers, Market.SPOT)
    rows = []
    for acc in sorted(set(od) | set(spot), key=lambda a: a.value):
        o, s = od.get(acc), spot.get(acc)
        saving = None if o is None or s is None else \
            1 - (s.per_gpu(Market.SPOT) or 0) / (o.per_gpu(Market.ON_DEMAND) or math.inf)
        rows.append({"accelerator": acc.value, "on_demand": _offer_view(o, Market.ON_DEMAND),
                     "spot": _offer_view(s, Market.SPOT), "spot_saving": saving})
    return rows


def catalog_prices() -> list[dict[str, Any]]:
    """Per accelerator: the catalog's cheapest on-demand and spot offer per GPU-hour (the user's
    refreshed catalog files where present, else the vendored snapshot), and spot's saving."""
    return _catalog_prices(_catalog_stamp())


def router(store: Store, user: Callable[..., Any],
           visible_team: Callable[[Principal, str | None], str | None],
           visible_jobs: Callable[[Principal, str | None, list[JobState] | None],
                                  list[JobRecord]],
           responses: dict[int | str, dict[str, Any]]) -> APIRouter:
    """The dashboard's JSON routes, behind the API's ``user`` dependency and its job visibility
    (``visible_team``: the team a listing covers, None for all; ``visible_jobs``: its jobs)."""
    api = APIRouter(tags=["dashboard"], responses=responses)
    User = Annotated[Principal, Depends(user)]
    Team = Annotated[str | None, Query(pattern=TEAM)]
    Buckets = Annotated[int, Query(ge=1, le=MAX_BUCKETS, description="time buckets")]

    @api.get("/v1/costs/series", summary="Cumulative cost over time: spot, on-demand, and the "
             "all-on-demand reference (the saving is the gap)")
    def costs_series(who: User, team: Team = None, buckets: Buckets = 60) -> dict[str, Any]:
        # the ids are enough here: no job record is read
        by_job = store.placements_of(store.list_ids(team=visible_team(who, team)))
        return cost_series([p for ps in by_job.values() for p in ps], now=time.time(),
                           buckets=buckets)

    @api.get("/v1/recoveries", summary="Preemptions and migrations per region over time")
    def recoveries(who: User, team: Team = None, buckets: Buckets = 60) -> dict[str, Any]:
        jobs = visible_jobs(who, team, None)
        by_job = store.placements_of([j.id for j in jobs])
        preempted = {j.id: [e for e in store.events(job_id=j.id, limit=10_000)
                            if is_preemption(e)] for j in jobs if j.preemptions}
        return recovery_timeline(by_job, preempted, now=time.time(), buckets=buckets)

    @api.get("/v1/prices", summary="The catalog's cheapest on-demand and spot price per "
             "accelerator (USD per GPU-hour)")
    def prices(who: User) -> dict[str, Any]:
        return {"accelerators": catalog_prices()}

    return api


class _UiFiles(StaticFiles):
    """The dashboard's files, each with the headers that keep its pages to themselves."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(UI_HEADERS)
        return response


def mount_ui(app: FastAPI) -> None:
    """Serve the dashboard at ``/ui/`` (``/`` and ``/ui`` lead there)."""

    @app.get("/ui", include_in_schema=False)
    @app.get("/", include_in_schema=False)
    def to_ui() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", _UiFiles(directory=UI_DIR, html=True), name="ui")
