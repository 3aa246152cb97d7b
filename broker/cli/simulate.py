"""``fleet simulate``: replay workload traces on a simulated cluster under one policy.

``elastic``, ``fixed-batch`` and ``static`` are the live broker's policies: the simulation runs
its scheduling round (``broker.sim.driver``) on every cluster; ``tiresias`` and the spot
policies other than ``fleet`` are baselines, for comparison only (``broker.sim.baselines``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from broker.cli.app import app, fail, print_json
from broker.errors import InvalidInput


def _expand(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.glob("*.csv"))
            if not found:
                fail(f"folder {p} holds no *.csv workload files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            fail(f"workload {p} does not exist")
    return out


@app.command()
def simulate(
    workloads: list[Path] = typer.Argument(..., help="workload CSV files or folders of them"),
    cluster: str = typer.Option("t4:16x4", help="TYPE:NODESxGPUS[,...] or a YAML file of pools"),
    policy: str = typer.Option(
        "elastic", help="the live round's policy: elastic (GPUs and batch chosen) | fixed-batch "
        "(GPUs chosen, the row's batch) | static (the row's GPUs and batch, never rescaled); or "
        "tiresias: a baseline, for comparison only (classic clusters)"),
    admission: str = typer.Option(
        "queue", help="the live round's admission: queue (jobs wait) | drop (a job that gets no "
        "GPUs in the round it arrives is dropped; a running job is never suspended for it)"),
    interval: float = typer.Option(60.0, help="seconds between scheduling rounds"),
    restart_penalty: str = typer.Option("30", help="seconds per restart, or per-model (Sia)"),
    efficiency: str = typer.Option("gns", help="gns (gradient noise scale) | none (gain = s)"),
    slowdown: str = typer.Option("none", help="none | sia (Sia's per-model calibration)"),
    value: str | None = typer.Option(None, hidden=True),
    fairness: float | None = typer.Option(None, hidden=True),
    restart_horizon: float | None = typer.Option(None, hidden=True),
    accumulation: bool | None = typer.Option(None, "--accumulation/--no-accumulation",
                                             hidden=True),
    migrate: bool | None = typer.Option(None, "--migrate/--no-migrate", hidden=True),
    spot_policy: str = typer.Option(
        "auto", help="fleet: the live broker's scheduling round decides (GPUs, batch, markets, "
        "regions, deadlines), with the broker's own settings; ondemand | skypilot-failover | "
        "skypilot-eager: baselines for comparison; auto: fleet when the cluster has spot or "
        "trace pools, else the classic simulation (one on-demand pool per type, no costs), "
        "which runs the live round too"),
    checkpoint_interval: float = typer.Option(
        100.0, help="spot simulation: seconds of progress between checkpoints (a preemption "
        "loses the work since the last one); 100 is the job spec's default"),
    checkpoint_on_notice: bool = typer.Option(
        False, help="spot simulation: jobs checkpoint on the preemption notice (FleetBroker's "
        "agent does; SkyPilot polls), so a preemption loses no work"),
    seed: int = typer.Option(0, help="recorded; the simulator itself draws no random numbers"),
    workers: int = typer.Option(
        1, help="processes simulating workloads in parallel (classic simulation only)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object, no progress"),
    jobs_out: Path | None = typer.Option(None, help="write one CSV row per job here"),
) -> None:
    """Simulate WORKLOAD.csv files on CLUSTER with POLICY and report job completion times."""
    from broker.scheduler import Admission, Policy
    from broker.sim.cluster import fleet_capacity, read_pool_specs
    from broker.sim.engine import Baseline, SimConfig
    from broker.sim.report import spot_summary, summary, write_jobs
    from broker.sim.rounds import (
        MarketPolicy,
        SpotConfig,
        classic_pools,
        has_spot,
        sim_pools,
        simulate_spot,
    )
    from broker.sim.workload import read_workload
    from policies.goodput import EfficiencyModel

    gone = [f"--{name.replace('_', '-')}" for name, given in (
        ("value", value), ("fairness", fairness), ("restart_horizon", restart_horizon),
        ("accumulation", accumulation), ("migrate", migrate)) if given is not None]
    if gone:
        fail(f"{', '.join(gone)}: settings of the classic simulation's own allocator, which is "
             "gone: every policy but tiresias now runs the live broker's round with the broker's "
             "own settings (speed-up value, no restart discount, accumulation always allowed, a "
             "running job keeps its accelerator type); leave them out")

    def choice(name: str, raw: str, *enums: Any) -> Any:
        for enum in enums:
            try:
                return enum(raw)
            except ValueError:
                pass
        fail(f"--{name} {raw!r} is not one of: "
             f"{', '.join(e.value for enum in enums for e in enum)}")

    pol = choice("policy", policy, Policy, Baseline)
    adm = choice("admission", admission, Admission)
    eff = choice("efficiency", efficiency, EfficiencyModel)
    if slowdown not in ("none", "sia"):
        fail(f"--slowdown {slowdown!r} is not one of: none, sia")
    penalty: float | None
    if restart_penalty == "per-model":
        penalty = None
    else:
        try:
            penalty = float(restart_penalty)
        except ValueError:
            fail(f"--restart-penalty {restart_penalty!r} must be seconds (e.g. 30) or per-model")
    if workers < 1:
        fail(f"--workers must be at least 1, got {workers}")
    market = None
    if spot_policy != "auto":
        market = choice("spot-policy", spot_policy, MarketPolicy)
    try:
        cfg = SimConfig(pol, adm, interval, penalty, eff, slowdown == "sia")
        specs = read_pool_specs(cluster)
        fleet_capacity([s.pool for s in specs])  # every type measured, nodes of measured size
        if market is None and has_spot(specs):
            market = MarketPolicy.FLEET
        if market is not None:
            pools = sim_pools(specs)
            spot = SpotConfig(market, checkpoint_interval, checkpoint_on_notice)
        else:
            pools = classic_pools(specs)
    except InvalidInput as e:  # ClusterError, SimulationError (a bad setting) included
        fail(str(e))
    paths = _expand(workloads)
    settings = {"policy": pol.value, "cluster": cluster, "admission": adm.value,
                "interval": interval, "restart_penalty": restart_penalty,
                "efficiency": eff.value, "slowdown": slowdown, "seed": seed}
    # a bad workload file or simulation setting is an InvalidInput: the CLI's handler names it
    loaded = [read_workload(p) for p in paths]  # validate every file before simulating
    if market is not None:
        settings.update(spot_policy=market.value, checkpoint_interval=checkpoint_interval,
                        checkpoint_on_notice=checkpoint_on_notice)
        spot_results = [(str(p), simulate_spot(jobs, pools, cfg, spot))
                        for p, jobs in zip(paths, loaded, strict=True)]
        results = [(name, r.result) for name, r in spot_results]
        out = spot_summary(spot_results, settings)
    else:
        show = not json_out and sys.stderr.isatty()
        results = _simulate_all(paths, pools, cfg, workers, show)
        out = summary(results, settings)
    if jobs_out:
        write_jobs(jobs_out, results)
    if json_out:
        print_json(out)
        return
    _print_table(out)


def _simulate_all(paths: list[Path], pools: Any, cfg: Any, workers: int,
                  show: bool) -> list[tuple[str, Any]]:
    from rich.progress import Progress

    from broker.cli.app import err_console

    if workers > 1 or not show:
        from broker.sim.batch import run_files

        return run_files(paths, pools, cfg, workers)
    from broker.sim.rounds import simulate as run
    from broker.sim.workload import read_workload

    results = []
    with Progress(console=err_console, transient=True) as progress:
        for path in paths:
            jobs = read_workload(path)
            task = progress.add_task(f"{path.name}", total=len(jobs))
            res = run(jobs, pools, cfg,
                      on_round=lambda _t, done, task=task: progress.update(task, completed=done))
            results.append((str(path), res))
    return results


def _print_table(out: dict[str, Any]) -> None:
    from rich.table import Table

    from broker.cli.app import console

    title = f"policy {out['policy']} on {out['cluster']} ({out['admission']})"
    cols = ["workload", "jobs", "completed", "dropped", "avg_jct_h", "p99_jct_h", "makespan_h",
            "gpu_hours_per_job", "rescales"]
    if "spot_policy" in out:
        title += f", spot policy {out['spot_policy']}"
        cols = [*cols[:2], "completed", "avg_jct_h", "cost_usd", "ondemand_cost_usd",
                "saving_pct", "deadline_misses", "migrations", "lost_work_gpu_h"]
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="left" if c == "workload" else "right")
    for p in out["per_workload"]:
        table.add_row(Path(p["workload"]).name, *[str(p[c]) for c in cols[1:]])
    table.add_row(*["all"] + [str(out[c]) for c in cols[1:]], style="bold")
    console.print(table)
