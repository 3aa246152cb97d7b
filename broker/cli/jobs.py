"""``fleet launch/jobs/job/logs/cancel/capacity/events/chaos/login/token``: the API's client side.

Exit codes: those of ``broker.errors`` (0 ok, 2 bad input, 3 not found, 4 auth, 5 broker
unreachable, 6 conflict), and 1 when nothing was done (cancelling a job that had already ended).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from broker import errors
from broker.cli.app import app, console, err_console, fail, print_json
from broker.cli.launch_env import launch_env
from broker.cli.launch_files import upload_files
from broker.client import BrokerClient, config_path, write_client_config
from broker.files import PackError
from broker.models import JobState
from broker.protocol import BrokerEnv, Env
from broker.spec import (
    UNBOUNDED_WORK,
    ParsedSpec,
    SpecError,
    apply_overrides,
    load_spec_file,
)
from policies.models import Accelerator, FileMount

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
EXIT_NOTHING_DONE = 1
_WAITING = (JobState.QUEUED.value, JobState.SUSPENDED.value)


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


def restart_notice(resumable: bool | None, own_checkpoints: bool = False) -> str:
    """What a move, resize or preemption does to the job, as its agent found out (``None``:
    no heartbeat has said yet); ``own_checkpoints``: its resumable script commits DCP
    checkpoints itself (the job's ``checkpoint_at`` is known), so it loses the work since the
    newest."""
    if resumable and own_checkpoints:
        return ("resumable from its own checkpoints: a move, resize or preemption restarts this "
                "script, which loads the newest DCP checkpoint it committed under "
                f"{Env.CHECKPOINT_URI}; the work since that checkpoint is lost (the script takes "
                "none at a stop) and the scheduler prices it")
    if resumable:
        return ("resumable: a move, resize or preemption resumes it from its latest checkpoint "
                "(it reports progress through the runtime)")
    if resumable is False:
        return ("restarts from the beginning: a move, resize or preemption restarts this plain "
                "script from step 0 (it reports no progress through the runtime or a supported "
                f"framework and has committed no DCP checkpoint under {Env.CHECKPOINT_URI}); the "
                "scheduler avoids moving it")
    return ("a move, resize or preemption restarts the job from the beginning unless it reports "
            "progress through the runtime (broker.runtime elastic) or a supported framework, or "
            f"commits its own torch.distributed.checkpoint checkpoints under {Env.CHECKPOINT_URI} "
            "(then it loses only the work since the newest)")


def _where(job: dict[str, Any]) -> str:
    return job.get("pool") or "-"


def _cpu_job(job: dict[str, Any]) -> bool:
    """A job of CPU nodes: its ``gpus`` count nodes, the unit a CPU pool sells."""
    return job["spec"]["accelerators"] == [Accelerator.CPU.value]


def _held(job: dict[str, Any]) -> str:
    """What the job holds: its GPUs, or a CPU job's nodes ("2 CPU"); "-" when nothing."""
    if not job["gpus"]:
        return "-"
    return f"{job['gpus']} CPU" if _cpu_job(job) else str(job["gpus"])


def _why(job: dict[str, Any]) -> str:
    """Why a waiting job waits, with its place in the queue of its accelerators."""
    if job["state"] not in _WAITING:
        return "-"
    place = job.get("queue_position")
    where = f" (#{place['position']} of {place['of']} in queue)" if place else ""
    return (job.get("reason") or "-") + where


@app.command()
def launch(
    spec: Path = typer.Argument(..., help="Job spec: FleetBroker YAML or a SkyPilot task YAML"),
    gpus: str | None = typer.Option(None, "--gpus", help="Override the GPU range: N or MIN:MAX"),
    spot: str | None = typer.Option(None, "--spot", help="Override: never|allowed|preferred"),
    env: list[str] | None = typer.Option(None, "--env", help="NAME=VALUE for the job's "
                                         "environment (repeatable; wins over the spec's envs)"),
    secret: list[str] | None = typer.Option(None, "--secret", help="NAME of a secret, its value "
                                            "from your environment (repeatable): sealed, never "
                                            "shown"),
    dryrun: bool = typer.Option(False, "--dryrun", "--dry-run",
                                help="Print the translated job and, when a broker answers, "
                                "where it would run and at what price; submit nothing"),
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="After submitting, print the job's log until it ends"),
    interval: float = typer.Option(1.0, "--interval", min=0.05, hidden=True),
    as_json: bool = JsonOpt, url: str | None = UrlOpt, token: str | None = TokenOpt,
) -> None:
    """Submit a job to the broker."""
    try:
        parsed = load_spec_file(spec, launch=launch_env(env, secret))
        job_spec = apply_overrides(parsed.spec, gpus=gpus, spot=spot)
    except SpecError as exc:
        raise errors.InvalidInput(f"{spec}: invalid job spec", exc.problems) from None
    if dryrun:
        _dryrun(parsed.model_copy(update={"spec": job_spec}), as_json, url, token)
        return
    for note in parsed.warnings:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    with BrokerClient(url, token) as client:
        try:
            job_spec = upload_files(job_spec, lambda data: client.put_blob(data))
        except PackError as exc:
            fail(f"{spec}: {exc}")
        out = client.submit(job_spec.model_dump_json(), notes=parsed.warnings,
                    secrets={k: v.get_secret_value() for k, v in parsed.secrets.items()})
        job = out["job"]
        if as_json:
            print_json(job)
        else:
            g = job["spec"]["gpus"]
            size = f"{job['spec']['nodes']} CPU nodes, no GPU" if job_spec.cpu_only else \
                f"{g['min']}-{g['max']} GPUs"
            console.print(f"submitted [bold]{job['id']}[/] (team {job['team']}, "
                          f"{job['state']}, {size})", highlight=False)
            console.print(f"note: {restart_notice(None)}", highlight=False, markup=False,
                          soft_wrap=True)
        if follow:
            _print_logs(client, job["id"], 0, follow=True, interval=interval)


