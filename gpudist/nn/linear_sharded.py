"""Megatron-style sharded-weight linear layers (sequence parallelism).

``x`` (shape ``(..., in_features)``) lies over ``P_x`` the standard way (tensor dim ``i``
split along partition axis ``i``). The *model axis* is the partition axis that splits the
weight; ``dim`` (default ``-2``, the sequence dim) is the tensor dim that is gathered or
scattered along it. Every other partition axis is a *replica* (data-parallel) axis: every
worker along it needs the same weight block.

AllGather form (:class:`DistributedLinearAllGather`, ``P_x.shape[-1] == 1``, model axis =
the axis of ``dim``, extent ``M``; W's rows split in ``M`` blocks)::

    x^ <- AG_dim x                 every worker of a model fibre gets the whole ``dim``
    W^, b^ <- B[home -> P_x] W, b  row block m of W and b (ZeRO: AllGather in the fibre)
    y = x^ W^T + b^                output split over P_y = transposed_partition(P_x, dim, -1)

  adjoint (autograd): ``dx = RS_dim(dy W^)``; ``dW = SumReduce(dy^T x^)`` over the replica
  axes into the home block (ZeRO: ReduceScatter in the fibre), ``db`` likewise.

ReduceScatter form (:class:`DistributedLinearReduceScatter`, ``P_x.shape[dim] == 1``, model
axis = the last axis (features split); W's columns split in ``M`` blocks)::

    W^ <- B[home -> P_x] W         column block m of W
    y^ = x W^^T                    partial sums over the model axis
    y  <- RS_dim y^                summed, ``dim`` split over the model axis
    y  = y + b                     the whole bias, once per output block (b broadcast to
                                   every worker of P_x)

  output split over ``transposed_partition(P_x, -1, dim)``; adjoint (autograd): ``dy^ =
  AG_dim dy``, ``dx = dy^ W^``, ``dW`` / ``db`` summed over the replica axes (and ``db`` over
  the model axis too) into their homes.

So AllGather -> (point-wise) -> ReduceScatter returns to the input partition (the transformer
MLP). The ``*Zero`` forms keep each block sharded over its replica fibre
(:class:`~gpudist.nn._zero.ZeroShards`, one per parameter), all-gathered on use.

Parameters are initialized like ``torch.nn.Linear`` from the current RNG state (same seed on
every rank: the sequential layer's values); ``global_state_dict()`` has the keys
``weight``/``bias`` of ``torch.nn.Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import AllGather, Broadcast, Plan, ReduceScatter
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters
from ._params import block, parameter
from ._zero import ZeroParameters, ZeroShards
from .transpose import transposed_partition

__all__ = ["DistributedLinearAllGather", "DistributedLinearAllGatherZero",
           "DistributedLinearReduceScatter", "DistributedLinearReduceScatterZero"]


# ----------------------------------------------------------------------- parameter storage
class _HomeStore:
    """A parameter's model-parallel blocks on the workers at replica coordinates 0
    (``P_home``, shaped like the parameter's block grid), broadcast over the replica axes
    on use (adjoint: SumReduce of the block gradients into the home)."""

    def __init__(self, P_x: Partition, split: dict[int, int], t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        axes = sorted(split)
        pshape = [1] * len(self.shape)
        for a in axes:
            pshape[split[a]] = P_x.shape[a]
        ranks = []
        for pc in np.ndindex(*pshape):  # C order of the parameter's grid = of the axes
            c = [0] * P_x.dim
            for a in axes:
                c[a] = pc[split[a]]
            ranks.append(P_x.world_rank_of(c))
        self.P_home = Partition(ranks, pshape, P_x.world)
        self.P_src = self.P_home.reshape([P_x.shape[a] if a in split else 1
                                          for a in range(P_x.dim)])
        self.bcast = Broadcast(self.P_src, P_x)
        self.placements = tuple(split.get(a, REPLICATE) for a in range(P_x.dim))
        self.value = parameter(block(t, self.P_home), t, len(self.shape))

    def plan(self, dtype: torch.dtype, device_type: str) -> Plan:
        return self.bcast.plan(TensorSpec(self.P_src, self.shape, dtype, device_type,
                                          self.placements))

    def use(self, p: torch.Tensor, plan: Plan) -> torch.Tensor:
        return self.bcast.apply_plan(p, plan)


class _ZeroStore:
    """A parameter's blocks sharded over their replica fibres (:class:`ZeroShards`),
    all-gathered within the fibre on use (adjoint: ReduceScatter of the gradients)."""

    def __init__(self, P_x: Partition, split: dict[int, int], t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.zero = ZeroShards(P_x, split, self.shape)
        self.value = torch.nn.Parameter(self.zero.shard(t))

    def plan(self, dtype: torch.dtype, device_type: str) -> Plan | None:
        return self.zero.plan(dtype, device_type)

    def use(self, p: torch.Tensor, plan: Plan) -> torch.Tensor:
        return self.zero.gather(p, plan)


# ----------------------------------------------------------------------- the layers
@dataclass
class _ShardedPlan:
    out: TensorSpec
    move: Plan            # the AllGather of x (AG form) or the ReduceScatter of y (RS form)
    weight: Plan | None
    bias: Plan | None


def _positive(name: str, layer: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise raised_everywhere(ValueError(f"{layer}: {name} must be a positive int, got {v!r}"))
    return v


class _ShardedLinear(DistributedModule):
    """What the sharded linear and expert layers share. ``experts``: a leading expert dim
    (split by partition axis 0) on the input and on both parameters."""

    autocast = "lower"  # torch.autocast runs it in its lower precision dtype

    gather_form = True   # AllGather form (else ReduceScatter form)
    zero = False
    experts = False

    def __init__(self, P_x: Partition, in_features: int, out_features: int,
                 bias: bool = True, *, dim: int = -2, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self._build(P_x, None, in_features, out_features, bias, dim, dtype, device)

    def _build(self, P_x: Partition, num_experts: int | None, in_features: int,
               out_features: int, bias: bool, dim: int, dtype, device) -> None:
        name = type(self).__name__
        in_features = _positive("in_features", name, in_features)
        out_features = _positive("out_features", name, out_features)
        E = _positive("num_experts", name, num_experts) if self.experts else None
        D, first = P_x.dim, (1 if self.experts else 0)
        if D < first + 2:
            raise raised_everywhere(PartitionError(
                f"{name}: the partition {P_x.shape} has {D} dimension(s); the input needs "
                f"{'(experts, tokens..., features)' if self.experts else '(..., features)'}"
                f", at least {first + 2}"))
        if isinstance(dim, bool) or not isinstance(dim, int) or not -D <= dim < D or \
                not first <= dim % D < D - 1:
            what = "the features (last) and the experts (first)" if self.experts else \
                "the features (last)"
            raise raised_everywhere(ValueError(
                f"{name}: dim={dim!r} must name a dim of the {D}-dimensional input other "
                f"than {what}"))
        k, f = dim % D, D - 1
        if self.gather_form:
            if P_x.shape[f] != 1:
                raise raised_everywhere(PartitionError(
                    f"{name}: the features must be whole on the input (P_x.shape[-1] == 1), "
                    f"got partition {P_x.shape}"))
            model, M = k, P_x.shape[k]
            if out_features < M:
                raise raised_everywhere(PartitionError(
                    f"{name}: out_features={out_features} is fewer than the {M} workers of "
                    f"model axis {k} of partition {P_x.shape} that split them"))
        else:
            if P_x.shape[k] != 1:
                raise raised_everywhere(PartitionError(
                    f"{name}: dim {k} must be whole on the input (P_x.shape[{k}] == 1; it "
                    f"is scattered over the features' axis), got partition {P_x.shape}"))
            model, M = f, P_x.shape[f]
            if in_features < M:
                raise raised_everywhere(PartitionError(
                    f"{name}: in_features={in_features} is fewer than the {M} workers of "
                    f"the feature axis of partition {P_x.shape} that split them"))
        if self.experts and E < P_x.shape[0]:
            raise raised_everywhere(PartitionError(
                f"{name}: num_experts={E} is fewer than the {P_x.shape[0]} workers of "
                f"partition axis 0 that split the experts"))
        self.P_x, self.dim, self.model_axis = P_x, k, model
        self.in_features, self.out_features, self.num_experts = in_features, out_features, E
        self.P_y = transposed_partition(P_x, k, f)  # world-collective
        self.setup(P_x, P_x.ranks)
        dev = device if device is not None else P_x.world.device
        w, b = self._init_params(E, in_features, out_features, bias, dtype, dev)
        e = 1 if self.experts else 0  # parameter dims shift by the expert dim
        wsplit = {0: 0} if self.experts else {}
        bsplit = dict(wsplit)
        if self.gather_form:
            wsplit[k] = e        # rows (out_features)
            bsplit[k] = e
        else:
            wsplit[f] = e + 1    # columns (in_features); the bias is whole
        Store = _ZeroStore if self.zero else _HomeStore
        self._wstore = Store(P_x, wsplit, w)
        self.weight = self._wstore.value
        self._bstore = Store(P_x, bsplit, b) if b is not None else None
        self.bias = self._bstore.value if b is not None else None
        stores = {"weight": self._wstore}
        if self._bstore is not None:
            stores["bias"] = self._bstore
        if self.zero:
            self._setup_shards({n: st.zero for n, st in stores.items()})
        else:
            self.root = Partition([self._wstore.P_home.ranks[0]], (1, 1), P_x.world)
            self.homes = {n: (st.P_home, st.shape) for n, st in stores.items()}
        if self.gather_form:
            self.move = AllGather(P_x, k, k)
        else:
            self.move = ReduceScatter(P_x, f, k)

    def _init_params(self, E, fi, fo, bias, dtype, dev):
        seq = torch.nn.Linear(fi, fo, bias=bias, dtype=dtype, device=dev)
        return seq.weight.detach(), (seq.bias.detach() if bias else None)

    # -- plans ------------------------------------------------------------------------
    def make_plan(self, spec: TensorSpec) -> _ShardedPlan:
        g, D = spec.global_shape, self.P_x.dim
        want = (f"[{self.num_experts}, " if self.experts else "[") + \
            "*, " * (D - 1 - self.experts) + f"{self.in_features}]"
        if not spec.standard or spec.ndim != D or g[-1] != self.in_features or (
                self.experts and g[0] != self.num_experts):
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected an input of shape {want} split the standard way "
                f"over partition {self.P_x.shape}, got {spec.describe()}"))
        dev, dt = spec.device_type, spec.dtype
        y = g[:-1] + (self.out_features,)
        if self.gather_form:
            move = self.move.plan(spec)
        else:
            pl = tuple(PARTIAL if i == D - 1 else i for i in range(D))
            move = self.move.plan(TensorSpec(self.P_x, y, dt, dev, pl))
        bias = self._bstore.plan(dt, dev) if self._bstore is not None else None
        return _ShardedPlan(TensorSpec(self.P_y, y, dt, dev), move,
                            self._wstore.plan(dt, dev), bias)

    # -- forward ----------------------------------------------------------------------
    def _local(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
               ) -> torch.Tensor:
        """``x w^T + b`` on the local blocks (per expert with a leading expert dim)."""
        if not self.experts:
            return F.linear(x, w, b)
        ne, mid = x.shape[0], tuple(x.shape[1:-1])
        n = int(np.prod(mid)) if mid else 1
        y = torch.bmm(x.reshape(ne, n, x.shape[-1]), w.transpose(1, 2))
        y = y.reshape((ne,) + mid + (w.shape[1],))
        return y if b is None else y + self._expert_bias(b, y.dim())

    @staticmethod
    def _expert_bias(b: torch.Tensor, nd: int) -> torch.Tensor:
        return b.reshape((b.shape[0],) + (1,) * (nd - 2) + (b.shape[1],))

    def run(self, x: torch.Tensor, plan: _ShardedPlan) -> torch.Tensor:
        w = self._wstore.use(self.weight, plan.weight)
        b = self._bstore.use(self.bias, plan.bias) if self._bstore is not None else None
        if self.gather_form:
            return self._local(self.move.apply_plan(x, plan.move), w, b)
        y = self.move.apply_plan(self._local(x, w, None), plan.move)
        if b is None:
            return y
        return y + (self._expert_bias(b, y.dim()) if self.experts else b)

    def extra_repr(self) -> str:
        e = f"{self.num_experts}, " if self.experts else ""
        return (f"{e}in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dim={self.dim}, partition={self.P_x.shape}")



class DistributedLinearAllGather(ShardedParameters, _ShardedLinear):
    """``torch.nn.Linear`` on ``x`` split over ``P_x`` (features whole): AllGather of
    ``dim`` over its axis (the model axis), local ``x W_m^T + b_m`` with row block ``m`` of
    W; output split over ``transposed_partition(P_x, dim, -1)``. Adjoint: ReduceScatter of
    ``dx``, parameter gradients summed over the replica axes into the home blocks (see the
    module docstring)."""


class DistributedLinearReduceScatter(ShardedParameters, _ShardedLinear):
    """``torch.nn.Linear`` on ``x`` whose features are split over the last axis of ``P_x``
    (``dim`` whole): local partial ``x_m W[:, m]^T``, ReduceScatter along ``dim`` over the
    feature axis, ``+ b``; output split over ``transposed_partition(P_x, -1, dim)``.
    Adjoint: AllGather of ``dy``, local adjoints, parameter gradients summed into the
    homes."""

    gather_form = False


class DistributedLinearAllGatherZero(ZeroParameters, _ShardedLinear):
    """:class:`DistributedLinearAllGather` with weight and bias blocks sharded ZeRO-style
    over their replica fibres: all-gathered on use, gradients reduce-scattered."""

    zero = True


class DistributedLinearReduceScatterZero(ZeroParameters, _ShardedLinear):
    """:class:`DistributedLinearReduceScatter` with weight blocks sharded ZeRO-style over
    their replica fibres and the (whole) bias over all of ``P_x``: all-gathered on use,
    gradients reduce-scattered."""

    gather_form = False
    zero = True

