"""``fleet up`` (run the broker: embedded Redis, scheduler, actuator, API) and ``fleet demo``."""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import threading
from pathlib import Path

import typer

from broker.cli.app import app, console, fail
from broker.errors import InvalidInput
from broker.logs import LogFormat, LogLevel
from broker.logs import configure as configure_logs
from broker.protocol import ENV_PREFIX, BrokerEnv


@app.command()
def up(
    state_dir: Path = typer.Option(Path(".state"), envvar=BrokerEnv.STATE_DIR, show_envvar=True,
                                   help="Where Redis data, node state and checkpoints live"),
    redis_url: str | None = typer.Option(
        None, envvar=BrokerEnv.REDIS_URL, show_envvar=True,
        help="Use this Redis instead of starting one: redis://[user:password@]host:port/db "
        "or rediss:// (TLS). Prefer the variable: a command line is visible to every local "
        "user"),
    fleet: Path | None = typer.Option(None, envvar=BrokerEnv.FLEET_FILE, show_envvar=True,
                                      help="Fleet file: local pretend regions and/or clouds "
                                      "(examples/fleets/*.yaml)"),
    host: str = typer.Option("127.0.0.1", envvar=BrokerEnv.HOST, show_envvar=True,
                             help="API listen address"),
    port: int = typer.Option(8470, envvar=BrokerEnv.PORT, show_envvar=True, help="API port"),
    config: Path | None = typer.Option(
        None, envvar=BrokerEnv.BROKER_CONFIG, show_envvar=True,
        help="Broker config YAML (sections scheduler, broker, api; docs/configuration.md). "
        f"{ENV_PREFIX}<SECTION>__<KEY> variables override it, and these flags override both"),
    policy: str | None = typer.Option(
        None, help="elastic | fixed-batch | static (scheduler.policy; default elastic)"),
    admission: str | None = typer.Option(
        None, help="queue | drop (scheduler.admission; default queue)"),
    log_format: LogFormat = typer.Option(LogFormat.TEXT, envvar=BrokerEnv.LOG_FORMAT,
                                         show_envvar=True, help="Log lines as text or JSON "
                                         "(one object per line, for log shippers)"),
    log_level: LogLevel = typer.Option(LogLevel.WARNING, envvar=BrokerEnv.LOG_LEVEL,
                                       show_envvar=True, help="Least severe level logged"),
) -> None:
    """Run the broker in the foreground until Ctrl-C."""
    from broker import config as broker_config
    from broker.client import write_client_config
    from broker.secrets import redact_url, scrub
    from broker.server import DEFAULT_FLEET, Stack
    from providers.fleet import FleetFile

    os.umask(0o077)  # the broker's files (state, logs, checkpoints, its jobs'): owner only
    configure_logs(log_format, log_level.value)
    flags = {k: v for k, v in (("policy", policy), ("admission", admission)) if v is not None}
    settings = broker_config.load(config, {"scheduler": flags})
    fleet = fleet or DEFAULT_FLEET
    try:
        FleetFile.load(fleet)
    except InvalidInput as exc:
        fail(str(exc))
    stack = Stack(settings.broker_config(state_dir=state_dir, redis_url=redis_url, fleet=fleet),
                  host=host, port=port, api=settings.api)
    try:
        stack.start()
    except (RuntimeError, InvalidInput) as exc:  # ConfigError and a bad fleet file included
        fail(scrub(str(exc)))
    saved = write_client_config(stack.url, stack.tokens["admin"])
    where = f"embedded, port {stack.redis.port}" if stack.redis is not None else \
        redact_url(redis_url or "")
    console.print(f"FleetBroker up at [bold]{stack.url}[/] (Redis {where}, "
                  f"fleet {fleet}); admin token saved to {saved}; dashboard at "
                  f"{stack.url}/ui/. Ctrl-C stops.",
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
    from providers.local.job_user import JOB_USER_ENV, job_user

    os.umask(0o077)
    try:
        job_user()
    except InvalidInput as exc:
        # The demo's jobs are its own, in a throwaway state dir: run them as the demo's user
        # rather than refuse; `fleet up` keeps refusing (docs/security.md).
        os.environ[JOB_USER_ENV] = pwd.getpwuid(os.getuid()).pw_name
        console.print(f"note: {exc}. The demo's jobs run as {os.environ[JOB_USER_ENV]}.",
                      markup=False, highlight=False)
    try:
        summary = run_demo(DemoConfig(steps=steps, fleet=fleet or DEMO_FLEET, live=not plain),
                           console)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    print_summary(summary, console)
    if summary.finished != summary.jobs:
        raise typer.Exit(1)
