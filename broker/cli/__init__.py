"""The ``fleet`` command line (typer + rich). Each subcommand module registers on ``app``."""

from broker.cli import jobs as _jobs  # noqa: F401  registers launch/jobs/job/logs/cancel/...
from broker.cli import up as _up  # noqa: F401  registers up/demo
from broker.cli.app import app


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
