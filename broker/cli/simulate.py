"""``fleet simulate``: replay workload traces on a simulated cluster under one policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from broker.cli.app import app, fail, print_json


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
    policy: str = typer.Option("elastic", help="elastic | fixed-batch | static | tiresias"),
    admission: str = typer.Option("queue", help="queue (jobs wait) | drop (no GPU on arrival)"),
    interval: float = typer.Option(60.0, help="seconds between scheduling rounds"),
    restart_penalty: str = typer.Option("30", help="seconds per restart, or per-model (Sia)"),
    efficiency: str = typer.Option("gns", help="gns (gradient noise scale) | none (gain = s)"),
    slowdown: str = typer.Option("none", help="none | sia (Sia's per-model calibration)"),
    value: str = typer.Option("speedup", help="DP value: speedup | remaining | fair"),
    fairness: float = typer.Option(0.5, help="exponent p of the 'fair' value, in (0, 1]"),
    restart_horizon: float = typer.Option(
        1800.0, help="seconds a rescale must repay its restart in (discounts changes)"),
    accumulation: bool = typer.Option(
        True, help="let elastic/fixed-batch jobs accumulate gradients past the per-GPU limit"),
    migrate: bool = typer.Option(
        False, help="let a running job move to a type where it runs 3x faster (a restart)"),
    spot_policy: str = typer.Option(
        "auto", help="fleet: the live broker's scheduling round decides (GPUs, batch, markets, "
        "regions, deadlines), with the broker's own settings, so --value, --fairness, "
        "--restart-horizon, --accumulation and --migrate do not apply to it; ondemand | "
        "skypilot-failover | skypilot-eager: baselines for comparison; auto: fleet when the "
        "cluster has spot or trace pools, else the classic simulation (no markets, no costs)"),
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
    from broker.sim.cluster import ClusterError, fleet_capacity, read_pool_specs
    from broker.sim.engine import SimConfig, SimulationError
    from broker.sim.report import spot_summary, summary, write_jobs
    from broker.sim.spot import MarketPolicy, SpotConfig, has_spot, sim_pools, simulate_spot
    from broker.sim.workload import WorkloadError, read_workload
    from policies.choices import ValueConfig, ValueFunction
    from policies.goodput import EfficiencyModel
    from policies.schedulers import Admission, PolicyName

    def choice(name: str, raw: str, enum: Any) -> Any:
        try:
            return enum(raw)
        except ValueError:
            fail(f"--{name} {raw!r} is not one of: {', '.join(e.value for e in enum)}")

    pol = choice("policy", policy, PolicyName)
    adm = choice("admission", admission, Admission)
    eff = choice("efficiency", efficiency, EfficiencyModel)
    val = choice("value", value, ValueFunction)
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
        cfg = SimConfig(pol, adm, interval, penalty, eff, slowdown == "sia",
                        ValueConfig(val, fairness, restart_horizon), accumulation=accumulation,
                        migrate=migrate)
        specs = read_pool_specs(cluster)
        fleet = fleet_capacity([s.pool for s in specs])
        if market is None and has_spot(specs):
            market = MarketPolicy.FLEET
        if market is not None:
            pools = sim_pools(specs)
            spot = SpotConfig(market, checkpoint_interval, checkpoint_on_notice)
    except (ValueError, ClusterError) as e:
        fail(str(e))
    paths = _expand(workloads)
    settings = {"policy": pol.value, "cluster": cluster, "admission": adm.value,
                "interval": interval, "restart_penalty": restart_penalty,
                "efficiency": eff.value, "slowdown": slowdown, "value": val.value,
                "fairness": fairness, "restart_horizon": restart_horizon,
                "accumulation": accumulation, "migrate": migrate, "seed": seed}
    try:
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
            results = _simulate_all(paths, fleet, cfg, workers, show)
            out = summary(results, settings)
    except (WorkloadError, SimulationError) as e:
        fail(str(e))
    if jobs_out:
        write_jobs(jobs_out, results)
    if json_out:
        print_json(out)
        return
    _print_table(out)


def _simulate_all(paths: list[Path], fleet: Any, cfg: Any, workers: int,
                  show: bool) -> list[tuple[str, Any]]:
    from rich.progress import Progress

    from broker.cli.app import err_console

    if workers > 1 or not show:
        from broker.sim.batch import run_files

        return run_files(paths, fleet, cfg, workers)
    from broker.sim.engine import simulate as run
    from broker.sim.workload import read_workload

    results = []
    with Progress(console=err_console, transient=True) as progress:
        for path in paths:
            jobs = read_workload(path)
            task = progress.add_task(f"{path.name}", total=len(jobs))
            res = run(jobs, fleet, cfg,
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
