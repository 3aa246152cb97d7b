"""``fleet launch/jobs/job/logs/cancel/capacity/events/chaos/login/token``: the API's client side.

Exit codes: those of ``broker.errors`` (0 ok, 2 bad input, 3 not found, 4 auth, 5 broker
unreachable, 6 conflict).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from broker.cli.app import app, console, err_console, print_json
from broker.client import BrokerClient, config_path, write_client_config
from broker.protocol import BrokerEnv
from broker.spec import UNBOUNDED_WORK, apply_overrides, load_spec_file

UrlOpt = typer.Option(None, "--url", envvar=BrokerEnv.URL, show_envvar=True,
                      help="Broker URL (default: client config, else http://127.0.0.1:8470)")
TokenOpt = typer.Option(None, "--token", envvar=BrokerEnv.TOKEN, show_envvar=True,
                        help="API token (default: the client config file)")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table")

chaos_app = typer.Typer(help="Fault injection on a running broker (admin token).",
                        no_args_is_help=True)
app.add_typer(chaos_app, name="chaos")


def _print_table(renderable: Any) -> None:
    """Tables at the terminal's width; into a pipe or file, wide enough never to fold."""
    (console if console.is_terminal else Console(width=_PIPE_WIDTH)).print(renderable)


_PIPE_WIDTH = 200


def _progress(job: dict[str, Any]) -> str:
    if job["spec"]["work_samples"] >= UNBOUNDED_WORK:
        return f"{job['samples_done']:,} samples"
    return f"{100 * job['progress']:.0f}%"


