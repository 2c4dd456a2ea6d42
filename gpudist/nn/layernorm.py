"""Distributed layer norm and RMS norm over the trailing (possibly partitioned) dims.

``x`` lies over ``P_x`` the standard way; ``normalized_shape`` is its last ``k`` dims. The
last ``k`` partition axes (*model axes*) split the normalized dims, the first ``m = P_x.dim
- k`` (*replica axes*) split the rows: every worker along them needs the same parameter
block.

Forward (one row = one entry of the leading ``m`` dims):

* each worker, per row of its block: count ``n_i``, mean ``m_i`` and ``M2_i = n_i var_i``
  (``torch.var_mean``);
* ``s = A (n_i m_i, M2_i, n_i m_i^2)``: one AllSumReduce over the model axes, in float64;
  ``mean = s_0 / n``, ``var = (s_1 + s_2 - n mean^2) / n`` (Chan's merge:
  ``M2 = sum M2_i + sum n_i (m_i - mean)^2``, no cancellation of large means);
* ``xhat = (x - mean) rsqrt(var + eps)``, ``y = xhat w + b`` with this worker's block of
  ``w``/``b``: :class:`DistributedLayerNorm` keeps the blocks on the workers at replica
  coordinates 0 and broadcasts them over the replica axes; the ``Zero`` layers shard each
  block over its replica workers (:class:`ZeroShards`) and all-gather it on use.

Adjoint (hand-written for ``xhat``, one more AllSumReduce, self-adjoint):
``g = dy w``, ``dx = rsqrt(var + eps) (g - mean(g) - xhat mean(g xhat))`` with the means
over the normalized dims; ``dw = sum_rows dy xhat``, ``db = sum_rows dy`` locally, then the
Broadcast's adjoint (SumReduce over the replica axes into the home block) or the
AllGather's (ReduceScatter within the fibre: the shard's summed gradient).

RMS norm (``torch.nn.RMSNorm``): ``r = rsqrt(mean(x^2) + eps)``, ``xhat = x r``, ``y = xhat
w``; adjoint ``dx = r (g - xhat mean(g xhat))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import AllSumReduce, Broadcast, Plan
from ..primitives.base import layer_adjoint
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters
from ._params import block, parameter
from ._zero import ZeroParameters, ZeroShards

_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------- the layers
@dataclass
class _NormPlan:
    out: TensorSpec
    fwd: Plan     # AllSumReduce of the forward statistics
    bwd: Plan     # ... of the backward sums
    params: Plan | None
    n: int        # entries per row


def _normalized(shape, name: str) -> tuple[int, ...]:
    vals = [shape] if isinstance(shape, int) else list(shape)
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                           for v in vals):
        raise raised_everywhere(ValueError(
            f"{name}: normalized_shape must be a positive int or a non-empty sequence of "
            f"them, got {shape!r}"))
    return tuple(vals)


class _Norm(DistributedModule):
    """What the layer norms share: statistics, the normalization, the affine step."""

    live_options = ("eps",)

    rms = False
    autocast = "probe"  # torch.autocast: layer_norm in float32 on CUDA, not on the CPU

    def autocast_probe(self, x):
        n = len(self.normalized_shape)
        return (F.rms_norm if self.rms else F.layer_norm)(x, x.shape[x.dim() - n:])

    def __init__(self, P_x: Partition, normalized_shape: int | Sequence[int],
                 eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        seq = self._build(P_x, normalized_shape, eps, elementwise_affine, bias, dtype, device)
        self._place(seq, ("weight", "bias"))

    def _build(self, P_x: Partition, normalized_shape, eps, elementwise_affine: bool,
               bias: bool, dtype, device) -> torch.nn.Module:
        name = type(self).__name__
        shape = _normalized(normalized_shape, name)
        k = len(shape)
        if k > P_x.dim:
            raise raised_everywhere(PartitionError(
                f"{name}: normalized_shape {list(shape)} has {k} dimensions but the "
                f"partition {P_x.shape} only {P_x.dim}"))
        m = P_x.dim - k
        for j, n in enumerate(shape):
            if n < P_x.shape[m + j]:
                raise raised_everywhere(PartitionError(
                    f"{name}: normalized dimension {j} has {n} entries, fewer than the "
                    f"{P_x.shape[m + j]} workers of partition {P_x.shape} that split it"))
        self.P_x, self.normalized_shape, self.eps = P_x, shape, eps
        self.elementwise_affine, self.m = elementwise_affine, m
        self.setup(P_x, P_x.ranks)
        dev = device if device is not None else P_x.world.device
        if self.rms:
            seq = torch.nn.RMSNorm(shape, eps, elementwise_affine, dtype=dtype, device=dev)
        else:
            seq = torch.nn.LayerNorm(shape, eps, elementwise_affine, bias, dtype=dtype,
                                     device=dev)
        self.stats = AllSumReduce(P_x, range(m, P_x.dim))
        return seq

    # -- plans ------------------------------------------------------------------------
    def make_plan(self, spec: TensorSpec) -> _NormPlan:
        g, k, m = spec.global_shape, len(self.normalized_shape), self.m
        if not spec.standard or spec.ndim != self.P_x.dim or g[m:] != self.normalized_shape:
            raise raised_everywhere(ShapeError(
                f"{self.name}: given normalized_shape={list(self.normalized_shape)}, expected "
                f"an input of shape [{'*, ' * m}{', '.join(map(str, self.normalized_shape))}] "
                f"split the standard way over partition {self.P_x.shape}, got "
                f"{spec.describe()}"))
        if not spec.dtype.is_floating_point:
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected a floating point input, got {spec.dtype}"))
        dev, pl = spec.device_type, tuple(range(1, m + 1)) + (PARTIAL,) * k
        nf, nb = (1, 1) if self.rms else (3, 2)
        fwd = self.stats.plan(TensorSpec(self.P_x, (nf,) + g[:m], torch.float64, dev, pl))
        bwd = self.stats.plan(TensorSpec(self.P_x, (nb,) + g[:m], torch.float64, dev, pl))
        return _NormPlan(spec, fwd, bwd, self.param_plan(dev), math.prod(self.normalized_shape))

    def param_plan(self, device_type: str) -> Plan | None:
        raise NotImplementedError

    def affine(self, plan: _NormPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This worker's blocks of (weight, bias), shaped like its normalized block."""
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------------
    def run(self, x: torch.Tensor, plan: _NormPlan) -> torch.Tensor:
        rows = tuple(x.shape[:self.m])
        R = math.prod(rows)
        L = math.prod(x.shape[self.m:])
        eps = self.eps
        if eps is None:  # torch's: the eps of the dtype it computes in (float32 for halves)
            eps = torch.finfo(torch.float32 if x.dtype in _HALF else x.dtype).eps
        xhat = _Normalize.apply(x.reshape(R, L), self.stats, plan.fwd, plan.bwd, rows, plan.n,
                                float(eps), self.rms).view(x.shape)
        w, b = self.affine(plan)
        y = xhat
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        return y

    def extra_repr(self) -> str:
        return (f"{list(self.normalized_shape)}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, partition={self.P_x.shape}")


