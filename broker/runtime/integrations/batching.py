"""The fixed global batch the framework integrations keep: what it is, and how a rank splits it.

A framework's own gradient accumulation averages equal micro-batches, so ``W`` ranks reproduce
the mean-loss gradient of a global batch ``B`` exactly when each takes ``B / W`` samples as ``G``
equal micro-batches; :func:`split` picks them, :func:`saved_batch` finds the batch a resumed job
already runs at.
"""

from __future__ import annotations

from broker.runtime.checkpoint_stores import open_store


def split(share: int, cap: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps): equal micro-batches of at most ``cap`` samples that
    make up ``share``, as few as possible."""
    steps = -(-share // max(cap, 1))
    while share % steps:
        steps += 1
    return share // steps, steps


def saved_batch(uri: str | None) -> int | None:
    """The global batch of the latest complete checkpoint in ``uri``, if any."""
    if uri is None:
        return None
    store = open_store(uri)
    step = store.latest()
    return None if step is None else int(store.manifest(step)["global_batch_size"])
