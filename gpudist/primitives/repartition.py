"""Repartition: move a distributed tensor from one partition to another (generalized
all-to-all). Scatter from one worker (:func:`distribute`) and gather to one worker
(:func:`collect`) are special cases; send/receive between two workers is the smallest.

F: every output worker's block is assembled from the overlapping input blocks.
F*: the reverse repartition (a permutation of entries, so F* = F^-1).

One all-to-all(v) over the union of both partitions moves everything. A worker's outgoing
boxes that lie back to back in its block (in peer order) are sent straight from it, and
incoming boxes that lie back to back in its output block are received straight into it;
otherwise they are packed/unpacked with one kernel call (:mod:`gpudist.kernels`) through a
staging buffer the plan keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..kernels import Packers
from ..kernels.regions import box_views, collapse, dense_strides
from ..partition import Partition
from ..spec import DistTensor, TensorSpec
from .base import Plan, Primitive, empty_of, zero_volume

Box = tuple[tuple[int, int], ...]
_CPU = torch.device("cpu")


@dataclass
class _Side:
    """One direction's boxes of this worker, one per peer slot of the group."""

    boxes: list[Box | None]
    counts: list[int]
    run: int | None  # flat offset where the boxes lie back to back (None: pack)
    shape: tuple[int, ...]
    moved: tuple[Box, ...] = ()  # the non-empty boxes, in peer order (what is packed)

    @property
    def total(self) -> int:
        return sum(self.counts)


def _side(shape: tuple[int, ...], boxes: list[Box | None]) -> _Side:
    counts = [math.prod(b - a for a, b in box) if box else 0 for box in boxes]
    st, at, run = dense_strides(shape), None, None
    ok = True
    for box, k in zip(boxes, counts):
        if not k:
            continue
        base, sizes, strides = collapse(box, st)
        if not ((len(sizes) == 1 and strides == [1]) or k == 1):
            ok = False
            break
        if at is None:
            run = at = base
        elif base != at:
            ok = False
            break
        at += k
    return _Side(boxes, counts, run if ok else None, shape, tuple(b for b in boxes if b))


def _bounds(spec: TensorSpec, rank: int) -> tuple[list[int], list[int]] | None:
    """(start, end) of world rank ``rank``'s block under ``spec``; None if it has none."""
    P = spec.partition
    if rank not in P.ranks:
        return None
    c = P.coords_of(P.ranks.index(rank))
    s0 = spec.local_start_of(c)
    return s0, [a + n for a, n in zip(s0, spec.local_shape_of(c))]


def _common(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]
            ) -> list[tuple[int, int]]:
    """Per dimension the (lo, hi) both blocks cover, in global coordinates."""
    return [(max(x, y), min(e, f)) for x, y, e, f in zip(a[0], b[0], a[1], b[1])]


def _overlaps(spec_a: TensorSpec, spec_b: TensorSpec, slots: Sequence[int]) -> list[Box | None]:
    """For each peer slot (world rank), the box of my block under ``spec_a`` that the
    peer's block under ``spec_b`` covers, in my local coordinates."""
    mine = _bounds(spec_a, spec_a.partition.world.rank)
    out: list[Box | None] = []
    for r in slots:
        theirs = _bounds(spec_b, r) if mine is not None else None
        box = None
        if theirs is not None:
            box = tuple((lo - a0, hi - a0) for (lo, hi), a0 in zip(_common(mine, theirs),
                                                                   mine[0]))
        out.append(box if box is not None and all(hi > lo for lo, hi in box) else None)
    return out


def _even(spec_in: TensorSpec, spec_out: TensorSpec, slots: Sequence[int]) -> bool:
    """Whether every member of the group sends every member the same nonzero number of
    entries (found from the specs alone, so every rank answers alike)."""
    counts = set()
    for a in slots:
        for b in slots:
            ba, bb = _bounds(spec_in, a), _bounds(spec_out, b)
            if ba is None or bb is None:
                return False
            counts.add(math.prod(max(0, hi - lo) for lo, hi in _common(ba, bb)))
            if len(counts) > 1:
                return False
    return len(counts) == 1 and 0 not in counts


