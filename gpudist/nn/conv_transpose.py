"""Distributed transposed convolution, equal to ``torch.nn.ConvTranspose1d/2d/3d``.

Partitions as in :mod:`gpudist.nn.conv` (D spatial dims): ``P_x`` = (P_b, P_ci, P_0..),
``P_y`` = (P_b, P_co, P_0..), the work partition ``P_w`` = (P_b, P_co, P_ci, P_0..). torch's
weight is laid out (in_channels, out_channels / groups, k..): its block (ci_j, co_i) lives on
the ``P_w`` worker at (0, i, j, 0..), the bias block co_i on (0, i, 0, 0..).

Per spatial dim (input length ``n``, kernel ``k``, stride ``s``, padding ``p``, dilation
``d``, output padding ``q``) input ``i`` feeds the outputs ``o = i*s - p + t*d`` (taps ``t``)
of ``m = (n-1)*s - 2p + d*(k-1) + q + 1``. The outputs are block-balanced over the partition
like every gpudist layer; the worker with outputs ``[o0, o1)`` needs the inputs
``[ceil((o0 + p - d*(k-1)) / s), floor((o1 - 1 + p) / s)]`` clipped to ``[0, n)``
(:meth:`~gpudist.halo.HaloGeometry.from_intervals` makes the halo plan; a configuration the
halo geometry cannot serve is a :class:`~gpudist.errors.HaloError` naming the layer, raised on
every rank, since every rank computes the whole geometry). The local transposed
conv (padding 0) over inputs ``[a, b)`` gives the global outputs from ``a*s - p`` on; the
worker keeps ``[o0, o1)`` of them (zero-extended where no input of the block reaches: gaps
of a large stride, output padding).

Forward:  x^ <- B[P_x -> P_w] x    (copies of x for every output-channel block)
          x^ <- H x^               (halo exchange within each output-channel slice of P_w)
          w^ <- B[P_r -> P_w] w;  b^ <- B[P_rb -> P_w(ci=0)] b
          y^ = crop(convT(x^, w^)) + b^   (locally; the partial sum over this ci block)
          y  <- R[P_w -> P_y] y^   (sum of the partial sums over input-channel blocks)
Adjoint (by autograd): B* = R of dy back to P_w; crop* (zero-extension), the local transposed
conv's adjoints; H* adds halo gradients into the neighbours' bulk; R of dx^ over the
output-channel blocks into P_x, of dw^/db^ into where the weights live.

The spatial-only form (``P_w`` not given: weights on P_x's first worker) is the same
algorithm, its broadcast of x and sum of y being identities that are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..decomposition import block_range
from ..errors import HaloError, PartitionError, ShapeError, raised_everywhere
from ..halo import HaloExchange, HaloGeometry
from ..partition import Partition
from ..primitives import Broadcast, Plan, SumReduce
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters, per_dim
from ._params import block, connect, parameter
from .conv import DistributedConvNd, _ci0

_CONVT = {1: (F.conv_transpose1d, torch.nn.ConvTranspose1d),
          2: (F.conv_transpose2d, torch.nn.ConvTranspose2d),
          3: (F.conv_transpose3d, torch.nn.ConvTranspose3d)}
R = REPLICATE


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def output_length(n: int, k: int, s: int, p: int, d: int, q: int) -> int:
    """torch's transposed-conv output length for input length ``n``."""
    return (n - 1) * s - 2 * p + d * (k - 1) + q + 1


