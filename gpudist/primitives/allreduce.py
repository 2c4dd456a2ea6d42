"""AllSumReduce over chosen partition axes: self-adjoint."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..partition import Partition
from .base import Primitive, PrimitiveModule


class AllSumReduceOp(Primitive):
    """F: every worker gets the sum of the blocks of the workers that share its coordinates
    off ``axes``. F* = F."""

    def __init__(self, P: Partition, axes: Sequence[int]) -> None:
        self.P, self.axes = P, tuple(axes)
        self.sub = P.sub(self.axes)

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P.active:
            return x
        y = x.contiguous().clone()
        if self.sub.group is not None:
            self.P.world.transport.all_reduce(y, self.sub.group).wait(self.P.world.timeout)
        return y

    def forward(self, x):
        return self._sum(x), None

    def adjoint(self, dy, state):
        return self._sum(dy)


class AllSumReduce(PrimitiveModule):
    """Sum over partition ``axes`` with the result on every worker; its own adjoint."""

    def __init__(self, P: Partition, axes: Sequence[int]) -> None:
        super().__init__()
        self.op = AllSumReduceOp(P, axes)
