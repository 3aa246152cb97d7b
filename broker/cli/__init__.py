"""The ``fleet`` command line (typer + rich). Each subcommand module registers on ``app``."""

import broker.cli.prices  # (fleet gpus, fleet prices)
import broker.cli.simulate  # noqa: F401  (fleet simulate)
from broker.cli.app import app


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