def needed_inputs(o0: int, o1: int, n: int, k: int, s: int, p: int, d: int
                  ) -> tuple[int, int]:
    """Half-open input range whose taps reach the outputs ``[o0, o1)``, clipped to
    ``[0, n)`` (empty if none does, or if there is no output)."""
    if o1 <= o0:
        return (0, 0)
    a = min(max(_ceil_div(o0 + p - d * (k - 1), s), 0), n)
    b = max(min((o1 - 1 + p) // s + 1, n), a)
    return (a, b)


@dataclass
class _ConvTPlan:
    """One input spec: the specs along the way, the inner primitives' plans and this
    worker's local work (``kind``: 'op' runs the local transposed conv and keeps
    ``crop`` (slices) or, where it must zero-extend, ``pad`` (F.pad widths); 'bias': no
    input reaches this worker's outputs; 'empty': it has no outputs)."""

    out: TensorSpec
    x_bcast: Plan
    halo: Plan | None
    w_bcast: Plan
    b_bcast: Plan | None
    y_reduce: Plan
    kind: str
    crop: tuple[slice, ...] | None
    pad: tuple[int, ...] | None


class DistributedConvTransposeNd(ShardedParameters, DistributedModule):
    """N-D transposed convolution of a tensor partitioned over ``P_x``, equal to
    ``torch.nn.ConvTranspose{N}d`` (see the module docstring).

    ``P_w`` omitted: spatial (and batch) partition only, ``P_x`` = (P_b, 1, P_0..), output on
    ``P_y`` = ``P_x``; weights on P_x's first worker. ``P_w`` given: the general form with
    channels partitioned; ``P_y`` defaults to the ``P_w`` workers with ci coordinate 0.
    ``groups`` other than 1 needs unpartitioned channels; only ``padding_mode="zeros"``;
    the forward's ``output_size`` argument is not supported (use ``output_padding``).

    Parameters are initialized like the sequential torch layer from the current RNG state,
    so equal seeds on every rank give the sequential layer's values; every worker keeps its
    block.
    """

    autocast = "lower"  # torch.autocast runs it in its lower precision dtype

    spatial: int = 2

    def __init__(self, P_x: Partition, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                 groups: int = 1, bias: bool = True, dilation: int | Sequence[int] = 1,
                 padding_mode: str = "zeros", *, P_y: Partition | None = None,
                 P_w: Partition | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        n, name = self.spatial, type(self).__name__
        if padding_mode != "zeros":
            raise raised_everywhere(ValueError(
                f"{name}: padding_mode={padding_mode!r} is not supported (only 'zeros', "
                f"torch's only mode for transposed convolutions)"))
        if P_x.dim != n + 2:
            raise raised_everywhere(PartitionError(
                f"{name}: the input partition must have {n + 2} dimensions (N, C, "
                f"spatial...), got {P_x.shape}"))
        self.k = per_dim("kernel_size", name, kernel_size, n, exact=True)
        self.s = per_dim("stride", name, stride, n)
        self.p = per_dim("padding", name, padding, n)
        self.q = per_dim("output_padding", name, output_padding, n)
        self.d = per_dim("dilation", name, dilation, n)
        for what, vals, least in (("kernel_size", self.k, 1), ("stride", self.s, 1),
                                  ("dilation", self.d, 1), ("padding", self.p, 0),
                                  ("output_padding", self.q, 0)):
            if any(v < least for v in vals):
                raise raised_everywhere(ValueError(
                    f"{name}: {what} must be >= {least} in every spatial dim, got {vals}"))
        for a, (q, s, d) in enumerate(zip(self.q, self.s, self.d)):
            if q >= max(s, d):
                raise raised_everywhere(ValueError(
                    f"{name}: output_padding {q} in spatial dim {a} must be smaller than "
                    f"either stride ({s}) or dilation ({d})"))
        if not isinstance(groups, int) or groups < 1 or in_channels % groups or \
                out_channels % groups:
            raise raised_everywhere(ValueError(
                f"{name}: groups={groups!r} must be a positive int dividing in_channels="
                f"{in_channels} and out_channels={out_channels}"))
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.P_x, self.P_w, self.P_y = DistributedConvNd._partitions(self, P_x, P_w, P_y, name)
        pb, pco, pci, sp = self.P_w.shape[0], self.P_w.shape[1], self.P_w.shape[2], \
            self.P_w.shape[3:]
        if groups != 1 and (pco > 1 or pci > 1):
            raise raised_everywhere(PartitionError(
                f"{name}: groups={groups} needs unpartitioned channels (P_w {self.P_w.shape} "
                f"splits them)"))
        for what, c, p in (("in_channels", in_channels, pci), ("out_channels", out_channels, pco)):
            if c < p:
                raise raised_everywhere(PartitionError(
                    f"{name}: {what}={c} cannot be split over {p} workers"))
        world = P_x.world
        self.setup(P_x, set(self.P_x.ranks) | set(self.P_w.ranks) | set(self.P_y.ranks))
        dev = device if device is not None else world.device
        seq = _CONVT[n][1](in_channels, out_channels, self.k, self.s, self.p, self.q,
                           groups=groups, bias=bias, dilation=self.d, dtype=dtype, device=dev)
        self.wshape = tuple(seq.weight.shape)  # (in, out / groups, k..)
        # where the parameters live: P_r (ci x co grid, the weight's own layout) for w,
        # P_rb (co) for b
        at = self.P_w.world_rank_of
        z = (0,) * n
        self.P_r = Partition([at((0, i, j) + z) for j in range(pci) for i in range(pco)],
                             (pci, pco) + (1,) * n, world)
        self.P_rb = Partition([at((0, i, 0) + z) for i in range(pco)], (pco,), world)
        self.root = Partition([self.P_r.ranks[0]], (1,) * (n + 2), world)
        self.weight = parameter(block(seq.weight, self.P_r), seq.weight, n + 2)
        self.bias = parameter(block(seq.bias, self.P_rb), seq.weight, 1) if bias else None
        self.homes = {"weight": (self.P_r, self.wshape)}
        if bias:
            self.homes["bias"] = (self.P_rb, (out_channels,))
        # the data path (every primitive made once, collectively; identities are skipped)
        self.Px_view = self.P_x.reshape((pb, 1, pci) + sp)
        self.Py_view = self.P_y.reshape((pb, pco, 1) + sp)
        self.P_slice = DistributedConvNd._slice(self, self.P_w)  # my co slice, shaped as x
        self.x_bcast = Broadcast(self.Px_view, self.P_w)
        self.halo = HaloExchange(self.P_slice, geometry=self._geometry, owns_gradient=True)
        # the same workers as P_r, in P_w's (co, ci) order: the weight's dim 1 (out
        # channels) split along partition dim 1, its dim 0 (in channels) along dim 2
        self.P_r5 = Partition([at((0, i, j) + z) for i in range(pco) for j in range(pci)],
                              (1, pco, pci) + (1,) * n, world)
        self.w_bcast = Broadcast(self.P_r5, self.P_w)
        self.P_wb = _ci0(self.P_w)  # the bias is added once: on the ci = 0 workers only
        self.P_rb5 = self.P_rb.reshape((1, pco, 1) + (1,) * n)
        self.b_bcast = Broadcast(self.P_rb5, self.P_wb) if bias else None
        self.y_reduce = SumReduce(self.P_w, self.Py_view)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.k}, "
                f"stride={self.s}, padding={self.p}, output_padding={self.q}, "
                f"dilation={self.d}, groups={self.groups}, P_w={self.P_w.shape}")

    # -- shapes -----------------------------------------------------------------
    def output_sizes(self, spatial: Sequence[int]) -> tuple[int, ...]:
        """Global output spatial sizes for global input spatial sizes ``spatial``."""
        out = []
        for a, L in enumerate(spatial):
            m = output_length(L, self.k[a], self.s[a], self.p[a], self.d[a], self.q[a])
            if L < 1 or m < 1:
                raise raised_everywhere(ShapeError(
                    f"{self.name}: input spatial size {tuple(spatial)} gives output size {m} "
                    f"in spatial dim {a} (kernel {self.k[a]}, stride {self.s[a]}, padding "
                    f"{self.p[a]}, dilation {self.d[a]}, output_padding {self.q[a]}): "
                    f"input and output sizes must be positive"))
            out.append(m)
        return tuple(out)

    def _geometry(self, spec: TensorSpec) -> tuple[HaloGeometry, ...]:
        """Per-dim halo geometry of the input over a co slice of ``P_w`` (pure: raises
        the same HaloError on every rank)."""
        g, shape = spec.global_shape, self.P_slice.shape
        geos = [HaloGeometry(g[0], shape[0], axis=0), HaloGeometry(g[1], shape[1], axis=1)]
        sizes = self.output_sizes(g[2:])
        for a in range(self.spatial):
            dim, L, M, Pd = a + 2, g[a + 2], sizes[a], shape[a + 2]
            outs = [block_range(M, Pd, i) for i in range(Pd)]
            needs = [needed_inputs(o0, o1, L, self.k[a], self.s[a], self.p[a], self.d[a])
                     for o0, o1 in outs]
            try:
                geos.append(HaloGeometry.from_intervals(L, outs, needs, axis=dim))
            except HaloError as e:
                raise raised_everywhere(HaloError(
                    f"{self.name}: input size {L} -> output size {M} in spatial dim {a} "
                    f"(kernel {self.k[a]}, stride {self.s[a]}, padding {self.p[a]}, dilation "
                    f"{self.d[a]}) over {Pd} workers: {e}")) from None
        return tuple(geos)

    # -- plans ------------------------------------------------------------------
    def make_plan(self, spec: TensorSpec) -> _ConvTPlan:
        name, n = self.name, self.spatial
        if not spec.standard or spec.ndim != n + 2:
            raise raised_everywhere(ShapeError(
                f"{name}: expected an (N, C, {'spatial, ' * n}) tensor split the standard way,"
                f" got {spec.describe()}"))
        g = spec.global_shape
        if g[1] != self.in_channels:
            raise raised_everywhere(ShapeError(
                f"{name}: the blocks over P_x {self.P_x.shape} form a global tensor {g} with "
                f"{g[1]} channels, expected {self.in_channels}"))
        dt, dev = spec.dtype, spec.device_type
        # raises HaloError (and bad sizes) on every rank, participant or not
        geo = self.halo.geometry_of(TensorSpec(self.P_slice, g, dt, dev))
        m = self.output_sizes(g[2:])
        x_plan = self.x_bcast.plan(TensorSpec(self.Px_view, (g[0], 1) + g[1:], dt, dev))
        h_plan = self.halo.plan(TensorSpec(self.P_slice, g, dt, dev)) \
            if self.P_slice.active else None
        w_plan = self.w_bcast.plan(TensorSpec(self.P_r5, self.wshape, dt, dev,
                                              (R, 1, 0) + (R,) * n))
        b_plan = None
        if self.bias is not None:
            b_plan = self.b_bcast.plan(TensorSpec(self.P_rb5, (self.out_channels,), dt, dev,
                                                  (R, 0) + (R,) * (n + 1)))
        y = (g[0], self.out_channels) + m
        yspec = TensorSpec(self.P_w, y, dt, dev, (0, 1, PARTIAL) + tuple(range(2, n + 2)))
        out = TensorSpec(self.P_y, y, dt, dev)
        kind, crop, pad = "empty", None, None
        if self.P_w.active and 0 not in yspec.local_shape:
            me = [geo[a + 2].worker(self.P_slice.coords[a + 2]) for a in range(n)]
            if any(w.needed[1] <= w.needed[0] for w in me):
                kind = "bias"  # no input reaches these outputs
            else:
                kind, crop_, widths = "op", [], []
                for a, w in enumerate(me):
                    (o0, o1), (i0, i1) = w.outputs, w.needed
                    full = (i1 - i0 - 1) * self.s[a] + self.d[a] * (self.k[a] - 1) + 1
                    j0 = o0 + self.p[a] - i0 * self.s[a]  # local index of global output o0
                    j1 = j0 + o1 - o0
                    crop_.append(slice(j0, j1))
                    widths.append((-j0, j1 - full))  # F.pad widths (< 0: crop)
                if all(lo <= 0 and hi <= 0 for lo, hi in widths):
                    crop = (slice(None), slice(None)) + tuple(crop_)
                else:
                    pad = tuple(v for lo_hi in reversed(widths) for v in lo_hi)
        return _ConvTPlan(out, x_plan, h_plan, w_plan, b_plan, self.y_reduce.plan(yspec),
                          kind, crop, pad)

    # -- forward ----------------------------------------------------------------
    def run(self, x: torch.Tensor, plan: _ConvTPlan) -> torch.Tensor:
        x5 = self.x_bcast.apply_plan(x.unsqueeze(1), plan.x_bcast)
        w = self.w_bcast.apply_plan(self.weight, plan.w_bcast)
        b = self.b_bcast.apply_plan(self.bias, plan.b_bcast) if self.b_bcast is not None else None
        if not self.P_w.active:
            y = connect(x5.new_zeros(plan.y_reduce.spec.local_shape), x5, w, b)
            return self.y_reduce.apply_plan(y, plan.y_reduce)
        xh = self.halo.apply_plan(x5.squeeze(1), plan.halo)
        b_here = b if self.P_wb.active else None  # added once, on the ci = 0 workers
        conv_t = _CONVT[self.spatial][0]
        if plan.kind == "op" and plan.crop is not None:  # the common case: a crop
            full = conv_t(xh, w, b_here, self.s, 0, 0, self.groups, self.d)
            y = full[plan.crop]
            y = y if y.shape == full.shape else y.contiguous()
        elif plan.kind == "op":  # zero-extended where no input of the block reaches
            y = F.pad(conv_t(xh, w, None, self.s, 0, 0, self.groups, self.d), plan.pad)
            if b_here is not None:
                y = y + b_here.reshape((1, -1) + (1,) * self.spatial)
        else:  # no input reaches my outputs ('bias') or no outputs ('empty'): keep the graph
            y = connect(xh.new_zeros(plan.y_reduce.spec.local_shape), xh, w)
            if b_here is not None and plan.kind == "bias":
                y = y + b_here.reshape((1, -1) + (1,) * self.spatial)
            else:
                b_here = None
        if b_here is None:
            y = connect(y, b)
        return self.y_reduce.apply_plan(y, plan.y_reduce)


    def forward(self, x, output_size: Sequence[int] | None = None):  # type: ignore[override]
        """torch's signature; ``output_size`` is refused (use ``output_padding``)."""
        if output_size is not None:
            raise raised_everywhere(ValueError(
                f"{self.name}: the output_size argument is not supported; give the layer "
                f"output_padding instead (torch's output_size picks it from the sizes)"))
        return super().forward(x)


class DistributedConvTranspose1d(DistributedConvTransposeNd):
    spatial = 1


class DistributedConvTranspose2d(DistributedConvTransposeNd):
    spatial = 2


class DistributedConvTranspose3d(DistributedConvTransposeNd):
    spatial = 3
