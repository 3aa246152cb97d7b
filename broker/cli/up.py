"""``fleet up`` (run the broker: embedded Redis, scheduler, actuator, API) and ``fleet demo``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import typer

from broker.cli.app import app, console, fail


@app.command()
def up(
    state_dir: Path = typer.Option(Path(".state"), help="Where Redis data, node state and "
                                   "checkpoints live"),
    redis_url: str | None = typer.Option(
        None, envvar="FLEET_REDIS_URL", show_envvar=True,
        help="Use this Redis instead of starting one: redis://[user:password@]host:port/db "
        "or rediss:// (TLS). Prefer the variable: a command line is visible to every local "
        "user"),
    fleet: Path | None = typer.Option(None, help="Fleet file: local pretend regions and/or "
                                      "clouds (examples/fleets/*.yaml)"),
    host: str = typer.Option("127.0.0.1", help="API listen address"),
    port: int = typer.Option(8470, help="API port"),
    config: Path | None = typer.Option(None, help="Broker config YAML (api tokens)"),
    policy: str = typer.Option("elastic", help="elastic | fixed-batch | static"),
    admission: str = typer.Option("queue", help="queue | drop"),
) -> None:
    """Run the broker in the foreground until Ctrl-C."""
    from broker.auth import ConfigError
    from broker.client import write_client_config
    from broker.scheduler import Admission, Policy, SchedulerConfig
    from broker.secrets import redact_url, scrub
    from broker.server import DEFAULT_FLEET, BrokerConfig, Stack
    from providers.fleet import FleetFile

    os.umask(0o077)  # the broker's files (state, logs, checkpoints, its jobs'): owner only
    try:
        sched = SchedulerConfig(policy=Policy(policy), admission=Admission(admission))
    except ValueError:
        fail(f"--policy must be elastic, fixed-batch or static and --admission queue or drop "
             f"(got {policy!r}, {admission!r})")
    fleet = fleet or DEFAULT_FLEET
    try:
        FleetFile.load(fleet)
    except ValueError as exc:
        fail(str(exc))
    stack = Stack(BrokerConfig(state_dir=state_dir, redis_url=redis_url, fleet=fleet,
                               scheduler=sched), host=host, port=port, api_config_path=config)
    try:
        stack.start()
    except (RuntimeError, ConfigError, ValueError) as exc:
        fail(scrub(str(exc)))
    saved = write_client_config(stack.url, stack.tokens["admin"])
    where = f"embedded, port {stack.redis.port}" if stack.redis is not None else \
        redact_url(redis_url or "")
    console.print(f"FleetBroker up at [bold]{stack.url}[/] (Redis {where}, "
                  f"fleet {fleet}); admin token saved to {saved}. Ctrl-C stops.",
                  markup=True, highlight=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    console.print("stopping: running jobs checkpoint and resume on the next `fleet up`")
    stack.stop()


@app.command()
def demo(
    steps: int = typer.Option(1200, min=20, max=100_000, help="Training steps per job"),
    fleet: Path | None = typer.Option(None, help="Fleet file (default examples/fleets/demo.yaml)"),
    plain: bool = typer.Option(False, "--plain", help="Print phases instead of a live table"),
) -> None:
    """Run the scripted demo on a three-region local fleet: four real training jobs, a newcomer,
    a spot reclaim and the cost against all-on-demand."""
    from broker.demo import DEMO_FLEET, DemoConfig, print_summary, run_demo

    os.umask(0o077)
    try:
        summary = run_demo(DemoConfig(steps=steps, fleet=fleet or DEMO_FLEET, live=not plain),
                           console)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    print_summary(summary, console)
    if summary.finished != summary.jobs:
        raise typer.Exit(1)
