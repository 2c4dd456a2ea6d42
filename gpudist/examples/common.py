"""What the examples share: the data-parallel gradient sum."""

from __future__ import annotations

import torch

from gpudist import PARTIAL, DistTensor, Partition, TensorSpec
from gpudist.primitives import AllSumReduce


class GradSum:
    """The data-parallel gradient sum: every parameter's local gradient (and the local
    loss) flattened into one vector, summed over the ranks by one AllSumReduce (its
    spec known to every rank: no metadata exchange), written back."""

    def __init__(self, P_x: Partition, net: torch.nn.Module) -> None:
        self.P = Partition(P_x.ranks, (P_x.size,), P_x.world)
        self.sum = AllSumReduce(self.P, [0])
        self.params = list(net.parameters())
        self.spec: TensorSpec | None = None

    @staticmethod
    def _real(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t) if t.is_complex() else t

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients in place; returns the summed loss (0-dim)."""
        parts = [self._real(p.grad).reshape(-1) for p in self.params]
        flat = torch.cat(parts + [loss.detach().reshape(1)])
        if self.spec is None:
            self.spec = TensorSpec(self.P, (flat.numel(),), flat.dtype, flat.device.type,
                                   (PARTIAL,))
        total = self.sum(DistTensor(flat, self.spec, check=False)).local
        at = 0
        for p in self.params:
            g = self._real(p.grad)
            g.copy_(total[at:at + g.numel()].view_as(g))
            at += g.numel()
        return total[at]
