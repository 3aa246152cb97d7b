"""``fleet gpus`` and ``fleet prices``: the cheapest GPU offers across clouds and regions."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from broker.cli.app import app, console, err_console, fail, print_json
from broker.errors import InvalidInput
from policies.models import Accelerator, Market, UnknownAccelerator
from providers import registry
from providers.catalog import CatalogOffer, cheapest, load_offers


def _accelerator(name: str | None, argument: str) -> Accelerator | None:
    """``name`` parsed; a bad one fails naming ``argument`` as the user gave it (flag or NAME)."""
    if name is None:
        return None
    try:
        return Accelerator.parse(name)
    except UnknownAccelerator as exc:
        fail(f"{argument}: {exc}")


def _clouds(cloud: str | None) -> list[str]:
    priced = registry.priced()
    if cloud is not None and cloud not in priced:
        fail(f"--cloud {cloud!r} is unknown; use one of: {', '.join(priced)}")
    return [cloud] if cloud else list(priced)


def _offers(accelerator: Accelerator | None, cloud: str | None) -> list[CatalogOffer]:
    clouds = _clouds(cloud)
    try:
        offers = load_offers(clouds)
    except InvalidInput as exc:  # a broken user catalog file: name it, no traceback
        fail(f"catalog: {exc}")
    return [o for o in offers if accelerator is None or o.accelerator is accelerator]


def _offer_json(o: CatalogOffer | None, market: Market) -> dict[str, Any] | None:
    if o is None:
        return None
    return {
        "cloud": o.cloud,
        "region": o.region,
        "zone": o.zone,
        "instance_type": o.instance_type,
        "accelerator_name": o.accelerator_name,
        "accelerator_count": o.accelerator_count,
        "price_per_hour": o.hourly(market),
        "price_per_gpu_hour": round(o.per_gpu(market) or 0.0, 5),
    }


def _where(o: CatalogOffer | None, market: Market) -> tuple[str, str]:
    if o is None:
        return "-", "-"
    place = f"{o.cloud} {o.zone or o.region} {o.instance_type} ({o.accelerator_count}x)"
    return place, f"${o.per_gpu(market):.3f}"


def cheapest_pairs(
    offers: list[CatalogOffer],
) -> list[tuple[Accelerator, CatalogOffer | None, CatalogOffer | None]]:
    """Per accelerator: the cheapest on-demand and spot offer by price per GPU-hour."""
    od, spot = cheapest(offers, Market.ON_DEMAND), cheapest(offers, Market.SPOT)
    return [(a, od.get(a), spot.get(a)) for a in sorted(set(od) | set(spot), key=lambda a: a.value)]


def _saving(o: CatalogOffer | None, s: CatalogOffer | None) -> float | None:
    if o is None or s is None:
        return None
    return round(100 * (1 - s.per_gpu(Market.SPOT) / o.per_gpu(Market.ON_DEMAND)), 1)


@app.command()
def prices(
    accelerator: str | None = typer.Option(None, "--accelerator", "-a", help="e.g. A100, T4, H100"),
    cloud: str | None = typer.Option(None, "--cloud", "-c", help="aws, gcp or azure"),
    spot: bool = typer.Option(False, "--spot", help="only the spot market"),
    refresh: bool = typer.Option(
        False, "--refresh", help="first fetch prices from the clouds' APIs into your catalog files"
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Cheapest on-demand and spot offer per accelerator, across clouds and regions (per GPU-h)."""
    if refresh:
        from providers.refresh import refresh_clouds

        report = refresh_clouds(_clouds(cloud))
        for name, outcome in report.outcome.items():
            err_console.print(f"refresh {name}: {outcome}", highlight=False)
    pairs = cheapest_pairs(_offers(_accelerator(accelerator, "--accelerator"), cloud))
    if spot:
        pairs = [(a, None, s) for a, _, s in pairs if s is not None]
    _print_prices(pairs, spot, as_json)
    if refresh and report.all_failed:  # the previous offers were listed, but nothing is new
        raise typer.Exit(1)


