"""Distributed pooling with torch's semantics: x <- H x (global padding -inf for max, 0 for
average; the symmetric part is left to the torch op's own padding), then the torch pooling
op on every worker. Adjoint by autograd (the local pooling's adjoint, then H*).

Per spatial dimension of global length ``L`` (kernel ``k``, stride ``s``, padding ``p``,
dilation ``d``) the output length is torch's::

    m = floor((L + 2p - d(k-1) - 1 + (s-1 if ceil_mode)) / s) + 1
    if ceil_mode and (m-1)*s >= L + p: m -= 1   # the last window must start before L

``ceil_mode`` is realized by ``r = (m-1)*s + d(k-1) + 1 - (L + 2p)`` extra entries of RIGHT
padding, so the halo geometry's floor rule yields ``m`` outputs. Since ``r`` depends on the
global length, the layer's :class:`~gpudist.halo.HaloExchange` takes its geometry as a
function of the global shape (:meth:`_DistributedPoolNd.geometry`).

Average pooling divides a sum pool by torch's divisor, a product over dims of per-dim counts
of the window ``[t, min(t+k, L+p))``, ``t = o*s - p``: its length (``count_include_pad``) or
its length clipped to ``[0, L)``; ``divisor_override`` replaces the product. The divisor of
this worker's outputs comes from their global indices (``WorkerHalo.outputs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..halo import HaloExchange, HaloGeometry, halo_spec
from ..halo.geometry import require_nonempty
from ..partition import Partition
from ..primitives import Plan
from ..spec import TensorSpec
from ._layer import DistributedModule, per_dim
from .pooling_edges import PoolEdgePlan, max_pool_edges, padding_only_window

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}

IntOrSeq = int | Sequence[int]


def pool_output_length(L: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling output length for one dimension (may be < 1: no output)."""
    span = d * (k - 1) + 1
    m = (L + 2 * p - span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (m - 1) * s >= L + p:
        m -= 1
    return m


def window_counts(L: int, k: int, s: int, p: int, outputs: tuple[int, int],
                  include_pad: bool) -> torch.Tensor:
    """Per-output count of torch's average-pooling window in one dimension (int64), for the
    global output indices ``outputs = [o0, o1)``."""
    start = torch.arange(outputs[0], outputs[1], dtype=torch.int64) * s - p
    end = torch.clamp(start + k, max=L + p)
    if not include_pad:
        start, end = start.clamp(min=0), end.clamp(max=L)
    return end - start


@dataclass
class _PoolPlan:
    out: TensorSpec
    halo_op: HaloExchange
    halo: Plan
    pads: tuple[int, ...]
    empty_out: bool
    divisor: dict
    edges: PoolEdgePlan | None = None  # max pooling of the block plus edge strips


class _DistributedPoolNd(DistributedModule):
    """Shared machinery: validation, the halo geometry per global shape, inactive ranks."""

    spatial = 2
    kind = "max"
    autocast = "probe"  # torch.autocast: 3-D pooling in float32 on the CPU
    #: max pooling: torch's pool of the block and the edge outputs from thin strips of the
    #: halo (:mod:`gpudist.nn.pooling_edges`) where the grids agree, instead of copying the
    #: block into the halo buffer and pooling that (False takes that path)
    edge_split: bool = True

    def autocast_probe(self, x):
        return (_MAX if self.kind == "max" else _AVG)[self.spatial](x, 1)

    def _setup(self, P_x: Partition, kernel_size: IntOrSeq, stride: IntOrSeq | None,
               padding: IntOrSeq, dilation: IntOrSeq, ceil_mode: bool) -> None:
        n, name = self.spatial, type(self).__name__
        if P_x.dim != n + 2:
            raise raised_everywhere(PartitionError(
                f"{name}: the input partition must have {n + 2} dimensions (N, C, {n} "
                f"spatial), got {P_x.shape}"))
        self.P_x = P_x
        self.k = per_dim("kernel_size", name, kernel_size, n)
        no_stride = stride is None or (not isinstance(stride, int) and len(stride) == 0)
        self.s = self.k if no_stride else per_dim("stride", name, stride, n)
        self.p = per_dim("padding", name, padding, n)
        self.d = per_dim("dilation", name, dilation, n)
        self.ceil_mode = bool(ceil_mode)
        for opt, vals in (("kernel_size", self.k), ("stride", self.s), ("dilation", self.d)):
            if any(v <= 0 for v in vals):
                raise raised_everywhere(ValueError(
                    f"{name}: {opt} must be greater than zero, got {vals}"))
        if any(v < 0 for v in self.p):
            raise raised_everywhere(ValueError(
                f"{name}: padding must be non-negative, got {self.p}"))
        if any(p > k // 2 for p, k in zip(self.p, self.k)):
            raise raised_everywhere(ValueError(
                f"{name}: padding should be at most half of kernel_size (as in torch), got "
                f"padding={self.p}, kernel_size={self.k}"))
        self.setup(P_x, P_x.ranks)
        fill = float("-inf") if self.kind == "max" else 0.0
        self.halo = HaloExchange(P_x, geometry=self.geometry, pad_value=fill, op_padding=True,
                                 owns_gradient=True)
        # max pooling where some window reads padding only: the padding goes into the
        # buffer (torch's max pool reports an index outside the input for such a window,
        # and its backward writes there)
        self.halo_padded = HaloExchange(P_x, geometry=self.geometry, pad_value=fill,
                                        owns_gradient=True) if self.kind == "max" else None

    def extra_repr(self) -> str:
        return (f"kernel_size={self.k}, stride={self.s}, padding={self.p}, "
                f"dilation={self.d}, ceil_mode={self.ceil_mode}")

    def geometry(self, spec: TensorSpec) -> tuple[HaloGeometry, ...]:
        """Halo geometry for the input tensor: padding ``(p, p + r)`` per spatial dim, ``r``
        the extra right padding of ``ceil_mode``."""
        g = spec.global_shape
        require_nonempty(g, type(self).__name__)
        pads: list[tuple[int, int]] = [(0, 0), (0, 0)]
        for a, L in enumerate(g[2:]):
            k, s, p, d = self.k[a], self.s[a], self.p[a], self.d[a]
            m = pool_output_length(L, k, s, p, d, self.ceil_mode)
            if m < 1:
                raise raised_everywhere(ShapeError(
                    f"{type(self).__name__}: global input size {g[2:]} gives output length {m}"
                    f" in spatial dim {a} (kernel_size={k}, stride={s}, padding={p}, "
                    f"dilation={d}): output size is too small"))
            if self.kind == "avg" and self.spatial == 3 and L < k:
                raise raised_everywhere(ShapeError(  # torch's avg_pool3d refuses it
                    f"{type(self).__name__}: global input size {g[2:]} is smaller than the "
                    f"kernel size {self.k} in spatial dim {a} (torch's avg_pool3d requires "
                    f"input size >= kernel size, padding aside)"))
            r = max(0, (m - 1) * s + d * (k - 1) + 1 - (L + 2 * p))
            pads.append((p, p + r))
        return halo_spec(g, self.P_x.shape, (1, 1) + self.k, (1, 1) + self.s, tuple(pads),
                         (1, 1) + self.d)

    def make_plan(self, spec: TensorSpec) -> _PoolPlan:
        n = self.spatial
        if not spec.standard or spec.ndim != n + 2:
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected a {n + 2}-D (N, C, spatial) tensor split the standard "
                f"way, got {spec.describe()}"))
        geo = self.halo.geometry_of(spec)
        out = TensorSpec(self.P_x, spec.global_shape[:2] + tuple(x.output_size
                                                                   for x in geo[2:]),
                         spec.dtype, spec.device_type)
        halo = self.halo
        if self.halo_padded is not None and any(
                padding_only_window(L, self.k[a], self.s[a], self.p[a], self.d[a], m)
                for a, (L, m) in enumerate(zip(spec.global_shape[2:], out.global_shape[2:]))):
            halo = self.halo_padded
        hp = halo.plan(spec) if self.P_x.active else None
        pads = tuple(lo for lo, _ in hp.local.pads[2:]) if hp is not None else (0,) * n
        empty = self.P_x.active and 0 in out.local_shape
        edges = None
        if self.kind == "max" and halo is self.halo and hp is not None and not empty \
                and self.edge_split:
            edges = PoolEdgePlan.make(hp.local, self.k, self.s, self.d, out.local_shape)
        return _PoolPlan(out, halo, hp, pads, empty, {}, edges)

    def run(self, x: torch.Tensor, plan: _PoolPlan) -> torch.Tensor:
        if plan.edges is not None:  # the block's pool, the edges from strips of the halo
            return max_pool_edges(plan.halo_op, plan.halo, plan.edges, x, self.k, self.s,
                                  self.d)
        xh = plan.halo_op.apply_plan(x, plan.halo)
        if plan.empty_out:  # no output here: keep the graph, skip the op
            return xh.new_zeros(plan.out.local_shape) + xh.sum() * 0
        return self._pool(xh, plan)

    def _pool(self, xh: torch.Tensor, plan: _PoolPlan) -> torch.Tensor:
        raise NotImplementedError