class Repartition(Primitive):
    """Move a tensor from ``P_in`` to ``P_out``; adjoint: the reverse move.

    The identity (no copy) when the partitions are equal.
    """

    name = "Repartition"
    collective = "some"  # (a worker may wait for its senders alone)

    def __init__(self, P_in: Partition, P_out: Partition) -> None:
        if P_in.dim != P_out.dim:
            raise raised_everywhere(PartitionError(
                f"Repartition: partitions have {P_in.dim} and {P_out.dim} dimensions "
                f"(shapes {P_in.shape} and {P_out.shape})"))
        self.P_in, self.P_out = P_in, P_out
        super().__init__(P_in.world, set(P_in.ranks) | set(P_out.ranks),
                         (P_in.key, P_out.key))
        self.in_partition = P_in
        self._packers = Packers()

    def out_spec(self, spec: TensorSpec) -> TensorSpec:
        if not spec.standard:
            raise raised_everywhere(ShapeError(
                f"Repartition moves tensors split the standard way (tensor dim i along "
                f"partition dim i); got {spec.describe()}"))
        return TensorSpec(self.P_out, spec.global_shape, spec.dtype, spec.device_type)

    def make_plan(self, spec, out):
        if self.P_in == self.P_out:
            return None, True
        slots = list(self.group.ranks) if self.group is not None else [self.world.rank]
        fwd_send = _side(spec.local_shape, _overlaps(spec, out, slots))
        fwd_recv = _side(out.local_shape, _overlaps(out, spec, slots))
        return (fwd_send, fwd_recv, _even(spec, out, slots)), False

    def _move(self, x: torch.Tensor, send: _Side, recv: _Side, name: str, even: bool
              ) -> torch.Tensor:
        tr = self.world.transport
        out = self.buffers.get(name, recv.shape, x.dtype, x.device)
        if send.run is not None:
            sbuf = x.contiguous().view(-1)[send.run:send.run + send.total]
        else:
            sbuf = self.buffers.get(name + "-send", (send.total,), x.dtype, x.device)
            self._packers.of(x).pack(x, send.moved, out=sbuf)
        if recv.run is not None:
            rbuf = out.view(-1)[recv.run:recv.run + recv.total]
        else:
            rbuf = self.buffers.get(name + "-recv", (recv.total,), x.dtype, x.device)
        if self.group is None:  # one worker: a local copy
            rbuf.copy_(sbuf)
        else:
            tr.wait([tr.all_to_all(rbuf, sbuf, recv.counts, send.counts, self.group, even)])
        if recv.run is None:
            self._packers.of(out).unpack(rbuf, out, recv.moved)
        return out

    def steady(self, plan: Plan):
        if self.group is None:  # (one worker: a local copy)
            return None, None
        send, recv, even = plan.local
        return (self._steady_move(plan, send, recv, "out", even, plan.spec, self.P_out,
                                  plan.out, self.forward),
                self._steady_move(plan, recv, send, "adjoint", even, plan.out, self.P_in,
                                  plan.spec, self.adjoint))

    def _steady_move(self, plan: Plan, send: _Side, recv: _Side, name: str, even: bool,
                     given: TensorSpec, P_to: Partition, result: TensorSpec,
                     general: Callable) -> Callable | None:
        """:meth:`_move`'s steady form for host blocks of spec ``given``: the all-to-all
        prepared with its counts, and each packed or unpacked box a view of a buffer kept
        for it (:func:`~gpudist.kernels.regions.box_views`, the torch packer's work done
        once), where the torch packer serves."""
        dt, shape = given.dtype, given.local_shape
        if self._packers.of(torch.empty(0, dtype=dt)).name != "torch":
            return None
        a2a = self.world.transport.prepare("all_to_all", self.group,
                                           splits=(recv.counts, send.counts, even))
        slot = self.buffers.slot(name, recv.shape, dt, _CPU)
        s_at, r_at, active = send.run, recv.run, P_to.active
        nothing = empty_of(result.ndim, dt, _CPU)
        kept: list = []  # (send buffer, its views, receive buffer, its views): taken at
        # the first call (none for a direction never run), kept by the closure (never
        # handed out)

        def buffers() -> list:
            sbuf = rbuf = packs = unpacks = None
            if s_at is None:
                sbuf = self.buffers.get(name + "-send", (send.total,), dt, _CPU)
                packs = box_views(sbuf, send.moved, dense_strides(shape))
            if r_at is None:
                rbuf = self.buffers.get(name + "-recv", (recv.total,), dt, _CPU)
                unpacks = box_views(rbuf, recv.moved, dense_strides(recv.shape))
            kept.extend((sbuf, packs, rbuf, unpacks))
            return kept

        def body(x: torch.Tensor) -> torch.Tensor:
            if x.shape != shape:
                return general(x, plan)
            sbuf, packs, rbuf, unpacks = kept or buffers()
            x, out = x.contiguous(), slot.take()
            if packs is None:
                s = x.view(-1)[s_at:s_at + send.total]
            else:
                x0, s = x.storage_offset(), sbuf
                for view, shp, st, at in packs:
                    view.copy_(x.as_strided(shp, st, x0 + at))
            a2a(rbuf if unpacks is not None else out.view(-1)[r_at:r_at + recv.total], s)
            if unpacks is not None:
                for view, shp, st, at in unpacks:
                    out.as_strided(shp, st, at).copy_(view)
            return out if active else nothing()
        return body

    def forward(self, x, plan: Plan):
        send, recv, even = plan.local
        y = self._move(x, send, recv, "out", even)
        return y if self.P_out.active else zero_volume(plan.out.ndim, like=x)

    def adjoint(self, dy, plan: Plan):
        send, recv, even = plan.local
        dx = self._move(dy, recv, send, "adjoint", even)
        return dx if self.P_in.active else zero_volume(plan.spec.ndim, like=dy)