def _mount_source(m: FileMount) -> str:
    if m.name is None:
        return str(m.source)
    where = f"on {m.store}" if m.store else "on the store of the cloud it is placed on"
    return f"bucket {m.name} {where}, created if absent" + (
        f", filled from {m.source}" if m.source else "")


def _dryrun(parsed: ParsedSpec, as_json: bool, url: str | None, token: str | None) -> None:
    """The job as the broker would take it, and the broker's preview when one answers (a dry
    run needs no broker: without one it says so and still exits 0)."""
    try:
        with BrokerClient(url, token, timeout=5.0) as client:
            found: dict[str, Any] | None = client.preview(parsed.spec.model_dump_json())
            broker, unreached = client.url, None
    except errors.FleetError as exc:
        if exc.problems:  # the broker answered: the job cannot run there
            raise
        found, broker, unreached = None, None, str(exc)
    s = parsed.spec
    # A CPU job asks no accelerator and no GPU (its gpus count CPU nodes, the pool's unit).
    job = {"name": s.name, "format": parsed.format,
           "accelerators": [] if s.cpu_only else [a.value for a in s.accelerators],
           "gpus": {"min": 0, "max": 0, "default": None} if s.cpu_only else s.gpus.model_dump(),
           "cpus": s.cpus, "memory": s.memory, "batch_size": s.batch_size.model_dump(),
           "batch_mode": s.batch_mode.value, "spot": s.spot.value,
           "regions": s.regions.model_dump(), "env_names": sorted(s.envs),
           "secret_names": sorted(s.secret_envs), "nodes": s.nodes, "workdir": s.workdir,
           "container_image": s.container_image,
           "mounts": [m.model_dump(mode="json") for m in s.file_mounts],
           "checkpoint": s.checkpoint.model_dump(), "notes": parsed.warnings,
           "restart": restart_notice(None)}
    preview = None if found is None else {"broker": broker, "never_runs": found["never_runs"],
                                          "pools": found["pools"]}
    if as_json:
        print_json({"job": job, "preview": preview, "preview_skipped": unreached})
        return
    g, b = s.gpus, s.batch_size
    console.print(f"[bold]{s.name}[/] ({parsed.format} format): dry run, nothing submitted",
                  highlight=False)
    lines = [(f"CPU nodes (no GPU)  cpus {s.cpus or 'any'}  memory {s.memory or 'any'}"
              if s.cpu_only else f"accelerators {', '.join(job['accelerators'])}  gpus "
              f"{g.min}-{g.max}" + (f" (asks for {g.default})" if g.default else ""))
             + f"  batch {b.min}-{b.max} ({s.batch_mode.value})  spot {s.spot.value}",
             f"regions allow {', '.join(s.regions.allow)}"
             + (f" deny {', '.join(s.regions.deny)}" if s.regions.deny else ""),
             f"env {', '.join(job['env_names']) or '-'}  secrets "
             f"{', '.join(job['secret_names']) or '-'}  checkpoint "
             f"{s.checkpoint.uri or 'the broker default'} every {s.checkpoint.interval}"]
    if s.nodes:
        lines.append(f"nodes {s.nodes} (setup and run once per node)")
    if s.workdir:
        lines.append(f"workdir {s.workdir} (packed at launch)")
    if s.container_image:
        lines.append(f"container {s.container_image} (setup and run execute in it; only "
                     "pools whose nodes run containers take it)")
    lines += [f"mount {m.path} <- {_mount_source(m)} ({m.mode.value})" for m in s.file_mounts]
    for line in lines:  # user text (region patterns, URIs) is never read as markup
        console.print(line, highlight=False, markup=False)
    for note in [*parsed.warnings, job["restart"]]:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    if found is None:
        console.print(f"placement preview skipped: {unreached}", highlight=False,
                      soft_wrap=True, markup=False)
        return
    for p in found["never_runs"]:
        console.print(f"[bold red]never runs:[/] {escape(p['field'])}: {escape(p['message'])}",
                      highlight=False, soft_wrap=True)
    if not found["pools"]:
        if not found["never_runs"]:
            console.print(f"no pool of {broker} fits it now", highlight=False)
        return
    # A CPU pool's unit is a whole node: its price and room are per node, not per GPU.
    table = Table("POOL", "MARKET", "NODES", *(("$/NODE-H", "$/H", "FREE NODES") if s.cpu_only
                                               else ("GPUS", "$/GPU-H", "$/H", "FREE")),
                  "FITS NOW", box=None, header_style="bold")
    for r in found["pools"]:
        table.add_row(r["pool"], r["market"], str(r["nodes"]),
                      *(() if s.cpu_only else (str(r["gpus"]),)),
                      f"{r['price_per_gpu_hour']:.3f}",
                      f"{r['cost_per_hour']:.3f}", str(r["free_gpus"]),
                      "yes" if r["fits_now"] else "no")
    console.print(f"placement preview from {broker} (cheapest first):", highlight=False)
    _print_table(table)


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
        table.add_row(j["id"], j["team"], j["state"], _held(j),
                      str(j["batch_size"] or "-"), _where(j), _progress(j), str(j["rescales"]),
                      str(j["migrations"]))
    _print_table(table if out["jobs"] else "no jobs")
    # Reasons are sentences: one line each under the table, never folded into a column.
    waiting = [j for j in out["jobs"] if j["state"] in _WAITING]
    if waiting:
        console.print("why waiting:", highlight=False)
    for j in waiting:
        console.print(f"  {j['id']}: {_why(j)}", highlight=False, soft_wrap=True,
                      markup=False)


