"""Distributed pooling with torch's semantics: x <- H x (global padding -inf for max, 0 for
average; the symmetric part is left to the torch op's own padding), then the torch pooling
op on every worker. Adjoint by autograd (the local pooling's adjoint, then H*).

Per spatial dimension of global length ``L`` (kernel ``k``, stride ``s``, padding ``p``,
dilation ``d``) the output length is torch's::

    m = floor((L + 2p - d(k-1) - 1 + (s-1 if ceil_mode)) / s) + 1
    if ceil_mode and (m-1)*s >= L + p: m -= 1   # the last window must start before L

``ceil_mode`` is realized by ``r = (m-1)*s + d(k-1) + 1 - (L + 2p)`` extra entries of RIGHT
padding, so the halo geometry's floor rule yields ``m`` outputs. Since ``r`` depends on the
global length, the layer builds one :class:`~gpudist.halo.HaloExchange` per global shape
(from ``HaloExchange.global_shape_of``: an all-gather of local shapes, cached per local
shape).

Average pooling divides a sum pool by torch's divisor, a product over dims of per-dim counts
of the window ``[t, min(t+k, L+p))``, ``t = o*s - p``: its length (``count_include_pad``) or
its length clipped to ``[0, L)``; ``divisor_override`` replaces the product. The divisor of
this worker's outputs comes from their global indices (``WorkerHalo.outputs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError
from ..halo import HaloExchange
from ..partition import Partition
from ._halo import exchange_for_op, op_halo

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}

IntOrSeq = int | Sequence[int]


def _per_dim(name: str, layer: str, v: IntOrSeq, n: int) -> tuple[int, ...]:
    """An int or a sequence of 1 or ``n`` ints -> ``n`` ints (torch's rule)."""
    vals = [v] if isinstance(v, int) else list(v)
    if len(vals) not in (1, n) or not all(isinstance(a, int) for a in vals):
        raise ValueError(f"{layer}: {name} must be a single int or a tuple of {n} ints, "
                         f"got {v!r}")
    return tuple(int(a) for a in vals) * (n if len(vals) == 1 else 1)


def output_length(L: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
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


class _DistributedPoolNd(torch.nn.Module):
    """Shared machinery: validation, halo per global shape, inactive ranks."""

    spatial = 2
    kind = "max"

    def _setup(self, P_x: Partition, kernel_size: IntOrSeq, stride: IntOrSeq | None,
               padding: IntOrSeq, dilation: IntOrSeq, ceil_mode: bool) -> None:
        n, name = self.spatial, type(self).__name__
        if P_x.dim != n + 2:
            raise PartitionError(f"{name}: the input partition must have {n + 2} dimensions "
                                 f"(N, C, {n} spatial), got {P_x.shape}")
        self.P_x = P_x
        self.k = _per_dim("kernel_size", name, kernel_size, n)
        no_stride = stride is None or (not isinstance(stride, int) and len(stride) == 0)
        self.s = self.k if no_stride else _per_dim("stride", name, stride, n)
        self.p = _per_dim("padding", name, padding, n)
        self.d = _per_dim("dilation", name, dilation, n)
        self.ceil_mode = bool(ceil_mode)
        for opt, vals in (("kernel_size", self.k), ("stride", self.s), ("dilation", self.d)):
            if any(v <= 0 for v in vals):
                raise ValueError(f"{name}: {opt} must be greater than zero, got {vals}")
        if any(v < 0 for v in self.p):
            raise ValueError(f"{name}: padding must be non-negative, got {self.p}")
        if any(p > k // 2 for p, k in zip(self.p, self.k)):
            raise ValueError(f"{name}: padding should be at most half of kernel_size (as in "
                             f"torch), got padding={self.p}, kernel_size={self.k}")
        # used only for global_shape_of: an all-gather of local shapes over P_x, cached
        self._shapes = HaloExchange(P_x)
        self._halos: dict[tuple[int, ...], HaloExchange] = {}

    def extra_repr(self) -> str:
        return (f"kernel_size={self.k}, stride={self.s}, padding={self.p}, "
                f"dilation={self.d}, ceil_mode={self.ceil_mode}")

    def halo_for(self, g: tuple[int, ...]) -> HaloExchange:
        """The halo exchange for global input shape ``g`` (cached): padding ``(p, p + r)``
        per spatial dim, ``r`` the extra right padding of ``ceil_mode``."""
        h = self._halos.get(g)
        if h is None:
            pads: list[tuple[int, int]] = [(0, 0), (0, 0)]
            for a, L in enumerate(g[2:]):
                k, s, p, d = self.k[a], self.s[a], self.p[a], self.d[a]
                m = output_length(L, k, s, p, d, self.ceil_mode)
                if m < 1:
                    raise ShapeError(
                        f"{type(self).__name__}: global input size {g[2:]} gives output "
                        f"length {m} in spatial dim {a} (kernel_size={k}, stride={s}, "
                        f"padding={p}, dilation={d}): output size is too small")
                r = max(0, (m - 1) * s + d * (k - 1) + 1 - (L + 2 * p))
                pads.append((p, p + r))
            fill = float("-inf") if self.kind == "max" else 0.0
            h = op_halo(self.P_x, (1, 1) + self.k, (1, 1) + self.s, tuple(pads),
                        (1, 1) + self.d, fill, global_shape=g)
            self._halos[g] = h
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x
        if x.dim() != self.spatial + 2:
            raise ShapeError(f"{type(self).__name__}: expected a {self.spatial + 2}-D "
                             f"block (N, C, spatial), got shape {tuple(x.shape)}")
        g = self._shapes.global_shape_of(x)
        h = self.halo_for(g)
        xh, pad = exchange_for_op(h, x, self.spatial)  # the op pads ``pad`` itself
        return self._pool(xh, pad, g, h)

    def _pool(self, xh: torch.Tensor, pad: tuple[int, ...], g: tuple[int, ...],
              h: HaloExchange) -> torch.Tensor:
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
            raise ValueError(f"{type(self).__name__}: return_indices=True is not supported "
                             f"(indices into a partitioned input have no local meaning)")
        self._setup(P_x, kernel_size, stride, padding, dilation, ceil_mode)

    def _pool(self, xh: torch.Tensor, pad: tuple[int, ...], g: tuple[int, ...],
              h: HaloExchange) -> torch.Tensor:
        return _MAX[self.spatial](xh, self.k, self.s, pad, self.d)


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
            raise ValueError(f"{type(self).__name__}: divisor_override must be non-zero")
        self.count_include_pad = bool(count_include_pad)
        self.divisor_override = None if divisor_override is None else int(divisor_override)
        self._divisors: dict[tuple, torch.Tensor | None] = {}

    def extra_repr(self) -> str:
        return (f"kernel_size={self.k}, stride={self.s}, padding={self.p}, "
                f"ceil_mode={self.ceil_mode}, count_include_pad={self.count_include_pad}, "
                f"divisor_override={self.divisor_override}")

    def divisor(self, g: tuple[int, ...], h: HaloExchange, like: torch.Tensor
                ) -> torch.Tensor | None:
        """Torch's divisor for this worker's outputs, shaped (1, 1, m_0..) to broadcast;
        None where it is the kernel volume everywhere (plain ``avg_pool``)."""
        key = (g, like.dtype, like.device)
        if key not in self._divisors:
            me = h.plan(g).me[2:]
            counts = [window_counts(L, k, s, p, w.outputs, self.count_include_pad)
                      for L, k, s, p, w in zip(g[2:], self.k, self.s, self.p, me)]
            if all(bool((c == k).all()) for c, k in zip(counts, self.k)):
                div = None
            else:
                div = torch.ones((1, 1), dtype=torch.int64)
                for c in counts:
                    div = div.unsqueeze(-1) * c
                div = div.to(dtype=like.dtype, device=like.device)
            self._divisors[key] = div
        return self._divisors[key]

    def _pool(self, xh: torch.Tensor, pad: tuple[int, ...], g: tuple[int, ...],
              h: HaloExchange) -> torch.Tensor:
        # the op's own zero padding is counted like the halo's (count_include_pad=True)
        n = self.spatial
        div: torch.Tensor | int | None = self.divisor_override
        if div is None:
            div = self.divisor(g, h, xh)
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
