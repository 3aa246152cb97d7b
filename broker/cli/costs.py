"""``fleet cost-report``: what each job and team spent across recoveries and regions, and the
saving against running the same GPU-hours on on-demand."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from broker.cli.app import app, print_json
from broker.cli.jobs import JsonOpt, TokenOpt, UrlOpt, _print_table
from broker.client import BrokerClient


def _saving(line: dict[str, Any]) -> str:
    return "-" if line["saving"] is None else f"{line['saving']:.0%}"


def _money(x: float) -> str:
    return f"{x:,.4f}" if x < 10 else f"{x:,.2f}"


@app.command("cost-report")
def cost_report(
    team: str | None = typer.Option(None, "--team", help="Only this team (admin; a team token "
                                    "sees its own)"),
    state: list[str] | None = typer.Option(None, "--state", help="Only jobs in this state"),
    limit: int = typer.Option(1000, "--limit", min=1, help="Rows for the newest this many "
                             "jobs; the team sums and the total count every job"),
    as_json: bool = JsonOpt, url: str | None = UrlOpt, token: str | None = TokenOpt,
) -> None:
    """Cost per job and per team, summed over every placement interval, vs all on-demand."""
    with BrokerClient(url, token) as client:
        out = client.costs(team=team, states=state, limit=limit)
    if as_json:
        print_json(out)
        return
    if not out["jobs"]:
        _print_table("no jobs")
        return
    jobs = Table("JOB", "TEAM", "STATE", "REGIONS", "MOVES", "GPU-H", "COST $", "ON-DEMAND $",
                 "SAVED", box=None, header_style="bold", title="per job", title_justify="left")
    for j in out["jobs"]:
        jobs.add_row(j["job"], j["team"], j["state"], ", ".join(j["regions"]) or "-",
                     str(j["migrations"]), f"{j['gpu_hours']:.3f}", _money(j["cost_usd"]),
                     _money(j["ondemand_cost_usd"]), _saving(j))
    teams = Table("TEAM", "GPU-H", "COST $", "ON-DEMAND $", "SAVED", box=None,
                  header_style="bold", title="per team", title_justify="left")
    for t in [*out["teams"], {"team": "total", **out["total"]}]:
        teams.add_row(t["team"], f"{t['gpu_hours']:.3f}", _money(t["cost_usd"]),
                      _money(t["ondemand_cost_usd"]), _saving(t))
    _print_table(jobs)
    _print_table(teams)
    if out["jobs_total"] > len(out["jobs"]):
        _print_table(f"rows for the newest {len(out['jobs'])} of {out['jobs_total']} jobs (the "
                     "sums count all); --limit for more")
