"""The ``fleet`` command line (typer + rich). Each subcommand module registers on ``app``."""

from broker.cli import simulate as _simulate  # noqa: F401  registers `fleet simulate`
from broker.cli.app import app


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "main"]
