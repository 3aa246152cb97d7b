"""MkDocs hook: the broker's configuration keys, generated at build time from its model.

``configuration.md`` carries the marker below; this hook replaces it with one table per section
of ``broker.config.BrokerSettings`` (every key with its type, default, environment variable and
meaning, nested sections flattened to dotted keys), so the page lists exactly what the broker
accepts.
"""

from __future__ import annotations

import re
import sys
from enum import Enum
from pathlib import Path
from typing import Any

from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- config -->"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(annotation: Any) -> str:
    if isinstance(annotation, type):
        if issubclass(annotation, Enum):
            return " \\| ".join(f"`{m.value}`" for m in annotation)
        return annotation.__name__
    return re.sub(r"\b(?:[a-z_]+\.)+(\w+)", r"\1", _cell(annotation))  # no module paths


def _rows(model: Any, prefix: list[str], env_prefix: str) -> list[str]:
    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        if field.exclude:  # set by the broker itself, never in a file
            continue
        path = [*prefix, name]
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _rows(kind, path, env_prefix)
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, Enum):
            default = default.value
        env = f"{env_prefix}{'__'.join(path).upper()}"
        out.append(f"| `{'.'.join(path)}` | {_type(kind)} | `{_cell(default)}` | `{env}` | "
                   f"{_cell(field.description or '')} |")
    return out


def render() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from broker.auth import ApiConfig
    from broker.config import BrokerSettings
    from broker.protocol import ENV_PREFIX

    # a section kept as a mapping in the settings, checked by its own model
    SECTION_MODELS = {"api": ApiConfig}

    out = []
    for name, field in BrokerSettings.model_fields.items():
        out += [f"### `{name}`", "", _cell(field.description or "") or
                _cell((field.annotation.__doc__ or "").strip().split("\n\n")[0]), "",
                "| Key | Type | Default | Environment | Meaning |", "|---|---|---|---|---|"]
        out += _rows(SECTION_MODELS.get(name) or field.annotation, [name], ENV_PREFIX)
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
