"""The ``fleet`` command line (typer + rich). Each subcommand module registers on ``app``."""

import broker.cli.prices  # noqa: F401  (fleet gpus, fleet prices)
from broker.cli.app import app


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
