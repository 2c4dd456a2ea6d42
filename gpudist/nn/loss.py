"""Distributed losses: local loss summed over the partition into the root worker.

F(x) = sum over workers of loss(x_local, target_local) (divided by the global count for
"mean"), held by P_x's first worker; zero-volume elsewhere. Adjoint (autograd): Broadcast
of the loss gradient back, then the local loss adjoints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..partition import Partition
from ..primitives import SumReduceOp
from ._reduce import count_over

_LOSSES: dict[str, Callable] = {"mse": F.mse_loss, "cross_entropy": F.cross_entropy,
                                "l1": F.l1_loss, "nll": F.nll_loss}


class DistributedLoss(torch.nn.Module):
    """``loss`` ("mse", "cross_entropy", "l1", "nll" or a callable taking ``reduction``) over
    a tensor partitioned by ``P_x``; the scalar lands on ``P_x``'s first worker.

    For "mean", the divisor is the global number of targets (cross-entropy/nll) or elements.
    Every rank calls ``backward()`` on what it gets (a zero-volume tensor off the root).
    """

    def __init__(self, P_x: Partition, loss: str | Callable = "mse",
                 reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        self.P_x, self.reduction = P_x, reduction
        self.fn = _LOSSES[loss] if isinstance(loss, str) else loss
        self.root = Partition([P_x.ranks[0]], (1,) * P_x.dim, P_x.world)
        self._sum = SumReduceOp(P_x, self.root, shape=(1,) * P_x.dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x.sum().reshape((1,) * x.dim())[:0]
        local = self.fn(x, target, reduction="sum").reshape((1,) * self.P_x.dim)
        total = self._sum(local)
        if self.reduction == "mean":
            n = count_over(self.P_x, target.numel(), x.device)
            total = total / n
        return total.reshape(()) if total.numel() == 1 else total.reshape(-1)
