"""MkDocs hook: the ``fleet`` command reference, generated at build time from the typer app.

``cli.md`` carries the marker below; this hook replaces it with every command and subcommand of
``broker.cli.app`` (its help text, arguments and options with their defaults), read through
typer's click commands, so the page lists exactly what ``fleet --help`` offers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- cli -->"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _type(p: Any) -> str:
    if getattr(p, "is_flag", False):
        return "flag"
    annotation = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    return getattr(annotation, "__name__", str(annotation or "text")).lower()


def _param(p: Any) -> str:
    help_text = _cell(getattr(p, "help", ""))
    if p.envvar:
        help_text += f" (env `{p.envvar}`)"
    if p.param_type_name == "argument":
        return (f"| `{p.name.upper()}` | argument, {_type(p)} | "
                f"{'yes' if p.required else 'no'} | | {help_text} |")
    names = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
    default = p.default if p.default not in (None, (), [], False) and not callable(p.default) \
        else ""
    return (f"| {names} | {_type(p)} | {'yes' if p.required else 'no'} | "
            f"{f'`{default}`' if default != '' else ''} | {help_text} |")


def _command(name: str, cmd: Any, level: int) -> list[str]:
    out = [f"{'#' * level} `{name}`", ""]
    if cmd.help:
        out += [cmd.help.strip(), ""]
    params = [p for p in cmd.params if p.name != "help"]
    if params:
        out += ["| parameter | type | required | default | help |", "|---|---|---|---|---|",
                *(_param(p) for p in params), ""]
    if hasattr(cmd, "commands"):
        for sub, c in cmd.commands.items():
            out += _command(f"{name} {sub}", c, min(level + 1, 6))
    return out


def render() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import typer.main

    from broker.cli import app

    root = typer.main.get_command(app)
    out = ["Generated from the `fleet` typer app at docs build time; `fleet COMMAND --help` "
           "prints the same.", ""]
    for name, cmd in root.commands.items():
        out += _command(f"fleet {name}", cmd, 3)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
