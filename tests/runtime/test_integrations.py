"""The integrations' import hook and the agent's boot folder (``broker.runtime.integrations``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from broker.protocol import Env
from broker.runtime import integrations
from broker.runtime.agent import Agent, parse
from broker.runtime.integrations.hooks import install_hooks


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A framework ``fakefw`` and an integration ``fakeint`` that marks what it was given."""
    (tmp_path / "fakefw.py").write_text("loaded = True\n")
    (tmp_path / "fakeint.py").write_text(
        textwrap.dedent("""
        calls = []
        def install(module):
            assert module.loaded  # called after the framework's own code ran
            calls.append(module.__name__)
            module.patched = True
    """)
    )
    (tmp_path / "badint.py").write_text("def install(module):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("fakefw", "fakeint", "badint"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_a_watched_import_installs_its_integration_once(modules: Path) -> None:
    install_hooks({"fakefw": "fakeint"})
    import fakefw
    import fakeint

    assert fakefw.patched and fakeint.calls == ["fakefw"]
    del sys.modules["fakefw"]
    import fakefw as again  # noqa: F401

    assert fakeint.calls == ["fakefw"]


def test_an_already_imported_module_is_patched_at_once(modules: Path) -> None:
    import fakefw

    install_hooks({"fakefw": "fakeint"})
    assert fakefw.patched


def test_a_failing_integration_leaves_the_import_working(
    modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install_hooks({"fakefw": "badint"})
    import fakefw

    assert fakefw.loaded and not hasattr(fakefw, "patched")
    assert "the badint integration failed; fakefw runs without it" in capsys.readouterr().err


def test_the_boot_folder_chains_to_the_jobs_own_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.JOB_SITE = True\n")
    path = os.pathsep.join([str(integrations.BOOT_DIR), str(tmp_path)])
    probe = (
        "import builtins, sys; print(getattr(builtins, 'JOB_SITE', False),"
        " 'broker.runtime.integrations.hooks' in sys.modules)"
    )
    for switch, imported in (("on", True), ("off", False)):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": path, Env.INTEGRATIONS: switch},
        ).stdout.split()
        assert out == ["True", str(imported)]


def test_the_agent_puts_the_boot_folder_first_unless_turned_off() -> None:
    for env, expected in (
        ({"PYTHONPATH": "/job/src"}, [str(integrations.BOOT_DIR), "/job/src"]),
        ({}, [str(integrations.BOOT_DIR)]),
        ({"PYTHONPATH": "/job/src", Env.INTEGRATIONS: "off"}, ["/job/src"]),
    ):
        config, command = parse(["--", "true"], env)
        agent = Agent(config, command, env)
        assert agent.worker_env(0)["PYTHONPATH"].split(os.pathsep) == expected
