"""``fleet launch --env K=V --secret K``: the values a launch gives a spec's envs and secrets.

A secret's value comes from the caller's environment, never from the command line (where the
shell's history and ``ps`` would show it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import SecretStr

from broker.spec import LaunchEnv, Problem, SpecError


def launch_env(envs: list[str] | None, secrets: list[str] | None,
               environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """``K=V`` pairs and secret names (each read from ``environ``); ``SpecError`` naming the
    flag and the fix for one without ``=`` or a secret the environment lacks."""
    environ = os.environ if environ is None else environ
    problems, values = [], {}
    for item in envs or []:
        name, eq, value = item.partition("=")
        if not eq:
            problems.append(Problem(field="--env", value=item, message=(
                f"write NAME=VALUE (like --env {name}=...); for a secret use --secret {name}")))
        else:
            values[name] = value
    sealed = {}
    for name in secrets or []:
        if name not in environ:
            problems.append(Problem(field="--secret", value=name, message=(
                f"{name} is not set in your environment; export {name}=... first "
                "(a secret's value never goes on the command line)")))
        else:
            sealed[name] = SecretStr(environ[name])
    if problems:
        raise SpecError(problems)
    return LaunchEnv(envs=values, secrets=sealed)
