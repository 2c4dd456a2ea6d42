"""Distributed convolution: input, output and weights partitioned over any of their dims.

Partitions (D spatial dims): ``P_x`` = (P_b, P_ci, P_0..), ``P_y`` = (P_b, P_co, P_0..) and
the work partition ``P_w`` = (P_b, P_co, P_ci, P_0..). The weight block (co_i, ci_j) lives on
the worker of ``P_w`` at (0, i, j, 0..); the bias block co_i on (0, i, 0, 0..).

Forward:  x^ <- B[P_x -> P_w] x   (copies of x for every output-channel block)
          x^ <- H x^              (halo exchange within each output-channel slice of P_w)
          w^ <- B[P_r -> P_w] w;  b^ <- B[P_rb -> P_w(ci=0)] b
          y^ = conv(x^, w^, b^)   (locally; the symmetric global padding is conv's own)
          y  <- R[P_w -> P_y] y^  (sum of the partial sums over input-channel blocks)
Adjoint (by autograd): B* = R of dy back to P_w; the local conv's adjoints; H* adds halo
gradients into the neighbours' bulk; R of dx^ over the output-channel blocks into P_x, of
dw^/db^ into where the weights live (over batch blocks too: data parallelism).

The spatial-only form (``P_w`` not given: weights on P_x's first worker) is the same
algorithm, its broadcast of x and sum of y being identities that are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..halo import HaloExchange
from ..halo.geometry import require_nonempty
from ..partition import Partition
from ..primitives import Broadcast, Plan, SumReduce
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters, per_dim
from ._params import block, connect, parameter
from .conv_strips import BoundaryStrips, conv_with_strips

_CONV = {1: (F.conv1d, torch.nn.Conv1d), 2: (F.conv2d, torch.nn.Conv2d),
         3: (F.conv3d, torch.nn.Conv3d)}
R, P_ = REPLICATE, PARTIAL


@dataclass
class _ConvPlan:
    """One input spec: the specs along the way and the inner primitives' plans."""

    out: TensorSpec
    x_bcast: Plan
    halo: Plan
    w_bcast: Plan
    b_bcast: Plan | None
    y_reduce: Plan
    x_slice: TensorSpec
    pads: tuple[int, ...]
    empty_out: bool
    groups: tuple[torch.Tensor, torch.Tensor] | None = None
    strips: BoundaryStrips | None = None  # the local step without the block copy