def _size(n: int) -> str:
    """Bytes in decimal units (GB as egress is billed): 512 B, 3.4 MB, 52.1 GB."""
    if n < 1000:
        return f"{n} B"
    exp = min((len(str(n)) - 1) // 3, 4)
    return f"{n / 1000 ** exp:.1f} {'kMGT'[exp - 1]}B"


def _where(job: dict[str, Any]) -> str:
    return job.get("pool") or "-"


@app.command()
def launch(
    spec: Path = typer.Argument(..., help="Job spec: FleetBroker YAML or a SkyPilot task YAML"),
    gpus: str | None = typer.Option(None, "--gpus", help="Override the GPU range: N or MIN:MAX"),
    spot: str | None = typer.Option(None, "--spot", help="Override: never|allowed|preferred"),
    as_json: bool = JsonOpt, url: str | None = UrlOpt, token: str | None = TokenOpt,
) -> None:
    """Submit a job to the broker."""
    parsed = load_spec_file(spec)
    job_spec = apply_overrides(parsed.spec, gpus=gpus, spot=spot)
    for note in parsed.warnings:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    with BrokerClient(url, token) as client:
        out = client.submit(job_spec.model_dump_json())
    job = out["job"]
    if as_json:
        print_json(job)
        return
    console.print(f"submitted [bold]{job['id']}[/] (team {job['team']}, {job['state']}, "
                  f"{job['spec']['gpus']['min']}-{job['spec']['gpus']['max']} GPUs)",
                  highlight=False)


@app.command("jobs")
def list_jobs(
    state: list[str] | None = typer.Option(None, "--state", help="Only jobs in this state"),
    team: str | None = typer.Option(None, "--team", help="Only this team's jobs (admin)"),
    as_json: bool = JsonOpt, url: str | None = UrlOpt, token: str | None = TokenOpt,
) -> None:
    """List jobs (a team token sees its own; an admin sees all)."""
    with BrokerClient(url, token) as client:
        out = client.jobs(states=state, team=team)
    if as_json:
        print_json(out["jobs"])
        return
    table = Table("ID", "TEAM", "STATE", "GPUS", "BATCH", "POOL", "PROGRESS", "RESCALES",
                  "MOVES", box=None, header_style="bold")
    for column in (table.columns[0], table.columns[5]):
        column.overflow = "fold"  # ids and pools are what users copy: never cut them
    for j in out["jobs"]:
        table.add_row(j["id"], j["team"], j["state"], str(j["gpus"] or "-"),
                      str(j["batch_size"] or "-"), _where(j), _progress(j), str(j["rescales"]),
                      str(j["migrations"]))
    _print_table(table if out["jobs"] else "no jobs")


@app.command("job")
def show_job(job_id: str = typer.Argument(..., help="Job ID (from fleet jobs)"),
             as_json: bool = JsonOpt, url: str | None = UrlOpt,
             token: str | None = TokenOpt) -> None:
    """Show one job: state, assignment, progress, placements and cost."""
    with BrokerClient(url, token) as client:
        out = client.job(job_id)
    if as_json:
        print_json(out)
        return
    j, s = out["job"], out["job"]["spec"]
    lines = [
        f"[bold]{j['id']}[/]  team {j['team']}  state [bold]{j['state']}[/]"
        + (f" ({j['reason']})" if j.get("reason") else ""),
        f"accelerators {', '.join(s['accelerators'])}  gpus {s['gpus']['min']}-"
        f"{s['gpus']['max']}  batch {s['batch_size']['min']}-{s['batch_size']['max']} "
        f"({s['batch_mode']})  spot {s['spot']}  priority {s['priority']}",
        f"assigned {j['gpus']} GPUs, batch {j['batch_size'] or '-'}, pool {_where(j)}, "
        f"attempt {j['attempt']}"
        + (f", {j['nodes']} nodes (rendezvous round {j['round']})" if j.get("nodes", 1) > 1
           else ""),
        f"progress {_progress(j)} ({j['samples_done']:,} samples"
        + (f", {j['samples_per_sec']:.1f}/s" if j.get("samples_per_sec") else "") + ")"
        + (f", checkpoint step {j['checkpoint_step']}" if j.get("checkpoint_step") is not None
           else "")
        + (f" ({_size(j['checkpoint_bytes'])})" if j.get("checkpoint_bytes") is not None
           else ""),
        f"rescales {j['rescales']}  migrations {j['migrations']}  preemptions "
        f"{j['preemptions']}  GPU-hours {out['gpu_hours']:.4f}  cost ${out['cost']:.4f} "
        f"(on-demand ${out['ondemand_cost']:.4f})",
    ]
    for line in lines:
        console.print(line, highlight=False)
    if out["placements"]:
        table = Table("ATTEMPT", "POOL", "MARKET", "GPUS", "BATCH", "HOURS", "$/GPU-H", "COST",
                      box=None, header_style="bold")
        for p in out["placements"]:
            hours = p["gpu_hours"] / p["gpus"] if p["gpus"] else 0.0
            table.add_row(str(p["attempt"]), p["pool"], p["market"], str(p["gpus"]),
                          str(p["batch_size"] or "-"), f"{hours:.4f}",
                          f"{p['price_per_gpu_hour']:.3f}", f"{p['cost']:.4f}")
        _print_table(table)


@app.command()
def logs(job_id: str = typer.Argument(..., help="Job ID"),
         follow: bool = typer.Option(False, "--follow", "-f",
                                     help="Keep printing new lines until the job ends"),
         offset: int = typer.Option(0, "--offset", min=0, help="First line to print"),
         interval: float = typer.Option(1.0, "--interval", min=0.05, hidden=True),
         url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print a job's log lines."""
    with BrokerClient(url, token) as client:
        while True:
            out = client.logs(job_id, offset)
            for line in out["lines"]:
                typer.echo(line)
            offset = out["next_offset"]
            if out["lines"]:
                continue  # drain what is there before waiting
            if not follow or out["terminal"]:
                return
            time.sleep(interval)


@app.command()
def cancel(job_id: str = typer.Argument(..., help="Job ID"), as_json: bool = JsonOpt,
           url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Cancel a job (it checkpoints and stops if it is running)."""
    with BrokerClient(url, token) as client:
        job = client.cancel(job_id)["job"]
    if as_json:
        print_json(job)
        return
    note = "" if job["state"] == "cancelled" else " (cancel requested; it stops shortly)"
    console.print(f"{job['id']}: {job['state']}{note}", highlight=False)


@app.command()
def capacity(as_json: bool = JsonOpt, url: str | None = UrlOpt,
             token: str | None = TokenOpt) -> None:
    """The fleet's pools: GPUs, GPUs in use, market and price."""
    with BrokerClient(url, token) as client:
        out = client.capacity()
    if as_json:
        print_json(out)
        return
    table = Table("CLOUD", "REGION", "MARKET", "ACCEL", "GPUS", "USED", "FREE", "$/GPU-H",
                  box=None, header_style="bold")
    for p in out["pools"]:
        table.add_row(p["cloud"], p["region"], p["market"], p["accelerator"],
                      str(p["capacity"]), str(p["used"]), str(p["free"]),
                      f"{p['price_per_gpu_hour']:.3f}")
    _print_table(table if out["pools"] else "no pools (is the broker's fleet configured?)")
    console.print(f"total {out['total']['used']}/{out['total']['capacity']} GPUs in use",
                  highlight=False)


@app.command()
def events(job_id: str | None = typer.Option(None, "--job", help="Only this job's events"),
           follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new ones"),
           limit: int = typer.Option(100, "--limit", min=1, max=10_000,
                                     help="Most events per request"),
           interval: float = typer.Option(1.0, "--interval", min=0.05, hidden=True),
           as_json: bool = typer.Option(False, "--json", help="One JSON object per line"),
           url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the event stream (submissions, launches, rescales, migrations, preemptions)."""
    since = "0"
    with BrokerClient(url, token) as client:
        while True:
            out = client.events(since=since, job_id=job_id, limit=limit)
            for e in out["events"]:
                if as_json:
                    typer.echo(json.dumps(e))
                    continue
                stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
                data = " ".join(f"{k}={v}" for k, v in e["data"].items())
                typer.echo(f"{stamp} {e['type']:<18} {e['job_id'] or '-'} {data}".rstrip())
            since = out["next"]
            if len(out["events"]) == limit:
                continue  # more are waiting
            if not follow:
                return
            time.sleep(interval)


@chaos_app.command("preempt")
def chaos_preempt(region: str = typer.Argument(..., help="A spot region (or cloud:region)"),
                  duration: float = typer.Option(60.0, "--duration", min=1.0,
                                                 help="Seconds the region stays reclaimed"),
                  url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Reclaim every spot node in REGION: its jobs checkpoint and move elsewhere."""
    with BrokerClient(url, token) as client:
        out = client.preempt(region, duration)
    console.print(f"preempting {out['region']} ({', '.join(out['pools'])}) for "
                  f"{out['duration_s']:.0f}s", highlight=False)


@chaos_app.command("node")
def chaos_node(job_id: str = typer.Argument(..., help="A running job"),
               rank: int = typer.Option(0, "--rank", min=0, help="Which of its nodes"),
               kill: bool = typer.Option(False, "--kill",
                                         help="The machine dies at once (default: a spot "
                                         "reclaim: notice, then the grace period)"),
               url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Take one node of a job away (local pretend regions): a multi-node job replaces it."""
    how = "kill" if kill else "reclaim"
    with BrokerClient(url, token) as client:
        out = client.node_chaos(job_id, rank, how)
    console.print(f"{out['how']} node of rank {out['rank']} of {out['job_id']}", highlight=False)


@app.command()
def login(url: str = typer.Option(..., "--url", help="Broker URL"),
          token: str = typer.Option(..., "--token", prompt=True, hide_input=True,
                                    help="API token")) -> None:
    """Save the broker URL and token in the client config file (mode 600)."""
    with BrokerClient(url, token) as client:
        client.jobs()  # proves both before they are saved
    console.print(f"saved to {write_client_config(url, token)}", highlight=False)


@app.command()
def token() -> None:
    """Make a new random API token and print it with the SHA-256 the broker config stores."""
    from broker.auth import hash_token, new_token

    fresh = new_token()
    console.print(f"token:        {fresh}\ntoken_sha256: {hash_token(fresh)}", highlight=False)
    err_console.print(f"(the client reads its token from {BrokerEnv.TOKEN} or {config_path()})",
                      highlight=False)
