"""One worker's halo exchange for one global shape: boxes, messages, buffers.

The working buffer ``W`` spans, per dimension, the worker's bulk and the input range its
outputs need, plus the global padding it holds itself (``inbuf``). The bulk block sits at
``bulk_box``; after the exchange ``out_box`` holds ``[pad | halo | trimmed bulk | halo |
pad]``. Step ``d`` (one per dimension that exchanges anything, in increasing order) sends
boxes that span the already exchanged extent of dims ``< d``, so corners arrive in two hops.

Forward H (:meth:`HaloPlan.exchange_`) and adjoint H* (:meth:`HaloPlan.exchange_adjoint_`)
are the same messages read in opposite directions: each step sends one set of boxes and
receives the other (:meth:`HaloPlan.begin` posts the first step, :meth:`HaloPlan.end`
waits for it and runs the rest, so a caller can compute in between); forward receives
overwrite the halos, adjoint receives are *added* into the bulk (the adjoint of a copy is
an add). Boxes that are one contiguous run of ``W`` go to and from the backend in place;
the others are packed/unpacked, both faces of a step in one kernel call, through
send/receive buffers kept per dtype/device. Each step is made ready once per buffer shape
(:class:`_Wired`): its messages through those buffers become the transport's
``p2p_program`` (MPI: persistent requests), and the torch packer's box views are made.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..buffers import nbytes
from ..errors import HaloError, ShapeError, raised_everywhere
from ..kernels import Packers
from ..kernels.regions import box_views, collapse, dense_strides
from ..partition import Partition
from ..transport.base import P2P, P2PProgram, Work
from .geometry import HaloGeometry, WorkerHalo

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Step:
    """One dimension's exchange for this worker (boxes in working-buffer coordinates): per
    peer along the dimension (world rank; usually the two neighbours), the box of my bulk
    it needs and the box of my halo it owns."""

    dim: int
    peers: tuple[int, ...]
    send: tuple[Box, ...]
    recv: tuple[Box, ...]


def numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def run_offset(box: Box, shape: Sequence[int]) -> int | None:
    """Flat offset of ``box`` in a contiguous tensor of ``shape`` if the box is one
    contiguous run (then it moves in place, without packing), else None."""
    base, sizes, st = collapse(box, dense_strides(shape))
    return base if (len(sizes) == 1 and st == [1]) or numel(box) <= 1 else None


def fill_value(value: float, dtype: torch.dtype) -> float | int | bool:
    """``value`` as a fill of ``dtype`` (a halo plan's, made once per spec): an infinity
    becomes the extreme value of an integer or bool dtype (max pooling's -inf padding of
    an int64 tensor: its minimum, which no window's maximum can be below, as torch's own
    padding behaves)."""
    if value not in (float("inf"), float("-inf")) or dtype.is_floating_point \
            or dtype.is_complex:
        return value
    if dtype == torch.bool:
        return value > 0
    info = torch.iinfo(dtype)
    return info.max if value > 0 else info.min


@functools.lru_cache(maxsize=4096)  # boxes are plans' constants, indexed on every call
def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclass(frozen=True)
class _Move:
    """One step of one direction, precomputed: boxes to pack into the send buffer, messages
    as (in place?, offset, count, peer, tag) -- offsets into ``W`` for contiguous runs, into
    the send/receive buffers otherwise -- and boxes to unpack (or add) from the receive
    buffer."""

    step: int
    pack: tuple[Box, ...]
    pack_n: int
    sends: tuple[tuple[bool, int, int, int, int], ...]
    recvs: tuple[tuple[bool, int, int, int, int], ...]
    unpack: tuple[tuple[int, int, tuple[Box, ...]], ...]  # (offset, count, disjoint boxes)
    add: bool
    label: str

    @classmethod
    def make(cls, k: int, st: Step, out: tuple[Box, ...], inn: tuple[Box, ...], tag: int,
             add: bool, shape: Sequence[int]) -> _Move:
        sends, recvs, pack, unpack = [], [], [], []
        at_s = at_r = 0
        for peer, ob, ib in zip(st.peers, out, inn):
            n_o, n_i = numel(ob), numel(ib)
            if n_o:
                run = run_offset(ob, shape)
                if run is None:
                    pack.append(ob)
                    sends.append((False, at_s, n_o, peer, tag))
                    at_s += n_o
                else:
                    sends.append((True, run, n_o, peer, tag))
            if n_i:
                run = None if add else run_offset(ib, shape)
                if run is None:
                    unpack.append(ib)
                    recvs.append((False, at_r, n_i, peer, tag))
                    at_r += n_i
                else:
                    recvs.append((True, run, n_i, peer, tag))
        return cls(k, tuple(pack), at_s, tuple(sends), tuple(recvs), _disjoint(unpack), add,
                   f"halo exchange of dim {st.dim}")


class _Wired:
    """A step's :class:`_Move` made ready for working buffers of one shape: the slices of
    the send/receive buffers it uses, the transport's program for the messages through
    them (prepared once: MPI persistent requests), the messages that move contiguous runs
    of ``W`` in place, and -- where the torch packer serves -- each packed box as its view
    of the buffer with the box's (shape, strides, offset) in a contiguous ``W``."""

    __slots__ = ("move", "send_buf", "recv_bufs", "program", "runs", "pack_views",
                 "unpack_views")

    def __init__(self, move: _Move, sbuf: torch.Tensor, rbuf: torch.Tensor,
                 shape: Sequence[int], torch_packer: bool, program_of) -> None:
        self.move = move
        self.send_buf = sbuf[:move.pack_n]
        self.recv_bufs = tuple(rbuf[at:at + n] for at, n, _ in move.unpack)
        ops = [P2P("recv", rbuf[a:a + n], peer, tag)
               for run, a, n, peer, tag in move.recvs if not run]
        ops += [P2P("send", sbuf[a:a + n], peer, tag)
                for run, a, n, peer, tag in move.sends if not run]
        self.program: P2PProgram | None = program_of(ops) if ops else None
        self.runs = tuple((op, a, n, peer, tag) for op, msgs in (("recv", move.recvs),
                                                                 ("send", move.sends))
                          for run, a, n, peer, tag in msgs if run)
        self.pack_views = self.unpack_views = None
        if torch_packer:
            strides = dense_strides(shape)
            self.pack_views = box_views(sbuf, move.pack, strides)
            self.unpack_views = box_views(rbuf, [b for _, _, bs in move.unpack for b in bs],
                                          strides)


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def _disjoint(boxes: list[Box]) -> tuple[tuple[int, int, tuple[Box, ...]], ...]:
    """Consecutive runs of ``boxes`` (in buffer order) whose boxes do not overlap: each run
    is one unpack call (kernels write a call's boxes in parallel; adds into overlapping
    boxes -- a bulk entry two peers need, in the adjoint -- go in separate calls)."""
    runs: list[tuple[int, int, tuple[Box, ...]]] = []
    at, cur, start = 0, [], 0
    for b in boxes:
        if any(_overlap(b, c) for c in cur):
            runs.append((start, at - start, tuple(cur)))
            cur, start = [], at
        cur.append(b)
        at += numel(b)
    if cur:
        runs.append((start, at - start, tuple(cur)))
    return tuple(runs)


class HaloPlan:
    """Everything one (active) worker needs to exchange halos of one global shape.

    ``geometry``: per-dimension :class:`HaloGeometry`; ``me``: this worker's
    :class:`WorkerHalo` per dimension; ``work_shape``, ``bulk_box``, ``out_box``: the working
    buffer and where the bulk and the result sit in it; ``in_shape``/``out_shape``: block and
    result shapes; ``only_padding``: the result is all global padding; ``pads``: per
    dimension the ``(left, right)`` global padding the local operator still adds itself;
    ``passthrough``: this worker's result is its block as is. ``tag`` separates this
    exchange's messages from other operators'.
    """

    def __init__(self, P: Partition, geometry: Sequence[HaloGeometry],
                 packer: str | None = None, fill: float | int | bool | None = None,
                 leave_symmetric: bool = False, tag: int = 0) -> None:
        self.P = P
        self.geometry = tuple(geometry)
        if len(self.geometry) != P.dim:
            raise raised_everywhere(ShapeError(
                f"{len(self.geometry)} geometries for a {P.dim}-D partition"))
        for a, (g, s) in enumerate(zip(self.geometry, P.shape)):
            if g.workers != s:
                raise raised_everywhere(HaloError(
                    f"dimension {a}: geometry for {g.workers} workers but the partition "
                    f"has {s}"))
        if not P.active:
            raise ValueError("HaloPlan is made on the partition's own workers only")
        self.fill, self.tag = fill, tag
        self.global_shape = tuple(g.size for g in self.geometry)
        me = tuple(g.worker(c) for g, c in zip(self.geometry, P.coords))
        self.me: tuple[WorkerHalo, ...] = me
        # global padding: what the working buffer holds (``inbuf``, filled with ``fill``)
        # and what the local operator still adds (``pads``; symmetric if leave_symmetric)
        pads = [(w.pad_left, w.pad_right) for w in me]
        if fill is None:
            inbuf = [(0, 0)] * P.dim
            self.pads = tuple(pads)
        else:
            sym = [min(p) if leave_symmetric else 0 for p in pads]
            inbuf = [(lo - s_, hi - s_) for (lo, hi), s_ in zip(pads, sym)]
            self.pads = tuple((s_, s_) for s_ in sym)
        self.inbuf = tuple(inbuf)
        # a worker whose outputs read only padding (or that has no output) needs an empty
        # range: place it at its bulk start, inside the buffer
        needed = [w.needed if w.needed[1] > w.needed[0] else (w.bulk[0], w.bulk[0])
                  for w in me]
        lo = [min(w.bulk[0], nd[0]) if w.n_inputs else nd[0] for w, nd in zip(me, needed)]
        hi = [max(w.bulk[1], nd[1]) if w.n_inputs else nd[1] for w, nd in zip(me, needed)]
        w0 = [lo[a] - inbuf[a][0] for a in range(P.dim)]

        def rel(a: int, iv: tuple[int, int]) -> tuple[int, int]:
            return iv[0] - w0[a], iv[1] - w0[a]

        self.work_shape = tuple(hi[a] + inbuf[a][1] - w0[a] for a in range(P.dim))
        self.bulk_box: Box = tuple(rel(a, w.bulk) for a, w in enumerate(me))
        self.out_box: Box = tuple((rel(a, needed[a])[0] - inbuf[a][0],
                                   rel(a, needed[a])[1] + inbuf[a][1]) for a in range(P.dim))
        self.in_shape = tuple(w.n_inputs for w in me)
        self.out_shape = tuple(b - a for a, b in self.out_box)
        # a worker whose outputs read only global padding in some dimension: its result is
        # all padding (made apart from W; it still sends its bulk to its neighbours)
        self.only_padding = fill is not None and any(
            w.needed[1] <= w.needed[0] and w.pad_left + w.pad_right > 0 for w in me)
        if self.only_padding:
            self.pads = ((0, 0),) * P.dim
            self.out_shape = tuple(w.pad_left + w.local_length + w.pad_right for w in me)
        self.no_outputs = any(w.n_outputs == 0 for w in me)
        steps = []
        for d in range(P.dim):
            w = me[d]
            if not w.exchanges:
                continue

            def box(iv: tuple[int, int], d: int = d) -> Box:
                return tuple(self.out_box[a] if a < d else rel(a, iv) if a == d
                             else self.bulk_box[a] for a in range(P.dim))

            sends = dict(w.send_to)
            recvs = dict(w.recv_from)
            peers = sorted(set(sends) | set(recvs))
            empty = (w.bulk[0], w.bulk[0])

            def rank_of(j: int, d: int = d) -> int:
                c = list(P.coords)
                c[d] = j
                return P.world_rank_of(c)

            steps.append(Step(d, tuple(rank_of(j) for j in peers),
                              tuple(box(sends.get(j, empty)) for j in peers),
                              tuple(box(recvs.get(j, empty)) for j in peers)))
        self.steps = tuple(steps)
        self.passthrough = not self.steps and not self.only_padding and \
            self.bulk_box == self.out_box == tuple((0, n) for n in self.work_shape)
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._progs: dict[tuple, list[_Wired]] = {}
        self._packers = Packers(packer)
        # the slabs of global padding the buffer holds, and W minus out_box (zeroed in the
        # adjoint before the gradient is written)
        self.pad_slabs = _slabs(self.work_shape, tuple(
            (inbuf[a][0], self.work_shape[a] - inbuf[a][1]) for a in range(P.dim)))
        self.outside = _slabs(self.work_shape, self.out_box)

    def kept_nbytes(self) -> int:
        """Bytes of the send/receive buffers this plan keeps."""
        return nbytes(t for pair in self._bufs.values() for t in pair)

    # -- views of a working buffer ---------------------------------------------------------
    def bulk(self, W: torch.Tensor) -> torch.Tensor:
        """The view of ``W`` where this worker's bulk block lives (write the input here)."""
        return W[slices(self.bulk_box)]

    def result(self, W: torch.Tensor) -> torch.Tensor:
        """The view of ``W`` holding ``[halo | trimmed bulk | halo]`` after the exchange."""
        return W[slices(self.out_box)]

    def fill_padding(self, W: torch.Tensor) -> None:
        for box in self.pad_slabs:
            W[slices(box)].fill_(self.fill)

    def zero_outside(self, G: torch.Tensor) -> None:
        for box in self.outside:
            G[slices(box)].zero_()

    # -- the operator, in place ------------------------------------------------------------
    def exchange_(self, W: torch.Tensor) -> torch.Tensor:
        """H in place: fill the halos of ``W`` (bulk already written). Returns ``W``."""
        self.end(W, False, self.begin(W, False))
        return W

    def exchange_adjoint_(self, W: torch.Tensor) -> torch.Tensor:
        """H* in place: add the halos of ``W`` into their owners' bulk. Returns ``W``."""
        self.end(W, True, self.begin(W, True))
        return W

    def begin(self, W: torch.Tensor, adjoint: bool) -> list[Work]:
        """Post the first step of H (or H*) on ``W``: its messages move while the caller
        computes something that leaves ``W`` alone; :meth:`end` completes the exchange
        (the later steps send what the first one brings: corners)."""
        steps = self._wired(W, adjoint)
        return self._post(W, steps[0]) if steps else []

    def end(self, W: torch.Tensor, adjoint: bool, works: list[Work]) -> None:
        """Wait for the first step (posted by :meth:`begin`), then run the others."""
        steps = self._wired(W, adjoint)
        for i, wired in enumerate(steps):
            self._complete(W, wired, works if i == 0 else self._post(W, wired))

    def _wired(self, W: torch.Tensor, adjoint: bool) -> list[_Wired]:
        """The steps for working buffers shaped like ``W``, made ready once per shape:
        forward sends ``send`` boxes and overwrites ``recv`` boxes; the adjoint sends
        ``recv`` boxes back and adds what arrives into ``send`` boxes (dimensions in
        reverse order)."""
        key = (W.shape, W.dtype, W.device, adjoint)
        steps = self._progs.get(key)
        if steps is None:
            steps = []
            order = list(enumerate(self.steps))
            for k, st in (reversed(order) if adjoint else order):
                out, inn = (st.recv, st.send) if adjoint else (st.send, st.recv)
                tag = self.tag + 2 * st.dim + (1 if adjoint else 0)
                move = _Move.make(k, st, out, inn, tag, adjoint, W.shape)
                steps.append(_Wired(move, *self._buffers(move, W), W.shape,
                                    self._packers.of(W).name == "torch",
                                    self.P.world.transport.p2p_program))
            self._progs[key] = steps
        return steps

    def _buffers(self, move: _Move, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (move.step, W.dtype, W.device)  # one pair per step, serving both directions
        b = self._bufs.get(key)
        if b is None:
            st = self.steps[move.step]
            n = max(sum(numel(b) for b in st.send), sum(numel(b) for b in st.recv))
            b = (torch.empty(n, dtype=W.dtype, device=W.device),
                 torch.empty(n, dtype=W.dtype, device=W.device))
            self._bufs[key] = b
        return b

    def _post(self, W: torch.Tensor, wired: _Wired) -> list[Work]:
        """One step's messages posted: what is not a contiguous run packed, then the
        receives and the sends (receives first)."""
        if wired.pack_views is not None and W.is_contiguous():
            w0 = W.storage_offset()
            for view, shape, strides, at in wired.pack_views:
                view.copy_(W.as_strided(shape, strides, w0 + at))
        elif wired.move.pack:
            self._packers.of(W).pack(W, wired.move.pack, out=wired.send_buf)
        transport = self.P.world.transport
        if wired.runs:  # contiguous runs of W, sent and received in place
            flat = W.view(-1)
            works = transport.batch_p2p([P2P(op, flat[a:a + n], peer, tag)
                                         for op, a, n, peer, tag in wired.runs])
            return works + wired.program.start() if wired.program else works
        return wired.program.start() if wired.program else []

    def _complete(self, W: torch.Tensor, wired: _Wired, works: list[Work]) -> None:
        """Wait for one step's messages, then unpack (or add) what arrived."""
        move = wired.move
        self.P.world.transport.wait(works, move.label)
        if not move.unpack:
            return
        if wired.unpack_views is not None and W.is_contiguous():
            w0 = W.storage_offset()
            for view, shape, strides, at in wired.unpack_views:
                dst = W.as_strided(shape, strides, w0 + at)
                if move.add:
                    dst.add_(view)
                else:
                    dst.copy_(view)
            return
        packer = self._packers.of(W)
        for (_, _, boxes), buf in zip(move.unpack, wired.recv_bufs):
            packer.unpack(buf, W, boxes, add=move.add)

    def buffer_ptrs(self) -> dict[tuple, tuple[int, int]]:
        """data_ptr of every cached send/receive buffer pair (to check reuse)."""
        return {k: (s.data_ptr(), r.data_ptr()) for k, (s, r) in self._bufs.items()}


def box_minus(box: Box, cut: Box) -> list[Box]:
    """Disjoint boxes covering ``box`` minus ``cut`` (at most two per dimension; those of
    dimension ``a`` span ``box`` in later dimensions and ``cut`` in earlier ones)."""
    if not numel(box):
        return []
    if any(max(a, c) >= min(b, e) for (a, b), (c, e) in zip(box, cut)):
        return [box]
    out, rest = [], list(box)
    for i, ((a, b), (c, e)) in enumerate(zip(box, cut)):
        if a < c:
            out.append(tuple(rest[:i]) + ((a, c),) + tuple(rest[i + 1:]))
        if e < b:
            out.append(tuple(rest[:i]) + ((e, b),) + tuple(rest[i + 1:]))
        rest[i] = (max(a, c), min(b, e))
    return out


@dataclass(frozen=True)
class Shell:
    """For a layer that fills only part of the working buffer (it computes on the block
    itself and reads a few boxes of the buffer after the exchange): ``pairs``, the bulk
    entries those boxes and the neighbours read, as disjoint (working buffer, block) box
    pairs; ``fill``, the global padding held in the buffer that they read (corners travel
    through it); ``zero``, what an adjoint zeroes in a gradient buffer first (the halos
    and the pairs; a gradient left in the padding is never added into a bulk)."""

    pairs: tuple[tuple[Box, Box], ...]
    fill: tuple[Box, ...]
    zero: tuple[Box, ...]

    @classmethod
    def of(cls, hp: HaloPlan, reads: Sequence[Box]) -> Shell:
        bb = hp.bulk_box
        boxes = list(reads) + [b for st in hp.steps for b in st.send]
        shell: list[Box] = []
        for box in boxes:
            pieces = [tuple((max(p, q), min(r, v)) for (p, r), (q, v) in zip(box, bb))]
            for seen in shell:
                pieces = [x for piece in pieces for x in box_minus(piece, seen)]
            shell += [x for x in pieces if numel(x)]
        pairs = tuple((w, tuple((p - z, q - z) for (p, q), (z, _) in zip(w, bb)))
                      for w in shell)
        cut = {tuple((max(p, q), min(r, v)) for (p, r), (q, v) in zip(slab, box))
               for slab in hp.pad_slabs for box in boxes}
        fill = tuple(sorted(b for b in cut if all(p < q for p, q in b)))
        halos = [b for b in box_minus(tuple((0, n) for n in hp.work_shape), bb) if numel(b)]
        for slab in hp.pad_slabs:
            halos = [q for b in halos for q in box_minus(b, slab) if numel(q)]
        return cls(pairs, fill, tuple(halos) + tuple(shell))


def _slabs(shape: Sequence[int], box: Box) -> list[Box]:
    """Disjoint boxes covering ``shape`` minus ``box``."""
    return box_minus(tuple((0, n) for n in shape), box)