@app.command("job")
def show_job(job_id: str = typer.Argument(..., help="Job ID (from fleet jobs)"),
             as_json: bool = JsonOpt, url: str | None = UrlOpt,
             token: str | None = TokenOpt) -> None:
    """Show one job: state, assignment, progress, whether a move resumes it or restarts it from
    the beginning, placements and cost."""
    with BrokerClient(url, token) as client:
        out = client.job(job_id)
    if as_json:
        print_json(out)
        return
    j, s = out["job"], out["job"]["spec"]
    lines = [
        f"[bold]{j['id']}[/]  team {j['team']}  state [bold]{j['state']}[/]"
        + (f" ({escape(_why(j) if j['state'] in _WAITING else j['reason'])})"
           if j.get("reason") else ""),
        (f"CPU nodes {s['nodes']}  cpus {s.get('cpus') or 'any'}  memory "
         f"{s.get('memory') or 'any'}" if _cpu_job(j) else
         f"accelerators {', '.join(s['accelerators'])}  gpus {s['gpus']['min']}-"
         f"{s['gpus']['max']}  batch {s['batch_size']['min']}-{s['batch_size']['max']} "
         f"({s['batch_mode']})") + f"  spot {s['spot']}  priority {s['priority']}",
        # names only: a secret's value is never shown, an env's may be long
        f"envs {', '.join(s['envs']) or '-'}  secrets {', '.join(s['secret_envs']) or '-'}"
        + (f"  container {s['container_image']}" if s.get("container_image") else ""),
        (f"assigned {j['gpus']} CPU nodes" if _cpu_job(j) else
         f"assigned {j['gpus']} GPUs, batch {j['batch_size'] or '-'}") + f", pool {_where(j)}, "
        f"attempt {j['attempt']}"
        + (f", {j['nodes']} nodes (rendezvous round {j['round']})" if j.get("nodes", 1) > 1
           else ""),
        f"progress {_progress(j)} ({j['samples_done']:,} samples"
        + (f", {j['samples_per_sec']:.1f}/s" if j.get("samples_per_sec") else "") + ")"
        + (f", checkpoint step {j['checkpoint_step']}" if j.get("checkpoint_step") is not None
           else "")
        + (f" ({_size(j['checkpoint_bytes'])})" if j.get("checkpoint_bytes") is not None
           else ""),
        escape(("" if j.get("resumable") is not None else "not known yet: ")
               + restart_notice(j.get("resumable"), j.get("checkpoint_at") is not None)),
        f"rescales {j['rescales']}  migrations {j['migrations']}  preemptions "
        f"{j['preemptions']}  GPU-hours {out['gpu_hours']:.4f}  cost ${out['cost']:.4f} "
        f"(on-demand ${out['ondemand_cost']:.4f})",
    ]
    for line in lines:
        console.print(line, highlight=False)
    for note in j.get("notes", []):
        console.print(f"note: {note}", highlight=False, soft_wrap=True, markup=False)
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
        _print_logs(client, job_id, offset, follow=follow, interval=interval)