def distribute(x: DistTensor | torch.Tensor, P_root: Partition, P_out: Partition,
               global_shape: Sequence[int] | None = None) -> DistTensor | torch.Tensor:
    """Scatter a tensor held by the one worker of ``P_root`` over ``P_out``; adjoint
    collect. With ``global_shape`` (every rank knows it) the result is a
    :class:`~gpudist.spec.DistTensor` and no shapes are exchanged; each call builds a
    Repartition, whose first call is checked across ranks (one small metadata exchange):
    in a loop, build ``Repartition(P_root, P_out)`` once and call it."""
    if P_root.size != 1:
        raise raised_everywhere(PartitionError(
            f"distribute: the root partition must have one worker, has {P_root.size}"))
    if global_shape is not None and not isinstance(x, DistTensor):
        x = DistTensor.from_local(x, P_root, global_shape)
    return Repartition(P_root, P_out)(x)


def collect(x: DistTensor | torch.Tensor, P_in: Partition, P_root: Partition
            ) -> DistTensor | torch.Tensor:
    """Gather a tensor distributed over ``P_in`` to the one worker of ``P_root``."""
    if P_root.size != 1:
        raise raised_everywhere(PartitionError(
            f"collect: the root partition must have one worker, has {P_root.size}"))
    return Repartition(P_in, P_root)(x)


class SendRecv(Repartition):
    """Send a ``ndim``-tensor from world rank ``src`` to world rank ``dst``; adjoint: send
    the gradient back. (A repartition between two one-worker partitions.)"""

    name = "SendRecv"

    def __init__(self, src: int, dst: int, ndim: int, world=None) -> None:
        super().__init__(Partition([src], (1,) * ndim, world), Partition([dst], (1,) * ndim,
                                                                          world))
