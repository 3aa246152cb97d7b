"""The import hook behind the integrations: run a callback once a watched module has loaded.

A meta-path finder that sees an import of a watched name lets the normal finders resolve it, then
wraps the loader so that, right after the module's code has run, the integration's
``install(module)`` is called. A failing integration warns on stderr and never breaks the job's
import: the job then runs as a plain script.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import traceback
from collections.abc import Mapping, Sequence
from types import ModuleType


def _install(integration: str, module: ModuleType) -> None:
    try:
        importlib.import_module(integration).install(module)
    except Exception:
        print(
            f"fleet: the {integration} integration failed; {module.__name__} runs without it:\n"
            + traceback.format_exc(),
            file=sys.stderr,
        )


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, integration: str) -> None:
        self._inner = inner
        self._integration = integration

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _install(self._integration, module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: Mapping[str, str]) -> None:
        self._hooks = dict(hooks)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        integration = self._hooks.pop(fullname, None)  # once per watched name
        if integration is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, integration)
                return spec
        return None


def install_hooks(hooks: Mapping[str, str]) -> None:
    """Watch ``hooks``' module names; one already imported gets its integration now."""
    pending = {}
    for name, integration in hooks.items():
        if name in sys.modules:
            _install(integration, sys.modules[name])
        else:
            pending[name] = integration
    if pending:
        sys.meta_path.insert(0, _Finder(pending))