class _Normalize(torch.autograd.Function):
    """xhat = (x - mean) / sqrt(var + eps) (or x / sqrt(mean(x^2) + eps)) per row of the
    (rows, entries) block, statistics summed over the model axes; hand-written adjoint."""

    @staticmethod
    def forward(ctx, x, allsum: AllSumReduce, fwd: Plan, bwd: Plan, rows: tuple, n: int,
                eps: float, rms: bool):  # type: ignore[override]
        acc = torch.float32 if x.dtype in _HALF else x.dtype
        xa = x.to(acc)
        R, L = x.shape
        f64 = torch.float64
        if rms:
            loc = torch.zeros(1, R, dtype=f64, device=x.device)
            if L:
                loc[0] = xa.square().sum(1, dtype=f64)
        else:
            loc = torch.zeros(3, R, dtype=f64, device=x.device)
            if L and R:  # (torch warns for var_mean over no rows)
                var_i, mean_i = torch.var_mean(xa, dim=1, correction=0)
                mean_i, var_i = mean_i.to(f64), var_i.to(f64)
                loc[0] = L * mean_i
                loc[1] = L * var_i
                loc[2] = L * mean_i * mean_i
        tot = allsum.apply_plan(loc.view((loc.shape[0],) + rows), fwd).view(loc.shape[0], R)
        if rms:
            invstd = torch.rsqrt(tot[0] / n + eps).to(acc)
            xhat = xa * invstd[:, None]
        else:
            mean = tot[0] / n
            var = ((tot[1] + tot[2] - n * mean * mean) / n).clamp_min(0)
            invstd = torch.rsqrt(var + eps).to(acc)
            xhat = (xa - mean.to(acc)[:, None]).mul_(invstd[:, None])
        ctx.save_for_backward(xhat, invstd)
        ctx.allsum, ctx.bwd, ctx.rows, ctx.n, ctx.rms, ctx.dtype = allsum, bwd, rows, n, rms, \
            x.dtype
        return xhat.to(x.dtype)

    @staticmethod
    @layer_adjoint  # double backward: torch's clear error; failures posted to the world
    def backward(ctx, dxhat):  # type: ignore[override]
        xhat, invstd = ctx.saved_tensors
        g = dxhat.to(xhat.dtype)
        R, L = g.shape
        f64 = torch.float64
        loc = torch.zeros(1 if ctx.rms else 2, R, dtype=f64, device=g.device)
        if L:
            loc[-1] = (g * xhat).sum(1, dtype=f64)
            if not ctx.rms:
                loc[0] = g.sum(1, dtype=f64)
        tot = ctx.allsum.apply_plan(loc.view((loc.shape[0],) + ctx.rows), ctx.bwd).view(
            loc.shape[0], R)
        n, acc = ctx.n, xhat.dtype
        dx = g - xhat * (tot[-1] / n).to(acc)[:, None]
        if not ctx.rms:
            dx = dx - (tot[0] / n).to(acc)[:, None]
        dx = dx.mul_(invstd[:, None])
        return dx.to(ctx.dtype), None, None, None, None, None, None, None


