"""Distributed pooling: x <- H x (boundary padded with -inf for max, 0 for average), then
the torch pooling op with padding 0 on every worker. Adjoint by autograd (pool*, then H*)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import PartitionError
from ..halo import HaloExchange
from ..partition import Partition
from .conv import _tuple

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


class _DistributedPoolNd(torch.nn.Module):
    spatial = 2
    kind = "max"

    def __init__(self, P_x: Partition, kernel_size: int | Sequence[int],
                 stride: int | Sequence[int] | None = None, padding: int | Sequence[int] = 0,
                 dilation: int | Sequence[int] = 1) -> None:
        super().__init__()
        n = self.spatial
        if P_x.dim != n + 2:
            raise PartitionError(f"{type(self).__name__}: the input partition must have "
                                 f"{n + 2} dimensions, got {P_x.shape}")
        self.P_x = P_x
        self.k = _tuple(kernel_size, n)
        self.s = _tuple(stride if stride is not None else kernel_size, n)
        self.p, self.d = _tuple(padding, n), _tuple(dilation, n)
        if self.kind == "avg" and any(x != 1 for x in self.d):
            raise ValueError("average pooling has no dilation")
        fill = float("-inf") if self.kind == "max" else 0.0
        self.halo = HaloExchange(P_x, (1, 1) + self.k, (1, 1) + self.s, (0, 0) + self.p,
                                 (1, 1) + self.d, pad_value=fill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x
        xh = self.halo(x)
        if self.kind == "max":
            return _MAX[self.spatial](xh, self.k, self.s, 0, self.d)
        return _AVG[self.spatial](xh, self.k, self.s, 0)


class DistributedMaxPool1d(_DistributedPoolNd):
    spatial, kind = 1, "max"


class DistributedMaxPool2d(_DistributedPoolNd):
    spatial, kind = 2, "max"


class DistributedMaxPool3d(_DistributedPoolNd):
    spatial, kind = 3, "max"


class DistributedAvgPool1d(_DistributedPoolNd):
    spatial, kind = 1, "avg"


class DistributedAvgPool2d(_DistributedPoolNd):
    spatial, kind = 2, "avg"


class DistributedAvgPool3d(_DistributedPoolNd):
    spatial, kind = 3, "avg"
