"""Broadcast and SumReduce between partitions: each other's adjoint.

Partition broadcasting rule (source to destination, like NumPy): in every dimension the
source extent equals the destination extent or is 1; a source worker's block is copied to
every destination worker whose coordinates match it where the source extent is not 1.
SumReduce is the same map read backwards: the blocks of all matching source workers are
summed into one destination worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PartitionError, ShapeError
from ..partition import Partition
from ..transport.base import Group, wait_all
from .base import (
    Primitive,
    PrimitiveModule,
    check_same_kind,
    gather_meta,
    signal_failure,
    zero_volume,
)


@dataclass
class _Fan:
    """One worker of the 'one' side and the workers of the 'many' side it serves."""

    one: int
    many: tuple[int, ...]
    group: Group | None  # None unless this rank is a member and there is someone else


class FanPlan:
    """Who talks to whom for a broadcast from ``P_one`` to ``P_many`` (or reduce back)."""

    def __init__(self, P_one: Partition, P_many: Partition, what: str) -> None:
        if P_one.dim != P_many.dim:
            raise PartitionError(
                f"{what}: partitions have {P_one.dim} and {P_many.dim} dimensions; "
                f"shapes {P_one.shape} and {P_many.shape}"
            )
        for d, (a, b) in enumerate(zip(P_one.shape, P_many.shape)):
            if a != b and a != 1:
                raise PartitionError(
                    f"{what}: partition shapes {P_one.shape} and {P_many.shape} do not "
                    f"broadcast (dimension {d}: {a} vs {b})"
                )
        self.world = P_one.world
        me = self.world.rank
        fans: dict[int, list[int]] = {r: [] for r in P_one.ranks}
        for i in range(P_many.size):
            c = P_many.coords_of(i)
            src = tuple(ci if s > 1 else 0 for ci, s in zip(c, P_one.shape))
            fans[P_one.world_rank_of(src)].append(P_many.ranks[i])
        self.fans: list[_Fan] = []
        self.mine_one: _Fan | None = None   # the fan where I am the 'one'
        self.mine_many: _Fan | None = None  # the fan that serves me as a 'many'
        for one in P_one.ranks:  # deterministic order on every rank
            many = tuple(fans[one])
            members = {one, *many}
            group = None
            if len(members) > 1:  # world-collective creation, same order everywhere
                group = self.world.transport.group(sorted(members))
                if me not in members:
                    group = None
            f = _Fan(one, many, group)
            self.fans.append(f)
            if me == one:
                self.mine_one = f
            if me in many:
                self.mine_many = f
        self.P_one, self.P_many = P_one, P_many
        ranks = sorted(set(P_one.ranks) | set(P_many.ranks))
        self._meta = self.world.transport.group(ranks) if len(ranks) > 1 else None
        if me not in ranks:
            self._meta = None

    def meta_group(self) -> Group | None:
        return self._meta

    # -- the two directions ---------------------------------------------------
    def _first_as_one(self) -> bool:
        """Whether this rank's 'one' fan comes before its 'many' fan in ``self.fans``.

        Two fans can share a communicator (same member set, different roots, e.g. two ranks
        swapping blocks); every rank must post their collectives in the same order.
        """
        if self.mine_one is None or self.mine_many is None:
            return True
        return self.fans.index(self.mine_one) <= self.fans.index(self.mine_many)

    def broadcast(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """'one' workers send ``x``; 'many' workers return a copy of their 'one''s block."""
        me, tr = self.world.rank, self.world.transport
        works, out = [], None

        def send() -> None:
            if self.mine_one is not None and self.mine_one.group is not None:
                works.append(tr.broadcast(x, me, self.mine_one.group))

        def receive() -> None:
            nonlocal out
            if self.mine_many is not None:
                f = self.mine_many
                if f.one == me:
                    out = x
                else:
                    out = torch.empty(shape, dtype=x.dtype, device=x.device)
                    works.append(tr.broadcast(out, f.one, f.group))

        for step in ((send, receive) if self._first_as_one() else (receive, send)):
            step()
        wait_all(works, self.world.timeout)
        return out if out is not None else zero_volume(x.dim(), like=x)

    def reduce(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """'many' workers send ``x``; each 'one' worker returns the sum of its fan's blocks."""
        me, tr = self.world.rank, self.world.transport
        works, out = [], None

        def send() -> None:
            f = self.mine_many
            if f is not None and f.one != me and f.group is not None:
                buf = x.clone()  # the backend may use it as scratch
                works.append(tr.reduce(buf, f.one, f.group))

        def receive() -> None:
            nonlocal out
            f = self.mine_one
            if f is not None:
                out = x.clone() if me in f.many else torch.zeros(shape, dtype=x.dtype,
                                                                  device=x.device)
                if f.group is not None:
                    works.append(tr.reduce(out, me, f.group))

        for step in ((receive, send) if self._first_as_one() else (send, receive)):
            step()
        wait_all(works, self.world.timeout)
        return out if out is not None else zero_volume(x.dim(), like=x)


def _shared_shape(plan: FanPlan, x: torch.Tensor, sender_active: bool, what: str,
                  static: tuple[int, ...] | None) -> dict[int, tuple[int, ...]]:
    """Block shape of every sending rank (metadata exchange unless ``static`` is given)."""
    if static is not None:
        return {}
    g = plan.meta_group()
    metas = gather_meta(plan.world, g, x, sender_active, what)
    ranks = g.ranks if g is not None else (plan.world.rank,)
    check_same_kind(metas, ranks, what)
    return {r: m[3] for r, m in zip(ranks, metas) if m[0]}


class BroadcastOp(Primitive):
    """F: copy each source block to its destination workers. F*: SumReduce back."""

    def __init__(self, P_src: Partition, P_dst: Partition, *, transpose_src: bool = False,
                 shape: tuple[int, ...] | None = None) -> None:
        if transpose_src:
            P_src = P_src.transpose()
        self.plan = FanPlan(P_src, P_dst, "Broadcast")
        self.shape = None if shape is None else tuple(shape)

    def forward(self, x):
        p = self.plan
        shapes = _shared_shape(p, x, p.mine_one is not None, "Broadcast", self.shape)
        src = p.mine_many.one if p.mine_many is not None else None
        shape = self.shape or (shapes.get(src) if src is not None else None) or tuple(x.shape)
        x = x.contiguous()
        y = p.broadcast(x, shape)
        return y, (tuple(x.shape), x.dtype)

    def adjoint(self, dy, state):
        shape, dtype = state
        return self.plan.reduce(dy, shape)

    def abort(self, like: torch.Tensor) -> None:
        """Instead of ``forward`` on a rank whose input was rejected: the other ranks raise
        (only where the op exchanges metadata, i.e. without a ``shape`` hint)."""
        if self.shape is None:
            signal_failure(self.plan.world, self.plan.meta_group(), like)


class SumReduceOp(Primitive):
    """F: sum the matching source blocks into each destination worker. F*: Broadcast back."""

    def __init__(self, P_src: Partition, P_dst: Partition, *, transpose_dst: bool = False,
                 shape: tuple[int, ...] | None = None) -> None:
        if transpose_dst:
            P_dst = P_dst.transpose()
        self.plan = FanPlan(P_dst, P_src, "SumReduce")
        self.shape = None if shape is None else tuple(shape)

    def forward(self, x):
        p = self.plan
        shapes = _shared_shape(p, x, p.mine_many is not None, "SumReduce", self.shape)
        if p.mine_one is not None and self.shape is None:
            fan = set(p.mine_one.many)
            got = {s for r, s in shapes.items() if r in fan}
            if len(got) > 1:
                raise ShapeError(f"SumReduce: blocks summed into rank {p.mine_one.one} have "
                                 f"different shapes {sorted(got)}")
        shape = self.shape
        if shape is None and p.mine_one is not None:
            shape = shapes.get(p.mine_one.many[0], tuple(x.shape))
        y = p.reduce(x.contiguous(), shape or tuple(x.shape))
        return y, tuple(x.shape)

    def adjoint(self, dy, state):
        y = self.plan.broadcast(dy.contiguous(), state)
        return y.clone() if y.data_ptr() == dy.data_ptr() and y.numel() else y


class Broadcast(PrimitiveModule):
    """Copy blocks from ``P_src`` to ``P_dst`` (partition broadcasting rule); adjoint SumReduce.

    ``shape`` fixes the block shape (skips the per-call metadata exchange);
    ``transpose_src`` reads ``P_src``'s grid transposed (used by the affine layer).
    """

    def __init__(self, P_src: Partition, P_dst: Partition, *, transpose_src: bool = False,
                 shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.op = BroadcastOp(P_src, P_dst, transpose_src=transpose_src, shape=shape)


class SumReduce(PrimitiveModule):
    """Sum blocks of ``P_src`` into ``P_dst`` (reverse broadcasting rule); adjoint Broadcast."""

    def __init__(self, P_src: Partition, P_dst: Partition, *, transpose_dst: bool = False,
                 shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.op = SumReduceOp(P_src, P_dst, transpose_dst=transpose_dst, shape=shape)