class DistributedConvNd(ShardedParameters, DistributedModule):
    """N-D convolution of a tensor partitioned over ``P_x`` (see the module docstring).

    ``P_w`` omitted: spatial (and batch) partition only, ``P_x`` = (P_b, 1, P_0..), output on
    ``P_y`` = ``P_x``; weights on P_x's first worker. ``P_w`` given: the general form; ``P_y``
    defaults to the ``P_w`` workers with ci coordinate 0.

    Parameters are initialized like the sequential torch layer from the current RNG state,
    so equal seeds on every rank give the sequential layer's values; every worker keeps its
    block. ``padding`` may be an int, a tuple, ``"valid"`` or ``"same"``; only
    ``padding_mode="zeros"`` is supported (the halo's global padding is zeros).
    """

    autocast = "lower"  # torch.autocast runs it in its lower precision dtype

    spatial: int = 2
    #: compute the local conv as conv(block) + boundary strips instead of copying the block
    #: into the halo buffer and convolving that (where the geometry allows; see
    #: :mod:`gpudist.nn.conv_strips`). Off by default: fwd+bwd of (4,16,512,512) 3x3 on a
    #: 16-core host, 4 ranks one per core, the copy ran at 0.98x (MPI) / 1.02x (gloo) the
    #: local conv and the strips at 1.14x / 1.11x; on 2 cores, 2 ranks, 1.02x vs 1.03-1.05x
    #: (MPI) and even on gloo (``python -m bench layers --layers conv2d conv2d_strips``).
    #: The strips save the block's copy but do column-shaped strided work per face.
    boundary_strips: bool = False

    def __init__(self, P_x: Partition, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] | str = 0, dilation: int | Sequence[int] = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *,
                 P_y: Partition | None = None, P_w: Partition | None = None,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        n, name = self.spatial, type(self).__name__
        if padding_mode != "zeros":
            raise raised_everywhere(ValueError(
                f"{name}: padding_mode={padding_mode!r} is not supported (only 'zeros': the "
                f"halo exchange pads the global boundary with zeros)"))
        if P_x.dim != n + 2:
            raise raised_everywhere(PartitionError(
                f"{name}: the input partition must have {n + 2} dimensions (N, C, "
                f"spatial...), got {P_x.shape}"))
        self.k = per_dim("kernel_size", name, kernel_size, n, exact=True)
        self.s = per_dim("stride", name, stride, n)
        self.d = per_dim("dilation", name, dilation, n)
        self.pads = self._padding(padding, name)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.P_x, self.P_w, self.P_y = self._partitions(P_x, P_w, P_y, name)
        pb, pco, pci, sp = self.P_w.shape[0], self.P_w.shape[1], self.P_w.shape[2], \
            self.P_w.shape[3:]
        # groups with split channels: each worker's weight block, expanded to a dense
        # (co block, ci block) weight with zeros outside the groups, is one local conv
        self.grouped_split = groups != 1 and (pco > 1 or pci > 1)
        for what, c, p in (("in_channels", in_channels, pci), ("out_channels", out_channels, pco)):
            if c < p:
                raise raised_everywhere(PartitionError(
                    f"{name}: {what}={c} cannot be split over {p} workers"))
        world = P_x.world
        self.setup(P_x, set(self.P_x.ranks) | set(self.P_w.ranks) | set(self.P_y.ranks))
        dev = device if device is not None else world.device
        seq = _CONV[n][1](in_channels, out_channels, self.k, self.s, 0, self.d, groups=groups,
                          bias=bias, dtype=dtype, device=dev)
        self.wshape = tuple(seq.weight.shape)
        # where the parameters live: P_r (co x ci grid) for w, P_rb (co) for b
        at = self.P_w.world_rank_of
        self.P_r = Partition([at((0, i, j) + (0,) * n) for i in range(pco) for j in range(pci)],
                             (pco, pci) + (1,) * n, world)
        self.P_rb = Partition([at((0, i, 0) + (0,) * n) for i in range(pco)], (pco,), world)
        self.root = Partition([self.P_r.ranks[0]], (1,) * (n + 2), world)
        if self.grouped_split:  # the grouped weight's rows live with the co blocks
            self.P_r = Partition(self.P_rb.ranks, (pco,) + (1,) * (n + 1), world)
        self.weight = parameter(block(seq.weight, self.P_r), seq.weight, n + 2)
        self.bias = parameter(block(seq.bias, self.P_rb), seq.weight, 1) if bias else None
        self.homes = {"weight": (self.P_r, self.wshape)}
        if bias:
            self.homes["bias"] = (self.P_rb, (out_channels,))
        # the data path (every primitive made once, collectively; identities are skipped)
        self.Px_view = self.P_x.reshape((pb, 1, pci) + sp)
        self.Py_view = self.P_y.reshape((pb, pco, 1) + sp)
        self.P_slice = self._slice(self.P_w)  # my output-channel slice of P_w, as x's shape
        self.x_bcast = Broadcast(self.Px_view, self.P_w)
        self.halo = HaloExchange(self.P_slice, (1, 1) + self.k, (1, 1) + self.s,
                                 ((0, 0), (0, 0)) + self.pads, (1, 1) + self.d,
                                 pad_value=0.0, op_padding=True, owns_gradient=True)
        self.P_r5 = self.P_r.reshape((1, pco, 1 if self.grouped_split else pci) + (1,) * n)
        self.w_bcast = Broadcast(self.P_r5, self.P_w)
        self.P_wb = _ci0(self.P_w)  # the bias is added once: on the ci = 0 workers only
        self.P_rb5 = self.P_rb.reshape((1, pco, 1) + (1,) * n)
        self.b_bcast = Broadcast(self.P_rb5, self.P_wb) if bias else None
        self.y_reduce = SumReduce(self.P_w, self.Py_view)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.k}, "
                f"stride={self.s}, padding={self.pads}, dilation={self.d}, "
                f"groups={self.groups}, bias={self.bias is not None}, "
                f"P_x={self.P_x.shape}, P_w={self.P_w.shape}, P_y={self.P_y.shape}")

    # -- construction helpers -------------------------------------------------
    def _padding(self, padding, name: str) -> tuple[tuple[int, int], ...]:
        n = self.spatial
        if padding == "valid":
            return ((0, 0),) * n
        if padding == "same":
            if any(s != 1 for s in self.s):
                raise raised_everywhere(ValueError(
                    f"{name}: padding='same' needs stride 1, got {self.s}"))
            tot = [d * (k - 1) for k, d in zip(self.k, self.d)]
            return tuple((t // 2, t - t // 2) for t in tot)  # torch puts the odd one right
        if isinstance(padding, str):
            raise raised_everywhere(ValueError(
                f"{name}: padding={padding!r} (use an int, a tuple, 'valid' or 'same')"))
        return tuple((p, p) for p in per_dim("padding", name, padding, n))

    def _partitions(self, P_x: Partition, P_w: Partition | None, P_y: Partition | None,
                    name: str) -> tuple[Partition, Partition, Partition]:
        n = self.spatial
        if P_w is None:
            if P_x.shape[1] != 1:
                raise raised_everywhere(PartitionError(
                    f"{name}: P_x {P_x.shape} splits the channels; pass the work partition "
                    f"P_w (P_b, P_co, P_ci, spatial...) and the output partition P_y"))
            P_w = P_x.reshape((P_x.shape[0], 1, 1) + P_x.shape[2:])
            if P_y is None:
                P_y = P_x
        if P_w.dim != n + 3:
            raise raised_everywhere(PartitionError(
                f"{name}: P_w must have {n + 3} dimensions (P_b, P_co, P_ci, spatial...), "
                f"got {P_w.shape}"))
        pb, pco, pci, sp = P_w.shape[0], P_w.shape[1], P_w.shape[2], P_w.shape[3:]
        if P_y is None:  # default: the ci = 0 workers of P_w
            P_y = _ci0(P_w).reshape((pb, pco) + sp)
        want_x, want_y = (pb, pci) + sp, (pb, pco) + sp
        if P_x.shape != want_x:
            raise raised_everywhere(PartitionError(
                f"{name}: P_w {P_w.shape} needs P_x of shape {want_x}, got {P_x.shape}"))
        if P_y.dim != n + 2 or P_y.shape != want_y:
            raise raised_everywhere(PartitionError(
                f"{name}: P_w {P_w.shape} needs P_y of shape {want_y}, got {P_y.shape}"))
        return P_x, P_w, P_y

    def _slice(self, P_w: Partition) -> Partition:
        """This rank's output-channel slice of P_w, shaped like P_x (collective)."""
        sub = P_w.sub([0, 2] + list(range(3, P_w.dim)))
        shape = (P_w.shape[0], P_w.shape[2]) + P_w.shape[3:]
        if not sub.active:
            return Partition.empty(shape, P_w.world)
        return sub.reshape(shape)

    # -- plans ------------------------------------------------------------------
    def make_plan(self, spec: TensorSpec) -> _ConvPlan:
        name, n = self.name, self.spatial
        if not spec.standard or spec.ndim != n + 2:
            raise raised_everywhere(ShapeError(
                f"{name}: expected an (N, C, {'spatial, ' * n}) tensor split the standard way,"
                f" got {spec.describe()}"))
        g = spec.global_shape
        require_nonempty(g, name)
        if g[1] != self.in_channels:
            raise raised_everywhere(ShapeError(
                f"{name}: the blocks over P_x {self.P_x.shape} form a global tensor {g} with "
                f"{g[1]} channels, expected {self.in_channels}"))
        dt, dev = spec.dtype, spec.device_type
        # raises HaloError on every rank, participant or not
        geo = self.halo.geometry_of(TensorSpec(self.P_slice, g, dt, dev))
        m = tuple(x.output_size for x in geo[2:])
        x5 = TensorSpec(self.Px_view, (g[0], 1) + g[1:], dt, dev)
        x_plan = self.x_bcast.plan(x5)
        x_slice = TensorSpec(self.P_slice, g, dt, dev) if self.P_slice.active else None
        h_plan = self.halo.plan(x_slice) if x_slice is not None else None
        wspec = TensorSpec(self.P_r5, self.wshape, dt, dev,
                           (R, 0, R if self.grouped_split else 1) + (R,) * n)
        b_plan = None
        if self.bias is not None:
            b_plan = self.b_bcast.plan(TensorSpec(self.P_rb5, (self.out_channels,), dt, dev,
                                                  (R, 0) + (R,) * (n + 1)))
        y = (g[0], self.out_channels) + m
        yspec = TensorSpec(self.P_w, y, dt, dev, (0, 1, P_) + tuple(range(2, n + 2)))
        out = TensorSpec(self.P_y, y, dt, dev)
        pads = tuple(lo for lo, _ in h_plan.local.pads[2:]) if h_plan is not None else (0,) * n
        empty = self.P_w.active and 0 in yspec.local_shape
        strips = None
        if h_plan is not None and not empty:
            strips = BoundaryStrips.make(h_plan.local, self.k, self.s, self.d, pads,
                                         yspec.local_shape)
        return _ConvPlan(out, x_plan, h_plan, self.w_bcast.plan(wspec), b_plan,
                         self.y_reduce.plan(yspec), x_slice, pads, empty,
                         self._group_map(yspec, x5) if self.grouped_split else None, strips)

    def _group_map(self, yspec: TensorSpec, x5: TensorSpec):
        """(column index into the grouped weight, mask) of this worker's dense
        (co block, ci block) weight: output channel o reads input channel c through the
        grouped weight's column c - group_start(o), if c is in o's group."""
        if not self.P_w.active:
            return None
        c = self.P_w.coords
        o0 = yspec.local_start_of(c)[1]
        o1 = o0 + yspec.local_shape_of(c)[1]
        i0 = x5.local_start_of((c[0], 0) + c[2:])[2]
        i1 = i0 + x5.local_shape_of((c[0], 0) + c[2:])[2]
        per_in, per_out = self.in_channels // self.groups, self.out_channels // self.groups
        o = torch.arange(o0, o1)[:, None]
        col = torch.arange(i0, i1)[None, :] - (o // per_out) * per_in
        ok = (col >= 0) & (col < per_in)
        return col.clamp(0, per_in - 1), ok

    # -- forward ----------------------------------------------------------------
    def run(self, x: torch.Tensor, plan: _ConvPlan) -> torch.Tensor:
        x5 = self.x_bcast.apply_plan(x.unsqueeze(1), plan.x_bcast)
        w = self.w_bcast.apply_plan(self.weight, plan.w_bcast)
        b = self.b_bcast.apply_plan(self.bias, plan.b_bcast) if self.b_bcast is not None else None
        if self.P_w.active:
            xs = x5.squeeze(1)
            strips = plan.strips if self.boundary_strips else None
            xh = xs if strips is not None else self.halo.apply_plan(xs, plan.halo)
            bias_here = self.P_wb.active
            if plan.empty_out:  # this worker has no outputs: keep the graph, skip the op
                y = connect(xh.new_zeros(plan.y_reduce.spec.local_shape), xh, w, b)
            else:
                groups = self.groups
                if plan.groups is not None:
                    col, ok = (t.to(w.device) for t in plan.groups)
                    rows = torch.arange(w.shape[0], device=w.device)[:, None]
                    mask = ok.reshape(ok.shape + (1,) * self.spatial).to(w.dtype)
                    w, groups = w[rows, col] * mask, 1
                bh = b if bias_here else None
                if strips is not None:
                    y = conv_with_strips(self.halo, plan.halo, strips, xs, w, bh, self.s,
                                         self.d, groups)
                else:
                    y = _CONV[self.spatial][0](xh, w, bh, self.s, plan.pads, self.d, groups)
                if b is not None and not bias_here:
                    y = connect(y, b)
        else:
            y = connect(x5.new_zeros(plan.y_reduce.spec.local_shape), x5, w, b)
        return self.y_reduce.apply_plan(y, plan.y_reduce)


def _ci0(P_w: Partition) -> Partition:
    """The workers of ``P_w`` with input-channel coordinate 0, shaped (P_b, P_co, 1, sp..)."""
    shape = P_w.shape[:2] + (1,) + P_w.shape[3:]
    ranks = [P_w.world_rank_of(c[:2] + (0,) + c[3:]) for c in np.ndindex(*shape)]
    return Partition(ranks, shape, P_w.world)


class DistributedConv1d(DistributedConvNd):
    spatial = 1


class DistributedConv2d(DistributedConvNd):
    spatial = 2


class DistributedConv3d(DistributedConvNd):
    spatial = 3
