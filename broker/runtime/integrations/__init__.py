"""Framework integrations the agent injects into a job's workers, so scripts need no change.

The agent puts :data:`BOOT_DIR` first on the workers' ``PYTHONPATH``; its ``sitecustomize``
calls :func:`broker.runtime.integrations.hooks.install_hooks` with :data:`HOOKS`. When a worker
imports a watched module (say ``transformers``), the integration module named for it is imported
and its ``install(module)`` is called once, after the watched module has finished loading. An
integration adds what the framework lacks (checkpoint on the agent's stop, resume from the latest
checkpoint at any world size, progress reports) through the framework's own extension points.

``FLEET_INTEGRATIONS=off`` in a job's environment turns all of this off.
"""

from __future__ import annotations

from pathlib import Path

BOOT_DIR = Path(__file__).parent / "boot"

# watched module -> the integration module whose ``install(module)`` it triggers. For transformers
# the Trainer's own module, not the package: a script that only tokenises never loads (nor pays
# for) it.
HOOKS: dict[str, str] = {
    "transformers.trainer": "broker.runtime.integrations.hf",
    "lightning.pytorch": "broker.runtime.integrations.lightning",
    "pytorch_lightning": "broker.runtime.integrations.lightning",
}
