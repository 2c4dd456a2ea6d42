"""Repartition: move a distributed tensor from one partition to another (generalized
all-to-all). Scatter from one worker (:func:`distribute`) and gather to one worker
(:func:`collect`) are special cases; send/receive between two workers is the smallest.

F: every output worker's block is assembled from the overlapping input blocks.
F*: the reverse repartition (it is a permutation of entries, so F* = F^-1).
"""

from __future__ import annotations

import torch

from ..decomposition import Decomposition
from ..errors import PartitionError, ShapeError
from ..partition import Partition
from ..transport.base import P2P, wait_all
from .base import Primitive, PrimitiveModule, check_same_kind, gather_meta, zero_volume

_TAG = 7


def _boxes(d_from: Decomposition, d_to: Decomposition, P_to: Partition, coords):
    """(peer world rank, my local slices, peer's block shape) for each overlap of my block."""
    mine = d_from.global_slices(coords)
    start = d_from.local_start(coords)
    out = []
    for o in d_to.overlaps(mine):
        local = tuple(slice(g.start - s, g.stop - s) for g, s in zip(o.glob, start))
        out.append((P_to.world_rank_of(o.coords), local, o.shape))
    return out


class RepartitionOp(Primitive):
    """F: blocks of ``P_in`` -> blocks of ``P_out`` of the same global tensor. F*: reverse."""

    def __init__(self, P_in: Partition, P_out: Partition,
                 global_shape: tuple[int, ...] | None = None) -> None:
        if P_in.dim != P_out.dim:
            raise PartitionError(
                f"Repartition: partitions have {P_in.dim} and {P_out.dim} dimensions "
                f"(shapes {P_in.shape} and {P_out.shape})"
            )
        self.P_in, self.P_out, self.world = P_in, P_out, P_in.world
        self.identity = P_in.same_as(P_out)
        self.global_shape = None if global_shape is None else tuple(global_shape)
        ranks = sorted(set(P_in.ranks) | set(P_out.ranks))
        self.member = self.world.rank in ranks
        self.group = self.world.transport.group(ranks) if len(ranks) > 1 else None
        if not self.member:
            self.group = None
        self._ranks = ranks

    # -- shape bookkeeping -----------------------------------------------------
    def _global_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """Global shape from every input block (checked against the decomposition)."""
        if self.global_shape is not None:
            g = self.global_shape
            if self.P_in.active:
                self._check(x, g)
            return g
        metas = gather_meta(self.world, self.group, x, self.P_in.active)
        ranks = self.group.ranks if self.group is not None else (self.world.rank,)
        check_same_kind(metas, ranks, "Repartition")
        by_rank = {r: m[3] for r, m in zip(ranks, metas) if m[0]}
        dims = {len(s) for s in by_rank.values()}
        if dims != {self.P_in.dim}:
            raise ShapeError(
                f"Repartition: input tensors have {sorted(dims)} dimensions but the partition "
                f"{self.P_in.shape} has {self.P_in.dim}"
            )
        g = []
        for d in range(self.P_in.dim):
            tot = 0
            for c in range(self.P_in.shape[d]):
                coords = [0] * self.P_in.dim
                coords[d] = c
                tot += by_rank[self.P_in.world_rank_of(coords)][d]
            g.append(tot)
        g = tuple(g)
        dec = Decomposition(g, self.P_in.shape)
        for r, s in by_rank.items():
            want = dec.local_shape(self.P_in.coords_of(self.P_in.ranks.index(r)))
            if tuple(s) != want:
                bad = next(d for d in range(len(s)) if s[d] != want[d])
                raise ShapeError(
                    f"Repartition: rank {r} holds a block of shape {tuple(s)} but the "
                    f"decomposition of global shape {g} over {self.P_in.shape} gives it "
                    f"{want} (dimension {bad})"
                )
        return g

    def _check(self, x, g):
        want = Decomposition(g, self.P_in.shape).local_shape(self.P_in.coords)
        if tuple(x.shape) != want:
            raise ShapeError(f"Repartition: rank {self.world.rank} holds shape "
                             f"{tuple(x.shape)}, expected {want} of global {g}")

    # -- the move ----------------------------------------------------------------
    def _move(self, x: torch.Tensor, g, P_a: Partition, P_b: Partition, dtype, device):
        dec_a, dec_b = Decomposition(g, P_a.shape), Decomposition(g, P_b.shape)
        me = self.world.rank
        ops, unpack, out = [], [], None
        if P_b.active:
            out = torch.empty(dec_b.local_shape(P_b.coords), dtype=dtype, device=device)
        local_src = {}
        if P_a.active:
            for peer, sl, _ in _boxes(dec_a, dec_b, P_b, P_a.coords):
                if peer == me:
                    local_src = {"sl": sl}
                    continue
                ops.append(P2P("send", x[sl].contiguous(), peer, _TAG))
        if P_b.active:
            for peer, sl, shape in _boxes(dec_b, dec_a, P_a, P_b.coords):
                if peer == me:
                    out[sl] = x[local_src["sl"]]
                    continue
                buf = torch.empty(shape, dtype=dtype, device=device)
                ops.append(P2P("recv", buf, peer, _TAG))
                unpack.append((sl, buf))
        wait_all(self.world.transport.batch_p2p(ops), self.world.timeout)
        for sl, buf in unpack:
            out[sl] = buf
        if out is None:
            return zero_volume(len(g), like=x)
        return out

    def forward(self, x):
        if self.identity:
            return x, None
        if not self.member:
            return zero_volume(x.dim(), like=x), None
        g = self._global_shape(x)
        return self._move(x.contiguous(), g, self.P_in, self.P_out, x.dtype, x.device), g

    def adjoint(self, dy, g):
        if self.identity:
            return dy
        if not self.member:
            return zero_volume(dy.dim(), like=dy)
        return self._move(dy, g, self.P_out, self.P_in, dy.dtype, dy.device)


class Repartition(PrimitiveModule):
    """Move a tensor from ``P_in`` to ``P_out``; adjoint: the reverse move.

    Identity (no copy) when the partitions are equal. ``global_shape`` skips the per-call
    metadata exchange.
    """

    def __init__(self, P_in: Partition, P_out: Partition,
                 global_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.op = RepartitionOp(P_in, P_out, global_shape)


def distribute(x: torch.Tensor, P_root: Partition, P_out: Partition) -> torch.Tensor:
    """Scatter a tensor held by the one worker of ``P_root`` over ``P_out``; adjoint collect."""
    if P_root.size != 1:
        raise PartitionError(f"distribute: the root partition must have one worker, has "
                             f"{P_root.size}")
    return RepartitionOp(P_root, P_out)(x)


def collect(x: torch.Tensor, P_in: Partition, P_root: Partition) -> torch.Tensor:
    """Gather a tensor distributed over ``P_in`` to the one worker of ``P_root``."""
    if P_root.size != 1:
        raise PartitionError(f"collect: the root partition must have one worker, has "
                             f"{P_root.size}")
    return RepartitionOp(P_in, P_root)(x)


class SendRecv(PrimitiveModule):
    """Send a ``ndim``-tensor from world rank ``src`` to world rank ``dst``; adjoint: send
    the gradient back. (A repartition between two one-worker partitions.)"""

    def __init__(self, src: int, dst: int, ndim: int, world=None) -> None:
        super().__init__()
        P_a = Partition([src], (1,) * ndim, world)
        P_b = Partition([dst], (1,) * ndim, world)
        self.op = RepartitionOp(P_a, P_b)