class _DistributedMaxPoolNd(_DistributedPoolNd):
    """Max pooling of a tensor partitioned over ``P_x`` = (P_b, P_c, P_0..); arguments as in
    ``torch.nn.MaxPoolNd`` (``return_indices=True`` is not supported)."""

    kind = "max"

    def __init__(self, P_x: Partition, kernel_size: IntOrSeq, stride: IntOrSeq | None = None,
                 padding: IntOrSeq = 0, dilation: IntOrSeq = 1, return_indices: bool = False,
                 ceil_mode: bool = False) -> None:
        super().__init__()
        if return_indices:
            raise raised_everywhere(ValueError(
                f"{type(self).__name__}: return_indices=True is not supported (indices into a "
                f"partitioned input have no local meaning)"))
        self._setup(P_x, kernel_size, stride, padding, dilation, ceil_mode)

    def _pool(self, xh: torch.Tensor, plan: _PoolPlan) -> torch.Tensor:
        return _MAX[self.spatial](xh, self.k, self.s, plan.pads, self.d)


class _DistributedAvgPoolNd(_DistributedPoolNd):
    """Average pooling of a tensor partitioned over ``P_x`` = (P_b, P_c, P_0..); arguments as
    in ``torch.nn.AvgPoolNd``."""

    kind = "avg"

    def __init__(self, P_x: Partition, kernel_size: IntOrSeq, stride: IntOrSeq | None = None,
                 padding: IntOrSeq = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None) -> None:
        super().__init__()
        self._setup(P_x, kernel_size, stride, padding, 1, ceil_mode)
        if divisor_override is not None and int(divisor_override) == 0:
            raise raised_everywhere(ValueError(
                f"{type(self).__name__}: divisor_override must be non-zero"))
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = None if divisor_override is None else int(divisor_override)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.k}, stride={self.s}, padding={self.p}, "
                f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad}, "
                f"divisor_override={self.divisor_override}")

    def divisor(self, plan: _PoolPlan, like: torch.Tensor) -> torch.Tensor | None:
        """Torch's divisor for this worker's outputs, shaped (1, 1, m_0..) to broadcast;
        None where it is the kernel volume everywhere (plain ``avg_pool``). Cached in the
        plan per dtype/device."""
        key = (like.dtype, like.device)
        if key not in plan.divisor:
            hp = plan.halo.local
            g = plan.halo.spec.global_shape
            counts = [window_counts(L, k, s, p, w.outputs, self.count_include_pad)
                      for L, k, s, p, w in zip(g[2:], self.k, self.s, self.p, hp.me[2:])]
            if all(bool((c == k).all()) for c, k in zip(counts, self.k)):
                div = None
            else:
                div = torch.ones((1, 1), dtype=torch.int64)
                for c in counts:
                    div = div.unsqueeze(-1) * c
                div = div.to(dtype=like.dtype, device=like.device)
            plan.divisor[key] = div
        return plan.divisor[key]

    def _pool(self, xh: torch.Tensor, plan: _PoolPlan) -> torch.Tensor:
        # the op's own zero padding is counted like the halo's (count_include_pad=True)
        n, pad = self.spatial, plan.pads
        div: torch.Tensor | int | None = self.divisor_override
        if div is None:
            div = self.divisor(plan, xh)
            if div is None:
                return _AVG[n](xh, self.k, self.s, pad)
        if n == 1:  # avg_pool1d has no divisor_override: sum-pool as a 2-D pool
            total = F.avg_pool2d(xh.unsqueeze(-2), (1,) + self.k, (1,) + self.s, (0,) + pad,
                                 divisor_override=1).squeeze(-2)
        else:
            total = _AVG[n](xh, self.k, self.s, pad, divisor_override=1)
        return total / div


class DistributedMaxPool1d(_DistributedMaxPoolNd):
    spatial = 1


class DistributedMaxPool2d(_DistributedMaxPoolNd):
    spatial = 2


class DistributedMaxPool3d(_DistributedMaxPoolNd):
    spatial = 3


class DistributedAvgPool1d(_DistributedAvgPoolNd):
    """As ``torch.nn.AvgPool1d``: no ``divisor_override``."""

    spatial = 1

    def __init__(self, P_x: Partition, kernel_size: IntOrSeq, stride: IntOrSeq | None = None,
                 padding: IntOrSeq = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True) -> None:
        super().__init__(P_x, kernel_size, stride, padding, ceil_mode, count_include_pad)


class DistributedAvgPool2d(_DistributedAvgPoolNd):
    spatial = 2


class DistributedAvgPool3d(_DistributedAvgPoolNd):
    spatial = 3
