"""The ``fleet`` command line (typer + rich). Each subcommand module registers on ``app``."""

import broker.cli.prices  # noqa: F401  (fleet gpus, fleet prices)
from broker.cli import costs as _costs  # noqa: F401  registers cost-report
from broker.cli import jobs as _jobs  # noqa: F401  registers launch/jobs/job/logs/cancel/...
from broker.cli import simulate as _simulate  # noqa: F401  registers simulate
from broker.cli import up as _up  # noqa: F401  registers up/demo
from broker.cli.app import app


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
