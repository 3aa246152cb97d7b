"""The node's light install (issue 15, item 7): the base install is the agent and runtime with
no control-plane package, ``[broker]`` adds the control plane. In a fresh venv without the
system's site-packages, holding only this checkout and the base install's dependencies, the
agent runs a command and ``fastapi`` (and every other control-plane package) cannot be
imported; the ``fleet`` script says which extra to install."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from broker.console import CONTROL_PLANE_PACKAGES

REPO = Path(__file__).resolve().parent.parent
# the base install's packages as modules: its two dependencies and theirs
BASE_MODULES = ("tenacity", "pydantic", "pydantic_core", "annotated_types", "typing_extensions",
                "typing_inspection")
# pip names of the control plane's packages (module yaml is PyYAML)
PIP_NAMES = {"yaml": "pyyaml"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()


def test_the_base_install_holds_no_control_plane_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    control = {PIP_NAMES.get(m, m) for m in CONTROL_PLANE_PACKAGES}
    assert base == {"tenacity", "pydantic"}
    assert control <= {_name(r) for r in project["optional-dependencies"]["broker"]}
    assert "broker" in project["optional-dependencies"]["all"][0]
    assert project["scripts"]["fleet"] == "broker.console:main"


def test_the_agent_runs_in_a_fresh_venv_without_the_control_plane(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # the base install: this checkout's packages and its dependencies (tenacity; pydantic and
    # what it imports), nothing else
    site = tmp_path / "site"
    for module in BASE_MODULES:
        path = Path(importlib.import_module(module).__file__ or "")
        if path.name == "__init__.py":
            shutil.copytree(path.parent, site / module)
        else:
            site.mkdir(exist_ok=True)
            shutil.copy(path, site / path.name)
    env = {"PYTHONPATH": f"{REPO}:{site}", "PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)

    got = run("-m", "broker.runtime.agent", "--help")
    assert got.returncode == 0 and "usage: python -m broker.runtime.agent" in got.stdout, \
        got.stderr
    got = run("-m", "broker.runtime.agent", "--job-id", "light", "--", str(python), "-c",
              "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])")
    assert got.returncode == 0, got.stderr
    assert "rank 0 of 1" in got.stdout + got.stderr
    for module in sorted(CONTROL_PLANE_PACKAGES):
        got = run("-c", f"import {module}")
        assert got.returncode == 1 and "ModuleNotFoundError" in got.stderr, module
    got = run("-c", "from broker.console import main; main()", "jobs")
    assert got.returncode == 2 and "pip install 'fleetbroker[broker]'" in got.stderr
    assert "Traceback" not in got.stderr


def test_the_fleet_script_runs_the_cli_where_the_control_plane_is_installed() -> None:
    got = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['fleet', '--version']; "
                          "from broker.console import main; main()"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.startswith("fleet "), got.stderr


def test_the_whole_runtime_imports_with_the_control_plane_refused() -> None:
    """With torch (the runtime extra) but every control-plane package refused by a meta path
    finder, the trainer, checkpointing and the agent all import."""
    code = (
        "import importlib.abc, sys\n"
        "from broker.console import CONTROL_PLANE_PACKAGES\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in CONTROL_PLANE_PACKAGES:\n"
        "            raise ModuleNotFoundError(f'refused: {name}', name=name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import broker.runtime, broker.runtime.agent, broker.runtime.trainer\n"
        "import broker.runtime.checkpoint, broker.runtime.data, broker.runtime.checkpoint_stores\n"
        "leaked = sorted({m.split('.')[0] for m in sys.modules} & CONTROL_PLANE_PACKAGES)\n"
        "print('leaked', leaked)\n")
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0 and "leaked []" in got.stdout, got.stderr
