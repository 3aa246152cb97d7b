"""The gradient noise scale, measured as Pollux and AdaptDL do: from each replica's gradient and
the all-reduced one, with no extra backward pass.

A gradient averaged over ``n`` samples has ``E|g_n|^2 = |G|^2 + tr(S) / n`` (``G`` the true
gradient, ``S`` the per-sample covariance). One rank's gradient over its ``b`` samples and the
all-reduced gradient over all ``B`` give two such equations, solved for ``|G|^2`` and ``tr(S)``;
their ratio ``tr(S) / |G|^2`` is the noise scale in samples (McCandlish et al., 2018): the batch
size beyond which a larger batch buys little progress per sample. Both terms are smoothed over
steps (an exponential average of each, then the ratio), as AdaptDL does, because one step's
estimate is noisy. A job on one replica has no second batch in a step: it compares the mean
gradients of two consecutive steps instead (``update_pair``, as AdaptDL does), each over the
step's batch, against their average over both; the parameters move between the two, which
biases the estimate slightly, and the broker only needs the noise scale's order of magnitude.
"""

from __future__ import annotations

import torch


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as one vector, half precision upcast to float32 for the sums."""
    flat = x.detach().reshape(-1)
    return flat if flat.dtype in (torch.float32, torch.float64) else flat.float()


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """``|x|^2`` as one dot product: no squared copy of the gradient is allocated, which at a
    step's scale costs more than the sum itself."""
    flat = _flat(x)
    return torch.dot(flat, flat)


class NoiseScale:
    """Exponential averages of ``|G|^2`` and ``tr(S)``, kept as tensors on the gradients' device
    so that a step never waits for the device; :attr:`value` reads them (one sync)."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._sqr: torch.Tensor | None = None
        self._var: torch.Tensor | None = None

    def update(self, local_sq: torch.Tensor, local_n: int, global_sq: torch.Tensor,
               global_n: int) -> None:
        """One step: ``local_sq``, the squared norm of this rank's mean gradient over its
        ``local_n`` samples; ``global_sq``, that of the all-reduced mean over ``global_n``."""
        if not 0 < local_n < global_n:
            return
        var = (local_sq - global_sq) / (1.0 / local_n - 1.0 / global_n)
        sqr = (global_n * global_sq - local_n * local_sq) / (global_n - local_n)
        d = self.decay
        self._var = var if self._var is None else d * self._var + (1 - d) * var
        self._sqr = sqr if self._sqr is None else d * self._sqr + (1 - d) * sqr

    def update_pair(self, previous: torch.Tensor, current: torch.Tensor, n: int) -> None:
        """One step of a single-replica job: ``previous`` and ``current``, the flattened mean
        gradients of two consecutive steps of ``n`` samples each."""
        pp, cc = squared_norm(previous), squared_norm(current)
        pc = torch.dot(_flat(previous), _flat(current))
        # |(p + c) / 2|^2 expanded, so the mean of the two is never built
        self.update((pp + cc) / 2, n, (pp + cc + 2 * pc) / 4, 2 * n)

    @property
    def value(self) -> float | None:
        """The noise scale in samples, once both averages are positive (else None)."""
        if self._var is None or self._sqr is None:
            return None
        var, sqr = float(self._var), float(self._sqr)
        if not (var > 0 and sqr > 0):
            return None
        return var / sqr
