"""SkyPilot's own interpreter (``.venv/skypilot``, made by ``make setup``), for the tests that
ask SkyPilot itself what it makes of a task: ``tests/skypilot_check.py`` runs there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.redis_server import free_port

SKY_PYTHON = Path(sys.prefix) / "skypilot" / "bin" / "python"


def in_skypilot(mode: str, tasks: list[dict[str, Any]], home: Path) -> Any:
    """Run ``tests/skypilot_check.py MODE`` in SkyPilot's venv, offline (HOME in a temp dir:
    SkyPilot writes ``~/.sky``; an API server it starts listens on a free loopback port)."""
    assert SKY_PYTHON.exists(), f"{SKY_PYTHON} is missing: run `make setup`"
    port = str(free_port())
    out = subprocess.run(
        [str(SKY_PYTHON), str(Path(__file__).with_name("skypilot_check.py")), mode],
        input=json.dumps(tasks), capture_output=True, text=True, timeout=240,
        env={"PATH": os.environ["PATH"], "HOME": str(home),
             "PYTHONPATH": str(Path(__file__).parents[1]),
             "SKYPILOT_API_SERVER_LOCAL_PORT": port,
             "SKYPILOT_API_SERVER_ENDPOINT": f"http://127.0.0.1:{port}"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])  # SkyPilot may print lines of its own
