"""The root typer application and the helpers every command shares (errors, JSON output)."""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click
import typer
from rich.console import Console
from typer.core import TyperGroup

from broker import errors


class _FleetGroup(TyperGroup):
    """The CLI's one error handler: a FleetError (or an error ``broker.errors`` maps) from any
    command is one clear error line, a line per problem, and its class's exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.handled() as exc:
            err = errors.as_fleet_error(exc)
            err_console.print(f"[bold red]error:[/] {err.message}", highlight=False)
            for p in err.problems:
                err_console.print(f"  - {p}", highlight=False, markup=False)
            raise typer.Exit(err.exit_code) from None


app = typer.Typer(
    cls=_FleetGroup,
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

def fail(message: str, code: int = errors.InvalidInput.exit_code) -> NoReturn:
    """Print one clear error line (no traceback) and exit."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
