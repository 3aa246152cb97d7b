"""The ``fleet`` console script. On a node's light install (the agent and runtime only, see
pyproject.toml) the CLI's packages are absent: it then says which extra to install instead of
printing a traceback."""

from __future__ import annotations

import sys

# The control plane's third-party packages: the `[broker]` extra, none of them in the base install.
CONTROL_PLANE_PACKAGES = frozenset({"fastapi", "uvicorn", "redis", "scipy", "typer", "rich",
                                    "yaml", "httpx"})


def main() -> None:
    """Run the CLI, or exit 2 naming the missing extra."""
    try:
        from broker.cli import main as cli
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in CONTROL_PLANE_PACKAGES:
            raise
        sys.stderr.write(f"fleet: the CLI needs the control plane ({exc.name} is not installed); "
                         "install it with: pip install 'fleetbroker[broker]'\n")
        sys.exit(2)
    cli()
