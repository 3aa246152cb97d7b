"""Loaded by every worker the agent starts (its folder leads PYTHONPATH): install the framework
integrations' import hooks, then chain to any other ``sitecustomize`` on the path, which this
file shadows."""

import importlib.machinery
import importlib.util
import os
import sys

from broker.protocol import Env

if os.environ.get(Env.INTEGRATIONS, "on") != "off":
    from broker.runtime.integrations import HOOKS
    from broker.runtime.integrations.hooks import install_hooks

    install_hooks(HOOKS)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
