"""The root typer application and the helpers every command shares (errors, JSON output)."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="fleet",
    help="FleetBroker: one elastic GPU fleet across AWS, GCP, Azure and local machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error line stays one line in logs


def _print_version(value: bool) -> None:
    if value:
        from broker import __version__

        typer.echo(f"fleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True,
                                       callback=_print_version,
                                       help="Print the version and exit")) -> None:
    """Keeps ``fleet`` a command group even while only one subcommand is registered."""

EXIT_USAGE = 2  # bad input: a spec, a flag or a file the user must fix


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print one clear error line (no traceback) and exit."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
