"""Distributed convolution: input, output and weights partitioned over any of their dims.

Partitions (D spatial dims): ``P_x`` = (P_b, P_ci, P_0..), ``P_y`` = (P_b, P_co, P_0..) and
the work partition ``P_w`` = (P_b, P_co, P_ci, P_0..). The weight block (co_i, ci_j) lives on
the worker of ``P_w`` at (0, i, j, 0..); the bias block co_i on (0, i, 0, 0..).

Forward:  x <- H x (halo exchange on P_x, global zero padding);
          x^ <- B[P_x -> P_w] x;  w^ <- B[P_r -> P_w] w;  b^ <- B[P_rb -> P_w(ci=0)] b;
          y^ = conv(x^, w^, b^) locally with padding 0;  y <- R[P_w -> P_y] y^.
Adjoint (by autograd): B[P_y -> P_w] dy; local conv adjoints; R of dx^ to P_x, of dw^/db^ to
where the weights live; H* adds the halo gradients back into the neighbours' bulk.

The constructor picks the simplest case the partitions allow: spatial-only (``P_w`` not
given: weights on P_x's first worker, no x broadcast, no y reduce), channel-only and the
general form are the same algorithm with the identity steps skipped. Batch partitions (data
parallelism) sum the weight gradients over the batch axis through the adjoint broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..decomposition import Decomposition
from ..errors import PartitionError, ShapeError
from ..halo import HaloExchange
from ..partition import Partition
from ..primitives import BroadcastOp, RepartitionOp, SumReduceOp
from ._halo import exchange_for_op, op_halo
from ._params import block, connect, parameter

_CONV = {1: (F.conv1d, torch.nn.Conv1d), 2: (F.conv2d, torch.nn.Conv2d),
         3: (F.conv3d, torch.nn.Conv3d)}


def _tuple(v, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, Sequence) else (int(v),) * n


def _same(a: Partition, b: Partition) -> bool:
    return a.ranks == b.ranks and a.shape == b.shape


class DistributedConvNd(torch.nn.Module):
    """N-D convolution of a tensor partitioned over ``P_x`` (see the module docstring).

    ``P_w`` omitted: spatial (and batch) partition only, ``P_x`` = (P_b, 1, P_0..), output on
    ``P_y`` = ``P_x``; weights on P_x's first worker. ``P_w`` given: the general form; ``P_y``
    defaults to the ``P_w`` workers with ci coordinate 0.

    Parameters are initialized like the sequential torch layer from the current RNG state,
    so equal seeds on every rank give the sequential layer's values; every worker keeps its
    block. ``padding`` may be an int, a tuple, ``"valid"`` or ``"same"``; only
    ``padding_mode="zeros"`` is supported (the halo's global padding is zeros).
    """

    spatial: int = 2

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
            raise ValueError(f"{name}: padding_mode={padding_mode!r} is not supported "
                             f"(only 'zeros': the halo exchange pads the global boundary "
                             f"with zeros)")
        if P_x.dim != n + 2:
            raise PartitionError(f"{name}: the input partition must have {n + 2} dimensions "
                                 f"(N, C, spatial...), got {P_x.shape}")
        self.k, self.s, self.d = _tuple(kernel_size, n), _tuple(stride, n), _tuple(dilation, n)
        self.pads = self._padding(padding, name)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.P_x, self.P_w, self.P_y = self._partitions(P_x, P_w, P_y, name)
        pb, pco, pci, sp = self.P_w.shape[0], self.P_w.shape[1], self.P_w.shape[2], \
            self.P_w.shape[3:]
        if groups != 1 and (pco > 1 or pci > 1):
            raise PartitionError(f"{name}: groups={groups} needs unpartitioned channels "
                                 f"(P_w {self.P_w.shape} splits them)")
        for what, c, p in (("in_channels", in_channels, pci), ("out_channels", out_channels, pco)):
            if c < p:
                raise PartitionError(f"{name}: {what}={c} cannot be split over {p} workers")
        world = P_x.world
        dev = device if device is not None else world.device
        seq = _CONV[n][1](in_channels, out_channels, self.k, self.s, 0, self.d, groups=groups,
                          bias=bias, dtype=dtype, device=dev)
        wshape = tuple(seq.weight.shape)
        # where the parameters live: P_r (co x ci grid) for w, P_rb (co) for b
        at = self.P_w.world_rank_of
        self.P_r = Partition([at((0, i, j) + (0,) * n) for i in range(pco) for j in range(pci)],
                             (pco, pci) + (1,) * n, world)
        self.P_rb = Partition([at((0, i, 0) + (0,) * n) for i in range(pco)], (pco,), world)
        self.root = Partition([self.P_r.ranks[0]], (1,) * (n + 2), world)
        self.weight = parameter(block(seq.weight, self.P_r), seq.weight, n + 2)
        self.bias = parameter(block(seq.bias, self.P_rb), seq.weight, 1) if bias else None

        # receiving shapes are static: skip the per-call metadata exchange
        me = self.P_w.coords
        w_dec = Decomposition(wshape, self.P_r.shape)
        w_recv = w_dec.local_shape((me[1], me[2]) + (0,) * n) if me else wshape
        self._w_bcast = BroadcastOp(self.P_r.reshape((1, pco, pci) + (1,) * n), self.P_w,
                                    shape=w_recv)
        self._b_bcast = None
        self._bias_here = False
        if bias:
            P_wb = _ci0(self.P_w)  # the bias is added once: on the ci = 0 workers only
            self._bias_here = P_wb.active
            b_recv = (Decomposition((out_channels,), (pco,)).local_shape((me[1],)) if me
                      else (out_channels,))
            self._b_bcast = BroadcastOp(self.P_rb.reshape((1, pco, 1) + (1,) * n), P_wb,
                                        shape=b_recv)
        # x: P_x viewed with a co axis of 1; y: P_y viewed with a ci axis of 1
        Px_view = self.P_x.reshape((pb, 1, pci) + sp)
        Py_view = self.P_y.reshape((pb, pco, 1) + sp)
        self._x_bcast = None if _same(Px_view, self.P_w) else BroadcastOp(Px_view, self.P_w)
        self._y_reduce = None if _same(Py_view, self.P_w) else SumReduceOp(self.P_w, Py_view)
        # spatial form: the halo buffer holds the asymmetric part of the zero padding, the
        # local conv adds the symmetric part (no copy where a worker has nothing to exchange).
        # General form: the P_w workers outside P_x have no halo plan: the halo pads it all.
        if self._x_bcast is None:
            self.halo = op_halo(self.P_x, (1, 1) + self.k, (1, 1) + self.s,
                                ((0, 0), (0, 0)) + self.pads, (1, 1) + self.d, 0.0)
        else:
            self.halo = HaloExchange(self.P_x, (1, 1) + self.k, (1, 1) + self.s,
                                     ((0, 0), (0, 0)) + self.pads, (1, 1) + self.d,
                                     pad_value=0.0)
        self._collect_w = RepartitionOp(self.P_r, self.root, wshape)
        self._collect_b = (RepartitionOp(self.P_rb, Partition(self.root.ranks, (1,), world),
                                         (out_channels,)) if bias else None)

    # -- construction helpers -------------------------------------------------
    def _padding(self, padding, name: str) -> tuple[tuple[int, int], ...]:
        n = self.spatial
        if padding == "valid":
            return ((0, 0),) * n
        if padding == "same":
            if any(s != 1 for s in self.s):
                raise ValueError(f"{name}: padding='same' needs stride 1, got {self.s}")
            tot = [d * (k - 1) for k, d in zip(self.k, self.d)]
            return tuple((t // 2, t - t // 2) for t in tot)  # torch puts the odd one right
        if isinstance(padding, str):
            raise ValueError(f"{name}: padding={padding!r} (use an int, a tuple, 'valid' or "
                             f"'same')")
        return tuple((p, p) for p in _tuple(padding, n))

    def _partitions(self, P_x: Partition, P_w: Partition | None, P_y: Partition | None,
                    name: str) -> tuple[Partition, Partition, Partition]:
        n = self.spatial
        if P_w is None:
            if P_x.shape[1] != 1:
                raise PartitionError(
                    f"{name}: P_x {P_x.shape} splits the channels; pass the work partition "
                    f"P_w (P_b, P_co, P_ci, spatial...) and the output partition P_y")
            P_w = P_x.reshape((P_x.shape[0], 1, 1) + P_x.shape[2:])
            if P_y is None:
                P_y = P_x
        if P_w.dim != n + 3:
            raise PartitionError(f"{name}: P_w must have {n + 3} dimensions (P_b, P_co, P_ci, "
                                 f"spatial...), got {P_w.shape}")
        pb, pco, pci, sp = P_w.shape[0], P_w.shape[1], P_w.shape[2], P_w.shape[3:]
        if P_y is None:  # default: the ci = 0 workers of P_w
            P_y = _ci0(P_w).reshape((pb, pco) + sp)
        want_x, want_y = (pb, pci) + sp, (pb, pco) + sp
        if P_x.shape != want_x:
            raise PartitionError(f"{name}: P_w {P_w.shape} needs P_x of shape {want_x}, got "
                                 f"{P_x.shape}")
        if P_y.dim != n + 2 or P_y.shape != want_y:
            raise PartitionError(f"{name}: P_w {P_w.shape} needs P_y of shape {want_y}, got "
                                 f"{P_y.shape}")
        return P_x, P_w, P_y

    # -- forward ----------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        """Local blocks must tile a global (N, in_channels, ...) tensor: checked from the
        global shape (collective over P_x, once per local shape), so every worker of P_x
        raises the same error."""
        if not self.P_x.active:
            return
        n, name = self.spatial, type(self).__name__
        if x.dim() != n + 2:
            raise ShapeError(f"{name}: expected (N, C, ...) blocks with {n} spatial dims, got "
                             f"{tuple(x.shape)}")
        g = self.halo.global_shape_of(x)
        if g[1] != self.in_channels:
            raise ShapeError(f"{name}: the blocks over P_x {self.P_x.shape} form a global "
                             f"tensor {g} with {g[1]} channels, expected {self.in_channels}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self._check(x)
        except ShapeError:
            if self._x_bcast is not None:  # the P_w ranks outside P_x raise too, not wait
                self._x_bcast.abort(x.new_zeros(0))
            raise
        if self.halo.op_padding:
            xh, conv_pad = exchange_for_op(self.halo, x, self.spatial)
        else:
            xh, conv_pad = self.halo(x), 0
        if self._x_bcast is not None:
            xh = self._x_bcast(xh)
        w = self._w_bcast(self.weight)
        b = self._b_bcast(self.bias) if self._b_bcast is not None else None
        if self.P_w.active:
            y = _CONV[self.spatial][0](xh, w, b if self._bias_here else None, self.s,
                                       conv_pad, self.d, self.groups)
            if b is not None and not self._bias_here:
                y = connect(y, b)
        else:
            y = connect(xh, w, b)  # zero-volume; keeps every adjoint in the graph
        if self._y_reduce is not None:
            y = self._y_reduce(y)
        return y

    # -- global state -------------------------------------------------------------
    def load_global_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Keep this rank's blocks of a sequential layer's state dict (every rank passes it)."""
        with torch.no_grad():
            self.weight.data = block(sd["weight"], self.P_r).to(self.weight)
            if self.bias is not None:
                self.bias.data = block(sd["bias"], self.P_rb).to(self.weight)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: full weight/bias on the root worker, ``{}`` elsewhere."""
        return self._collect(self.weight.detach(),
                             self.bias.detach() if self.bias is not None else None)

    def global_grads(self) -> dict[str, torch.Tensor]:
        """Collective: full weight/bias gradients on the root worker, ``{}`` elsewhere."""
        def g(p):
            return p.grad if p.grad is not None else torch.zeros_like(p)
        return self._collect(g(self.weight), g(self.bias) if self.bias is not None else None)

    def _collect(self, w: torch.Tensor, b: torch.Tensor | None) -> dict[str, torch.Tensor]:
        w = self._collect_w(w)
        b = self._collect_b(b) if self._collect_b is not None else None
        if not self.root.active:
            return {}
        return {"weight": w, **({"bias": b} if b is not None else {})}


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
