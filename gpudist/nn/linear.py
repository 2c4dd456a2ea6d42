"""Distributed affine layer with a 2-D partitioned weight.

x on P_x = (1, P_fi) -> Broadcast to P_w = (P_fo, P_fi) -> local y_ij = x_j W_ij^T (+ b_i on
the first column of P_w only, so the bias is counted once) -> SumReduce over the P_fi axis
to P_y = (1, P_fo). Adjoint (by autograd): Broadcast dy back, local adjoints, SumReduce dx.
Inputs may carry leading batch dims: (..., batch, features), the last dim split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import Broadcast, Plan, SumReduce
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters
from ._params import block, connect, parameter


@dataclass
class _LinearPlan:
    out: TensorSpec
    x_bcast: Plan
    y_reduce: Plan


class DistributedLinear(ShardedParameters, DistributedModule):
    """``y = x W^T + b`` with W split in (P_fo, P_fi) blocks over ``P_w``.

    Parameters are initialized like ``torch.nn.Linear`` from the current RNG state (equal
    seeds on every rank give the sequential layer's values), each worker keeping its block.
    """

    autocast = "lower"  # torch.autocast runs it in its lower precision dtype

    def __init__(self, P_x: Partition, P_y: Partition, P_w: Partition, in_features: int,
                 out_features: int, bias: bool = True, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if P_w.dim != 2 or P_x.dim != 2 or P_y.dim != 2:
            raise raised_everywhere(PartitionError("DistributedLinear: P_x, P_y, P_w must be "
                                                   "2-D"))
        fo, fi = P_w.shape
        if P_x.shape != (1, fi) or P_y.shape != (1, fo):
            raise raised_everywhere(PartitionError(
                f"DistributedLinear: P_w {P_w.shape} needs P_x of shape (1, {fi}) and P_y of "
                f"shape (1, {fo}); got {P_x.shape} and {P_y.shape}"))
        self.P_x, self.P_y, self.P_w = P_x, P_y, P_w
        self.in_features, self.out_features = in_features, out_features
        self.setup(P_x, set(P_x.ranks) | set(P_y.ranks) | set(P_w.ranks))
        dev = device if device is not None else P_w.world.device
        seq = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=dev)
        self.weight = parameter(block(seq.weight, P_w), seq.weight, 2)
        # bias lives on column 0 of P_w, as a 1-D tensor over P_b = (P_fo,)
        self.P_b = Partition([P_w.world_rank_of((i, 0)) for i in range(fo)], (fo,), P_w.world)
        self.bias = parameter(block(seq.bias, self.P_b), seq.weight, 1) if bias else None
        self.root = Partition([P_w.ranks[0]], (1, 1), P_w.world)
        self.homes = {"weight": (P_w, (out_features, in_features))}
        if bias:
            self.homes["bias"] = (self.P_b, (out_features,))
        self.x_bcast = Broadcast(P_x, P_w)
        self.y_reduce = SumReduce(P_w, P_y, transpose_dst=True)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, P_x={self.P_x.shape}, P_y={self.P_y.shape}, "
                f"P_w={self.P_w.shape}")

    def make_plan(self, spec: TensorSpec) -> _LinearPlan:
        g = spec.global_shape
        if spec.ndim < 2 or spec.placements[1] not in (spec.ndim - 1, REPLICATE):
            raise raised_everywhere(ShapeError(
                f"DistributedLinear: expected (..., batch, features) blocks, got "
                f"{spec.describe()}"))
        if g[-1] != self.in_features:
            raise raised_everywhere(ShapeError(
                f"DistributedLinear: the input has {g[-1]} features, the layer takes "
                f"{self.in_features}"))
        nd = len(g)
        xspec = TensorSpec(self.P_x, g, spec.dtype, spec.device_type, (REPLICATE, nd - 1))
        y = g[:-1] + (self.out_features,)
        yspec = TensorSpec(self.P_w, y, spec.dtype, spec.device_type, (nd - 1, PARTIAL))
        out = TensorSpec(self.P_y, y, spec.dtype, spec.device_type,
                         None if nd == 2 else (REPLICATE, nd - 1))
        return _LinearPlan(out, self.x_bcast.plan(xspec), self.y_reduce.plan(yspec))

    def spec_of(self, x):
        from ..meta import derive_spec  # (..., batch, features): only features split

        return derive_spec(self.P_in, x, self.name, self.world_group,
                           lambda nd: (REPLICATE, nd - 1), self._instance())

    def run(self, x: torch.Tensor, plan: _LinearPlan) -> torch.Tensor:
        xw = self.x_bcast.apply_plan(x, plan.x_bcast)
        if self.P_w.active:
            here = self.bias is not None and self.P_b.active
            y = F.linear(xw, self.weight, self.bias if here else None)
            if self.bias is not None and not here:
                y = connect(y, self.bias)
        else:
            # outside P_w: the output still depends on the (zero-volume) parameters, so
            # it requires grad wherever torch's would (a loss on this rank can backward)
            y = connect(xw.new_zeros(plan.y_reduce.spec.local_shape), xw, self.weight,
                        self.bias)
        return self.y_reduce.apply_plan(y, plan.y_reduce)
