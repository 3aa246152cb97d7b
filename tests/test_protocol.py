"""The broker-agent protocol has one home: ``broker.protocol``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from broker import protocol
from broker.protocol import Env, Heartbeat, shell

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"FLEET_[A-Z]")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name a variable)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_no_fleet_name_outside_protocol() -> None:
    """No string literal in broker/ or providers/ spells a FLEET_* name, but broker/protocol.py."""
    found = []
    for package in ("broker", "providers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "broker" / "protocol.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        id(node) not in docs and NAME.search(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []


def test_names_are_unique_and_prefixed() -> None:
    names = [v for k, v in vars(Env).items() if k.isupper()]
    assert len(names) == len(set(names)) > 40
    assert all(n.startswith(protocol.ENV_PREFIX) for n in names)


def test_progress_fields_are_heartbeat_fields() -> None:
    assert set(protocol.PROGRESS_FIELDS) <= set(Heartbeat.model_fields)


def test_checkpoint_exit_is_defined_once() -> None:
    hits = []
    for path in ROOT.glob("broker/**/*.py"):
        hits += [path.name for line in path.read_text().splitlines()
                 if re.match(r"(CHECKPOINT_EXIT|EXIT_STOPPED|EXIT_FINISHED)\s*=", line)]
    assert sorted(hits) == ["protocol.py"] * 3


def test_shell_fills_in_names_and_leaves_other_at_signs() -> None:
    out = shell('x="${@AGENT_TOKEN:-}" "${a[@]}" -H @- [ "$c" != @EXIT_STOPPED ] @HEARTBEAT_PATH')
    assert out == (f'x="${{{Env.AGENT_TOKEN}:-}}" "${{a[@]}}" -H @- [ "$c" != '
                   f'{protocol.EXIT_STOPPED} ] {protocol.HEARTBEAT_PATH}')


def test_agent_imports_without_the_control_plane() -> None:
    """The node agent needs neither FastAPI, Redis, numpy nor the scheduler."""
    code = ("import sys, broker.runtime.agent; "
            "heavy = {'fastapi', 'redis', 'numpy', 'scipy', 'broker.store', 'broker.api'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _broker_imports(package: str) -> set[str]:
    out = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "broker":
                out.add(node.module or "")
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.split(".")[0] == "broker"}
    return out


def test_providers_use_only_the_contracts_of_the_broker_and_policies_none() -> None:
    assert _broker_imports("providers") <= {"broker.protocol", "broker.errors"}
    assert _broker_imports("policies") == set()
    for contract in ("protocol", "errors"):
        tree = ast.parse((ROOT / "broker" / f"{contract}.py").read_text())
        used = {(n.module or "").split(".")[0] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom)} | {
            a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names}
        assert used <= {"__future__", "ipaddress", "math", "re", "string", "enum", "typing",
                        "functools", "pydantic", "policies"}, (contract, used)