class _BroadcastAffine:
    """Parameters as blocks on the workers at replica coordinates 0 (``P_home``, shaped like
    the normalized dims' partition), broadcast over the replica axes on use."""

    def _place(self, seq: torch.nn.Module, names: Sequence[str]) -> None:
        P_x, m = self.P_x, self.m
        b = P_x.shape[m:]
        ranks = [P_x.world_rank_of((0,) * m + c) for c in np.ndindex(*b)]
        self.P_home = Partition(ranks, b, P_x.world)
        self.root = Partition([ranks[0]], (1,) * len(b), P_x.world)
        self.homes = {}
        for k in names:
            p = getattr(seq, k, None)
            if p is None:
                setattr(self, k, None)
                continue
            setattr(self, k, parameter(block(p, self.P_home), p, len(b)))
            self.homes[k] = (self.P_home, self.normalized_shape)
        self.P_src = self.P_home.reshape((1,) * m + b)
        self.params = Broadcast(self.P_src, P_x) if self.homes else None

    def param_plan(self, device_type: str) -> Plan | None:
        if self.params is None:
            return None
        p = next(getattr(self, k) for k in self.homes)
        k = len(self.normalized_shape)
        return self.params.plan(TensorSpec(self.P_src, self.normalized_shape, p.dtype,
                                           device_type, (REPLICATE,) * self.m + tuple(range(k))))

    def affine(self, plan):
        out = []
        for k in ("weight", "bias"):
            p = getattr(self, k, None)
            out.append(None if p is None else self.params.apply_plan(p, plan.params))
        return out[0], out[1]


class _ZeroAffine:
    """Parameters sharded over the whole partition (:class:`ZeroShards`), all-gathered
    within each fibre on use."""

    def _place(self, seq: torch.nn.Module, names: Sequence[str]) -> None:
        k, m = len(self.normalized_shape), self.m
        zero = ZeroShards(self.P_x, {m + j: j for j in range(k)}, self.normalized_shape)
        have = []
        for name in names:
            p = getattr(seq, name, None)
            if p is None:
                setattr(self, name, None)
                continue
            setattr(self, name, torch.nn.Parameter(zero.shard(p)))
            have.append(name)
        self._setup_zero(zero, have)

    def param_plan(self, device_type: str) -> Plan | None:
        if not self.shards:
            return None
        return self.zero.plan(getattr(self, next(iter(self.shards))).dtype, device_type)

    def affine(self, plan):
        out = []
        for k in ("weight", "bias"):
            p = getattr(self, k, None)
            out.append(None if p is None else self.zero.gather(p, plan.params))
        return out[0], out[1]


class DistributedLayerNorm(_BroadcastAffine, ShardedParameters, _Norm):
    """``torch.nn.LayerNorm`` over the trailing ``normalized_shape`` dims of a tensor
    partitioned by ``P_x`` (see the module docstring).

    The affine parameters (initialized like the torch layer) are split like the normalized
    dims and live on the workers at replica coordinates 0; the others receive them by a
    Broadcast (adjoint: SumReduce of the gradients).
    """


class DistributedLayerNormZero(_ZeroAffine, ZeroParameters, _Norm):
    """``torch.nn.LayerNorm`` as :class:`DistributedLayerNorm`, its affine parameters
    sharded ZeRO-style over the whole partition: each worker keeps one chunk of its
    normalized block; the blocks are all-gathered within each fibre of replica workers on
    use, and the gradients reduce-scattered back (the adjoint)."""


class DistributedRMSNormZero(_ZeroAffine, ZeroParameters, _Norm):
    """``torch.nn.RMSNorm`` (``eps=None``: the input dtype's machine epsilon) over the
    trailing ``normalized_shape`` dims of a tensor partitioned by ``P_x``; the weight is
    sharded ZeRO-style as in :class:`DistributedLayerNormZero`. Forward ``y = x
    rsqrt(mean(x^2) + eps) w`` (one AllSumReduce of the per-row sums of squares)."""

    rms = True

    def __init__(self, P_x: Partition, normalized_shape: int | Sequence[int],
                 eps: float | None = None, elementwise_affine: bool = True, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super(_Norm, self).__init__()  # not the layer norm's constructor: no bias, eps None
        seq = self._build(P_x, normalized_shape, eps, elementwise_affine, False, dtype, device)
        self._place(seq, ("weight",))
