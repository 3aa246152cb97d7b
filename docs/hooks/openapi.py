"""MkDocs hook: the HTTP API reference, generated at build time from the app's OpenAPI schema.

``http-api.md`` carries the marker below; this hook replaces it with one section per route
(method, path, summary, description, parameters, request body, responses) and the schemas they
use, taken from ``broker.api.build_app(...).openapi()``, so the page is the app's own contract.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- openapi -->"


def schema() -> dict[str, Any]:
    """The app's OpenAPI document; building the app opens no connection."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from broker.api import build_app
    from broker.auth import ApiConfig
    from broker.store import Store

    return build_app(Store.from_url("redis://127.0.0.1:6379/0"), ApiConfig()).openapi()


def _type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#schema-{name.lower()})"
    if "anyOf" in s:
        return " \\| ".join(_type(x) for x in s["anyOf"])
    if "enum" in s:
        return " \\| ".join(f"`{v}`" for v in s["enum"])
    if s.get("type") == "array":
        return f"array of {_type(s.get('items', {}))}"
    return f"`{s.get('type', 'any')}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _route(method: str, path: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", "", f"**{op.get('summary', '')}**", ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        out += [f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else 'no'} | "
                f"{_cell(p.get('description') or p.get('schema', {}).get('description'))} |"
                for p in params]
        out.append("")
    body = op.get("requestBody")
    if body:
        kinds = ", ".join(f"`{k}` ({_type(v.get('schema', {}))})"
                          for k, v in body.get("content", {}).items())
        out += [f"Request body: {kinds or 'see the description'}.", ""]
    out += ["| status | meaning | body |", "|---|---|---|"]
    for status, r in op.get("responses", {}).items():
        content = r.get("content", {}).get("application/json", {})
        out.append(f"| {status} | {_cell(r.get('description'))} | "
                   f"{_type(content['schema']) if content.get('schema') else ''} |")
    return [*out, ""]


def _schema(name: str, s: dict[str, Any]) -> list[str]:
    out = [f'### {name} {{ #schema-{name.lower()} }}', ""]
    if s.get("description"):
        out += [_cell(s["description"]), ""]
    if "enum" in s:
        return [*out, "One of " + ", ".join(f"`{v}`" for v in s["enum"]) + ".", ""]
    required = set(s.get("required", []))
    props = s.get("properties", {})
    if props:
        out += ["| field | type | required | description |", "|---|---|---|---|"]
        out += [f"| `{k}` | {_type(v)} | {'yes' if k in required else 'no'} | "
                f"{_cell(v.get('description'))} |" for k, v in props.items()]
    return [*out, ""]


def render(doc: dict[str, Any]) -> str:
    out = [f"Generated from the OpenAPI schema of `broker.api` (FleetBroker "
           f"{doc['info']['version']}) at docs build time. A running broker serves the same "
           "document at `/openapi.json` and interactive docs at `/docs`.", "", "## Routes", ""]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            out += _route(method, path, op)
    out += ["## Schemas", ""]
    for name, s in doc.get("components", {}).get("schemas", {}).items():
        out += _schema(name, s)
    out += ["<details><summary>The raw OpenAPI document</summary>", "", "```json",
            json.dumps(doc, indent=1), "```", "", "</details>"]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(schema()))
