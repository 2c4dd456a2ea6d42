"""Distributed convolution with a spatially partitioned input.

Forward: x <- H x (halo exchange, global zero padding added at the boundary);
w, b <- Broadcast(root -> P_x); y = conv(x, w, b) with padding 0, locally on every worker.
Adjoint (by autograd): local conv adjoints, SumReduce of dw/db to the root, H* adds the
halo gradients back into the neighbours' bulk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError
from ..halo import HaloExchange
from ..partition import Partition
from ..primitives import BroadcastOp
from ._params import parameter

_CONV = {1: (F.conv1d, torch.nn.Conv1d), 2: (F.conv2d, torch.nn.Conv2d),
         3: (F.conv3d, torch.nn.Conv3d)}


def _tuple(v, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, Sequence) else (int(v),) * n


class DistributedConvNd(torch.nn.Module):
    """N-D convolution of a tensor partitioned over ``P_x`` (shape ``(1, 1, P_0, ...)``).

    Weights and bias live on ``P_x``'s first worker (zero-volume parameters elsewhere).
    Parameters are initialized like the sequential torch layer from the current RNG state,
    so equal seeds on every rank give the sequential layer's values.
    """

    spatial: int = 2

    def __init__(self, P_x: Partition, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                 bias: bool = True, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        n = self.spatial
        if P_x.dim != n + 2:
            raise PartitionError(f"{type(self).__name__}: the input partition must have "
                                 f"{n + 2} dimensions (N, C, spatial...), got {P_x.shape}")
        if P_x.shape[1] != 1:
            raise PartitionError(f"{type(self).__name__}: channel-partitioned inputs are not "
                                 f"supported yet (P_x {P_x.shape})")
        self.P_x = P_x
        self.k, self.s = _tuple(kernel_size, n), _tuple(stride, n)
        self.p, self.d = _tuple(padding, n), _tuple(dilation, n)
        self.in_channels, self.out_channels = in_channels, out_channels
        dev = device if device is not None else P_x.world.device
        seq = _CONV[n][1](in_channels, out_channels, self.k, self.s, self.p, self.d,
                          bias=bias, dtype=dtype, device=dev)
        self.root = Partition([P_x.ranks[0]], (1,) * (n + 2), P_x.world)
        on_root = self.root.active
        self.weight = parameter(seq.weight if on_root else None, seq.weight, n + 2)
        self.bias = parameter(seq.bias if on_root else None, seq.weight, 1) if bias else None
        self._w_bcast = BroadcastOp(self.root, P_x, shape=tuple(seq.weight.shape))
        if bias:
            root_b = Partition([P_x.ranks[0]], (1,), P_x.world)
            self._b_bcast = BroadcastOp(root_b, P_x.reshape((P_x.size,)), shape=(out_channels,))
        self.halo = HaloExchange(P_x, (1, 1) + self.k, (1, 1) + self.s,
                                 (0, 0) + self.p, (1, 1) + self.d, pad_value=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x
        if x.dim() != self.spatial + 2 or x.shape[1] != self.in_channels:
            raise ShapeError(f"{type(self).__name__}: expected (N, {self.in_channels}, ...) "
                             f"with {self.spatial} spatial dims, got {tuple(x.shape)}")
        xh = self.halo(x)
        w = self._w_bcast(self.weight)
        b = self._b_bcast(self.bias) if self.bias is not None else None
        return _CONV[self.spatial][0](xh, w, b, self.s, 0, self.d)

    # -- global state ---------------------------------------------------------
    def load_global_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take this rank's share of a sequential layer's state dict (only the root keeps it)."""
        with torch.no_grad():
            if self.root.active:
                self.weight.data = sd["weight"].detach().clone().to(self.weight)
                if self.bias is not None:
                    self.bias.data = sd["bias"].detach().clone().to(self.weight)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters on the root worker, ``{}`` elsewhere."""
        if not self.root.active:
            return {}
        out = {"weight": self.weight.detach().clone()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out


class DistributedConv1d(DistributedConvNd):
    spatial = 1


class DistributedConv2d(DistributedConvNd):
    spatial = 2


class DistributedConv3d(DistributedConvNd):
    spatial = 3
