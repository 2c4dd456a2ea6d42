"""Distributed affine layer with a 2-D partitioned weight.

x on P_x = (1, P_fi) -> Broadcast to P_w = (P_fo, P_fi) -> local y_ij = x_j W_ij^T (+ b_i on
the first column of P_w only, so the bias is counted once) -> SumReduce over the P_fi axis
to P_y = (1, P_fo). Adjoint (by autograd): Broadcast dy back, local adjoints, SumReduce dx.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError
from ..partition import Partition
from ..primitives import BroadcastOp, RepartitionOp, SumReduceOp
from ._params import block, connect, parameter


class DistributedLinear(torch.nn.Module):
    """``y = x W^T + b`` with W split in (P_fo, P_fi) blocks over ``P_w``.

    Parameters are initialized like ``torch.nn.Linear`` from the current RNG state (equal
    seeds on every rank give the sequential layer's values), each worker keeping its block.
    """

    def __init__(self, P_x: Partition, P_y: Partition, P_w: Partition, in_features: int,
                 out_features: int, bias: bool = True, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if P_w.dim != 2 or P_x.dim != 2 or P_y.dim != 2:
            raise PartitionError("DistributedLinear: P_x, P_y, P_w must be 2-D")
        fo, fi = P_w.shape
        if P_x.shape != (1, fi) or P_y.shape != (1, fo):
            raise PartitionError(
                f"DistributedLinear: P_w {P_w.shape} needs P_x of shape (1, {fi}) and P_y of "
                f"shape (1, {fo}); got {P_x.shape} and {P_y.shape}")
        self.P_x, self.P_y, self.P_w = P_x, P_y, P_w
        self.in_features, self.out_features = in_features, out_features
        dev = device if device is not None else P_w.world.device
        seq = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=dev)
        self.weight = parameter(block(seq.weight, P_w), seq.weight, 2)
        # bias lives on column 0 of P_w, as a 1-D tensor over P_b = (P_fo,)
        self.P_b = Partition([P_w.world_rank_of((i, 0)) for i in range(fo)], (fo,), P_w.world)
        self.bias = parameter(block(seq.bias, self.P_b), seq.weight, 1) if bias else None
        self._x_bcast = BroadcastOp(P_x, P_w)
        self._y_reduce = SumReduceOp(P_w, P_y, transpose_dst=True)
        root2 = Partition([P_w.ranks[0]], (1, 1), P_w.world)
        root1 = Partition([P_w.ranks[0]], (1,), P_w.world)
        self.root = root2
        self._collect_w = RepartitionOp(P_w, root2, (out_features, in_features))
        self._collect_b = RepartitionOp(self.P_b, root1, (out_features,)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.P_x.active and x.dim() < 2:
            raise ShapeError(f"DistributedLinear: expected (..., batch, features) blocks, got "
                             f"{tuple(x.shape)}")
        xw = self._x_bcast(x)
        if self.P_w.active:
            y = F.linear(xw, self.weight)
            if self.bias is not None:
                y = y + self.bias if self.P_b.active else connect(y, self.bias)
        else:
            y = xw  # zero-volume, keeps the graph connected
        return self._y_reduce(y)

    # -- global state ---------------------------------------------------------
    def load_global_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Keep this rank's blocks of a sequential ``torch.nn.Linear`` state dict."""
        with torch.no_grad():
            self.weight.data = block(sd["weight"], self.P_w).to(self.weight)
            if self.bias is not None:
                self.bias.data = block(sd["bias"], self.P_b).to(self.weight)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full weight/bias on P_w's first worker, ``{}`` elsewhere."""
        w = self._collect_w(self.weight.detach())
        b = self._collect_b(self.bias.detach()) if self.bias is not None else None
        if not self.root.active:
            return {}
        out = {"weight": w}
        if b is not None:
            out["bias"] = b
        return out

    def global_grads(self) -> dict[str, torch.Tensor]:
        """Collective: full gradients on P_w's first worker, ``{}`` elsewhere."""
        def g(p):
            return p.grad if p.grad is not None else torch.zeros_like(p)
        w = self._collect_w(g(self.weight))
        b = self._collect_b(g(self.bias)) if self.bias is not None else None
        if not self.root.active:
            return {}
        return {"weight": w, **({"bias": b} if b is not None else {})}