def _print_logs(client: BrokerClient, job_id: str, offset: int, *, follow: bool,
                interval: float) -> None:
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
def cancel(job_ids: list[str] | None = typer.Argument(None, help="Job IDs"),
           all_jobs: bool = typer.Option(False, "--all",
                                         help="Every unfinished job of your team"),
           team: str | None = typer.Option(None, "--team",
                                           help="With --all and an admin token: that team"),
           as_json: bool = JsonOpt, url: str | None = UrlOpt,
           token: str | None = TokenOpt) -> None:
    """Cancel jobs (each checkpoints and stops if it is running). Exits 1 when one of them
    had already ended."""
    if bool(job_ids) == all_jobs:
        fail("give job IDs or --all (not both)")
    results = []
    with BrokerClient(url, token) as client:
        if all_jobs:
            live = [s.value for s in JobState if not s.terminal]
            found = client.jobs(states=live, team=team)["jobs"]
            if not team and len({j["team"] for j in found}) > 1:
                fail("this token sees several teams' jobs; name one with --team")
            # a job already told to stop is not cancelled twice
            job_ids = [j["id"] for j in found if not j.get("cancel_requested")]
        for job_id in job_ids or []:
            results.append(client.cancel(job_id))
    if as_json:
        print_json([{**r["job"], "finished_before": r["finished"]} for r in results])
    for r in results:
        job = r["job"]
        if as_json:
            continue
        if r["finished"]:
            err_console.print(f"{job['id']}: already {job['state']}; nothing to cancel",
                              highlight=False)
            continue
        note = "" if job["state"] == "cancelled" else " (cancel requested; it stops shortly)"
        console.print(f"{job['id']}: {job['state']}{note}", highlight=False)
    if all_jobs and not results and not as_json:
        console.print("no unfinished jobs to cancel", highlight=False)
    if any(r["finished"] for r in results):
        raise typer.Exit(EXIT_NOTHING_DONE)


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
           limit: int | None = typer.Option(None, "--limit", min=1, max=100_000,
                                            help="Only the last N events (then, with "
                                            "--follow, every new one)"),
           interval: float = typer.Option(1.0, "--interval", min=0.05, hidden=True),
           as_json: bool = typer.Option(False, "--json", help="One JSON object per line"),
           url: str | None = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the event stream (submissions, launches, rescales, migrations, preemptions)."""
    since, page = "0", 1000

    def pages(client: BrokerClient) -> Iterator[dict[str, Any]]:
        """Every event after ``since``, oldest first, page by page."""
        nonlocal since
        while True:
            out = client.events(since=since, job_id=job_id, limit=page)
            yield from out["events"]
            since = out["next"]
            if len(out["events"]) < page:
                return

    with BrokerClient(url, token) as client:
        # The stream is read oldest first: the last N are what a bounded queue keeps of it.
        for e in deque(pages(client), maxlen=limit) if limit else pages(client):
            _print_event(e, as_json)
        while follow:
            time.sleep(interval)
            for e in pages(client):
                _print_event(e, as_json)


def _print_event(e: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(e))
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    data = " ".join(f"{k}={v}" for k, v in e["data"].items())
    typer.echo(f"{stamp} {e['type']:<18} {e['job_id'] or '-'} {data}".rstrip())


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
