"""Distributed batch normalization over a partitioned (N, C, ...) tensor.

Per-channel sums over the local block are AllSumReduced over P_x, so every worker
normalizes with the global batch statistics; gamma/beta live on the first worker and are
broadcast. The adjoint comes from autograd through AllSumReduce (self-adjoint) and Broadcast.
"""

from __future__ import annotations

import torch

from ..errors import PartitionError
from ..partition import Partition
from ..primitives import AllSumReduceOp, BroadcastOp
from ._params import parameter
from ._reduce import count_over


class DistributedBatchNorm(torch.nn.Module):
    """BatchNorm over dims (0, 2, 3, ...) of a tensor partitioned by ``P_x`` (P_x.shape[1]=1)."""

    def __init__(self, P_x: Partition, num_features: int, eps: float = 1e-5,
                 momentum: float = 0.1, affine: bool = True, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if P_x.dim < 2 or P_x.shape[1] != 1:
            raise PartitionError(f"DistributedBatchNorm: channel dimension must not be "
                                 f"partitioned (P_x {P_x.shape})")
        self.P_x, self.eps, self.momentum = P_x, eps, momentum
        dev = device if device is not None else P_x.world.device
        kw = {"dtype": dtype or torch.get_default_dtype(), "device": dev}
        self.root = Partition([P_x.ranks[0]], (1,), P_x.world)
        ones, zeros = torch.ones(num_features, **kw), torch.zeros(num_features, **kw)
        self.affine = affine
        if affine:
            self.weight = parameter(ones if self.root.active else None, ones, 1)
            self.bias = parameter(zeros if self.root.active else None, ones, 1)
            dst = P_x.reshape((P_x.size,))
            self._bcast = BroadcastOp(self.root, dst, shape=(num_features,))
        self.register_buffer("running_mean", zeros.clone())
        self.register_buffer("running_var", ones.clone())
        self._allsum = AllSumReduceOp(P_x, tuple(range(P_x.dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.training:
            n = count_over(self.P_x, x.numel() // x.shape[1], x.device)
            sums = self._allsum(torch.stack([x.sum(dims), (x * x).sum(dims)]))
            mean = sums[0] / n
            var = sums[1] / n - mean * mean
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean.detach())
                self.running_var.mul_(1 - m).add_(m * var.detach() * n / max(n - 1, 1))
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            g, b = self._bcast(self.weight), self._bcast(self.bias)
            y = y * g.reshape(shape) + b.reshape(shape)
        return y