def _print_prices(
    pairs: list[tuple[Accelerator, CatalogOffer | None, CatalogOffer | None]],
    spot: bool,
    as_json: bool,
) -> None:
    if as_json:
        rows = []
        for acc, o, s in pairs:
            row: dict[str, Any] = {"accelerator": acc.value}
            if not spot:
                row["on_demand"] = _offer_json(o, Market.ON_DEMAND)
            row["spot"] = _offer_json(s, Market.SPOT)
            if not spot:
                row["spot_saving_pct"] = _saving(o, s)
            rows.append(row)
        print_json(rows)
        return
    table = Table(title="Cheapest offer per accelerator (USD per GPU-hour)")
    table.add_column("GPU")
    if not spot:
        table.add_column("on-demand at")
        table.add_column("$/GPU-h", justify="right")
    table.add_column("spot at")
    table.add_column("$/GPU-h", justify="right")
    if not spot:
        table.add_column("saving", justify="right")
    for acc, o, s in pairs:
        cells = [acc.value]
        if not spot:
            cells += _where(o, Market.ON_DEMAND)
        cells += _where(s, Market.SPOT)
        if not spot:
            saving = _saving(o, s)
            cells.append("-" if saving is None else f"{saving:.0f}%")
        table.add_row(*cells)
    console.print(table)


@app.command()
def gpus(
    name: str | None = typer.Argument(None, help="one accelerator: list its offers by region"),
    cloud: str | None = typer.Option(None, "--cloud", "-c", help="aws, gcp or azure"),
    limit: int = typer.Option(20, "--limit", min=1, help="rows to show for one accelerator"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Accelerators on offer (clouds, regions, cheapest prices), or one accelerator's offers."""
    acc = _accelerator(name, "NAME")
    offers = _offers(acc, cloud)
    if acc is None:
        _summary(offers, as_json)
        return
    if not offers:
        fail(f"no offers for {acc.value}" + (f" on {cloud}" if cloud else ""))

    def key(o: CatalogOffer) -> tuple[float, float]:
        s, d = o.per_gpu(Market.SPOT), o.per_gpu(Market.ON_DEMAND)
        return (float("inf") if s is None else s, float("inf") if d is None else d)

    best = sorted(offers, key=key)[:limit]
    if as_json:
        print_json([o.model_dump(mode="json") for o in best])
        return
    table = Table(
        title=f"{acc.value}: cheapest {len(best)} of {len(offers)} offers (by spot $/GPU-h)"
    )
    for col in ("cloud", "region", "zone", "instance", "GPUs", "on-demand $/h", "spot $/h"):
        table.add_column(col, justify="right" if "$" in col or col == "GPUs" else "left")
    for o in best:
        table.add_row(
            o.cloud, o.region, o.zone or "-", o.instance_type,
            f"{o.accelerator_count}x {o.accelerator_name}",
            "-" if o.price is None else f"{o.price:.3f}",
            "-" if o.spot_price is None else f"{o.spot_price:.3f}",
        )  # fmt: skip
    console.print(table)


def _summary(offers: list[CatalogOffer], as_json: bool) -> None:
    by_acc: dict[Accelerator, list[CatalogOffer]] = {}
    for o in offers:
        by_acc.setdefault(o.accelerator, []).append(o)
    od, sp = cheapest(offers, Market.ON_DEMAND), cheapest(offers, Market.SPOT)
    rows = [
        {
            "accelerator": acc.value,
            "clouds": sorted({o.cloud for o in group}),
            "regions": len({(o.cloud, o.region) for o in group}),
            "offers": len(group),
            "gpu_counts": sorted({o.accelerator_count for o in group}),
            "cheapest_on_demand_per_gpu_hour": od[acc].per_gpu(Market.ON_DEMAND)
            if acc in od
            else None,
            "cheapest_spot_per_gpu_hour": sp[acc].per_gpu(Market.SPOT) if acc in sp else None,
        }
        for acc, group in sorted(by_acc.items(), key=lambda kv: kv[0].value)
    ]
    if as_json:
        print_json(rows)
        return
    table = Table(title="Accelerators in the catalog")
    for col in ("GPU", "clouds", "regions", "GPUs/node", "on-demand $/GPU-h", "spot $/GPU-h"):
        table.add_column(col, justify="right" if "$" in col else "left")
    for r in rows:
        od_p, sp_p = r["cheapest_on_demand_per_gpu_hour"], r["cheapest_spot_per_gpu_hour"]
        table.add_row(
            r["accelerator"], ",".join(r["clouds"]), str(r["regions"]),
            ",".join(map(str, r["gpu_counts"])),
            "-" if od_p is None else f"{od_p:.3f}", "-" if sp_p is None else f"{sp_p:.3f}",
        )  # fmt: skip
    console.print(table)
