"""Learning-rate scaling rules for the `elastic` batch mode.

With the allocator's global batch ``B`` and the batch ``B0`` the script's learning rate was tuned
for, the optimizer runs with ``lr * factor(B / B0)`` on top of whatever the script's scheduler sets:

- ``linear``: factor = s (Goyal et al. 2017; the rule for SGD with momentum);
- ``sqrt``:   factor = sqrt(s) (Krizhevsky 2014; the usual rule for Adam-type optimizers);
- ``none``:   factor = 1.

The `fixed` mode never scales: the global batch does not change, so neither does the maths.
"""

from __future__ import annotations

import math

LR_RULES = ("linear", "sqrt", "none")


def lr_factor(rule: str, global_batch: int, base_batch: int) -> float:
    """The learning-rate multiplier at ``global_batch`` for a rate tuned at ``base_batch``."""
    scale = global_batch / base_batch
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "none":
        return 1.0
    raise ValueError(f"lr_scaling={rule!r}; use one of {', '.join(LR_RULES)}")
