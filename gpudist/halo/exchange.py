"""The halo exchange operator H and its adjoint H*.

Forward, per worker: the local bulk block ``x`` becomes ``[left halo | bulk trimmed of extra |
right halo]`` in every dimension, halos holding copies of the direct neighbours' bulk. The
exchange runs one dimension at a time in increasing order; step ``d`` sends boxes that span
the already-exchanged extent of dims ``< d``, so corner regions arrive through two hops.

Adjoint: dimensions in decreasing order, each worker packs its halo contents, sends them back
to their owners, which ADD them into their bulk (unpack-add). The trimmed extra entries get
no gradient of their own, only what neighbours send back.

Implementation: one working buffer ``W`` per call spans, per dimension, the union of the
worker's bulk and needed ranges. ``x`` is copied in once; each step packs its two send boxes
with one fused kernel call (:mod:`gpudist.kernels`), exchanges them with one ``batch_p2p``,
and unpacks both receive boxes with one fused call; the result is ``W`` restricted to the
needed range (``W`` itself when nothing is trimmed). Send/receive buffers are allocated once
per (dimension, dtype, device) and reused by every later call, forward and adjoint.
In the adjoint the halo boxes are not cleared after they are sent: no later step reads them
and the final restriction to the bulk drops them, so the operator is the same.

Global padding is not part of the linear operator H: the layer pads the result (zeros, or
-inf for max pooling), or :class:`HaloExchange` writes it into the working buffer with
``pad_value=...`` (the adjoint drops the padding's gradient with the final restriction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..decomposition import Decomposition
from ..errors import HaloError, ShapeError
from ..kernels import Packer, get_packer
from ..kernels.regions import collapse
from ..partition import Partition
from ..transport.base import P2P, wait_all
from .geometry import HaloGeometry, WorkerHalo, halo_spec

Box = tuple[tuple[int, int], ...]
TAG_BASE = 0x4A10  # halo messages: TAG_BASE + 4*dim + (0: rightward, 1: leftward, +2: adjoint)


@dataclass(frozen=True)
class _Step:
    """One dimension's exchange for this worker (boxes in working-buffer coordinates)."""

    dim: int
    left: int | None   # world rank of the left neighbour
    right: int | None
    send: tuple[Box, Box]  # (to left, to right): my bulk that they need
    recv: tuple[Box, Box]  # (from left, from right): my halos
    send_n: tuple[int, int]
    recv_n: tuple[int, int]
    send_run: tuple[int | None, int | None]  # flat offset in W when the box is one run
    recv_run: tuple[int | None, int | None]


def _numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _run(box: Box, shape: tuple[int, ...]) -> int | None:
    """Flat offset of ``box`` in a contiguous tensor of ``shape`` if the box is one
    contiguous run (then it is sent/received in place, without packing), else None."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    strides.reverse()
    base, sizes, st = collapse(box, strides)
    return base if (len(sizes) == 1 and st == [1]) or _numel(box) <= 1 else None


class HaloPlan:
    """Everything one worker needs to exchange halos of one global shape.

    ``geometry``: per-dimension :class:`HaloGeometry`; ``me``: this worker's
    :class:`WorkerHalo` per dimension; ``work_shape``, ``bulk_box``, ``out_box``: the working
    buffer and where the bulk and the result sit in it; ``out_shape``: the result's shape;
    ``pads``: per dimension ``(left, right)`` global padding the local operator still needs.
    """

    def __init__(self, P: Partition, geometry: Sequence[HaloGeometry],
                 packer: str | None = None, fill: float | None = None,
                 leave_symmetric: bool = False) -> None:
        self.P = P
        self.geometry = tuple(geometry)
        if len(self.geometry) != P.dim:
            raise ShapeError(f"{len(self.geometry)} geometries for a {P.dim}-D partition")
        for a, (g, s) in enumerate(zip(self.geometry, P.shape)):
            if g.workers != s:
                raise HaloError(f"dimension {a}: geometry for {g.workers} workers but the "
                                f"partition has {s}")
        self.prefer = packer
        self.fill = fill
        self.global_shape = tuple(g.size for g in self.geometry)
        self.active = P.active
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if not self.active:
            self.me: tuple[WorkerHalo, ...] = ()
            self.steps: tuple[_Step, ...] = ()
            return
        me = tuple(g.worker(c) for g, c in zip(self.geometry, P.coords))
        self.me = me
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
        w0 = [w.work[0] - inbuf[a][0] for a, w in enumerate(me)]
        rel = [lambda iv, a=a: (iv[0] - w0[a], iv[1] - w0[a]) for a in range(P.dim)]
        self.work_shape = tuple(w.work[1] + inbuf[a][1] - w0[a] for a, w in enumerate(me))
        self.bulk_box: Box = tuple(rel[a](w.bulk) for a, w in enumerate(me))
        self.out_box: Box = tuple((rel[a](w.needed)[0] - inbuf[a][0],
                                   rel[a](w.needed)[1] + inbuf[a][1])
                                  for a, w in enumerate(me))
        self.in_shape = tuple(w.n_inputs for w in me)
        self.out_shape = tuple(b - a for a, b in self.out_box)
        self.identity = all(w.work == w.bulk == w.needed for w in me) and not any(
            lo or hi for lo, hi in inbuf)
        steps = []
        for d in range(P.dim):
            w = me[d]
            if not w.exchanges:
                continue

            def box(iv: tuple[int, int], d: int = d) -> Box:
                return tuple(self.out_box[a] if a < d else rel[a](iv) if a == d
                             else self.bulk_box[a] for a in range(P.dim))

            left, right = P.neighbors(d)
            send = (box(w.send_left), box(w.send_right))
            recv = (box(w.halo_left), box(w.halo_right))
            ws = self.work_shape
            steps.append(_Step(d, left, right, send, recv,
                               (_numel(send[0]), _numel(send[1])),
                               (_numel(recv[0]), _numel(recv[1])),
                               (_run(send[0], ws), _run(send[1], ws)),
                               (_run(recv[0], ws), _run(recv[1], ws))))
        self.steps = tuple(steps)

    # -- buffers --------------------------------------------------------------
    def buffers(self, step: _Step, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) buffers of ``step``: allocated on first use, then reused."""
        key = (step.dim, dtype, device)
        b = self._bufs.get(key)
        if b is None:
            b = (torch.empty(sum(step.send_n), dtype=dtype, device=device),
                 torch.empty(sum(step.recv_n), dtype=dtype, device=device))
            self._bufs[key] = b
        return b

    def buffer_ptrs(self) -> dict[tuple, tuple[int, int]]:
        """data_ptr of every cached buffer pair (to check reuse)."""
        return {k: (s.data_ptr(), r.data_ptr()) for k, (s, r) in self._bufs.items()}

    def packer(self, t: torch.Tensor) -> Packer:
        return get_packer(t.device, t.dtype, prefer=self.prefer)

    # -- the operator, in place on a working buffer -----------------------------
    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised working buffer ``W`` (``work_shape``) for ``like``'s dtype/device."""
        return torch.empty(self.work_shape, dtype=like.dtype, device=like.device)

    def bulk(self, W: torch.Tensor) -> torch.Tensor:
        """The view of ``W`` where this worker's bulk block lives (write the input here)."""
        return W[tuple(slice(a, b) for a, b in self.bulk_box)]

    def result(self, W: torch.Tensor) -> torch.Tensor:
        """The view of ``W`` holding ``[halo | trimmed bulk | halo]`` after the exchange."""
        return W[tuple(slice(a, b) for a, b in self.out_box)]

    def exchange_(self, W: torch.Tensor) -> torch.Tensor:
        """Forward H in place: fill the halos of ``W`` (bulk already written). Returns W."""
        for step in self.steps:
            self._exchange(W, step, adjoint=False)
        return W

    def exchange_adjoint_(self, W: torch.Tensor) -> torch.Tensor:
        """Adjoint H* in place: add the halos of ``W`` into the owners' bulk. Returns W."""
        for step in reversed(self.steps):
            self._exchange(W, step, adjoint=True)
        return W

    def _exchange(self, W: torch.Tensor, step: _Step, adjoint: bool) -> None:
        tr = self.P.world.transport
        flat = W.view(-1)
        sbuf, rbuf = self.buffers(step, W.dtype, W.device)
        nsl, nsr = step.send_n
        nrl, nrr = step.recv_n
        # pieces: (count, buffer slice, flat offset in W if the box is one contiguous run)
        send = [(nsl, sbuf[:nsl], step.send_run[0]), (nsr, sbuf[nsl:], step.send_run[1])]
        recv = [(nrl, rbuf[:nrl], step.recv_run[0]), (nrr, rbuf[nrl:], step.recv_run[1])]
        if adjoint:  # the same messages, backwards: halos go out, bulk parts come in
            send, recv = recv, send
        out_boxes = step.recv if adjoint else step.send
        in_boxes = step.send if adjoint else step.recv
        peers = (step.left, step.right)
        tag = TAG_BASE + 4 * step.dim + (2 if adjoint else 0)
        # out: pack what is not one contiguous run (one fused call for both faces)
        pack = [(b, buf) for (k, buf, run), b in zip(send, out_boxes) if k and run is None]
        if pack:
            p = self.packer(W)
            if len(pack) == 2:
                p.pack(W, out_boxes, out=sbuf if not adjoint else rbuf)
            else:
                p.pack(W, (pack[0][0],), out=pack[0][1])
        ops: list[P2P] = []
        for i, (k, buf, run) in enumerate(send):
            if k:  # to the left travels with tag+1, to the right with tag
                src = buf if run is None else flat[run:run + k]
                ops.append(P2P("send", src, peers[i], tag + (1 - i)))
        direct_in = []
        for i, (k, buf, run) in enumerate(recv):
            if k:
                dst = buf if (run is None or adjoint) else flat[run:run + k]
                ops.append(P2P("recv", dst, peers[i], tag + i))
                direct_in.append(run is not None and not adjoint)
            else:
                direct_in.append(True)
        wait_all(tr.batch_p2p(ops), tr.timeout)
        # in: unpack (overwrite halos) or unpack-add (into bulk) what was not received in place
        todo = [i for i in range(2) if recv[i][0] and not direct_in[i]]
        if todo:
            p = self.packer(W)
            whole = sbuf if adjoint else rbuf
            if len(todo) == 2:
                p.unpack(whole, W, in_boxes, add=adjoint)
            else:
                i = todo[0]
                p.unpack(recv[i][1], W, (in_boxes[i],), add=adjoint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """H x: bulk block -> [halo | trimmed bulk | halo] in every dimension."""
        if not self.active:
            return x.new_zeros((0,) * max(1, x.dim()))
        if tuple(x.shape) != self.in_shape:
            raise ShapeError(f"halo exchange planned for local shape {self.in_shape}, "
                             f"got {tuple(x.shape)}")
        if self.identity and not self.steps:
            return x.clone(memory_format=torch.contiguous_format)
        W = self.allocate(x)
        for a, (lo, hi) in enumerate(self.inbuf):  # padding slabs first: a later step may
            if lo:                                # forward a neighbour's (equal) padding
                W.narrow(a, 0, lo).fill_(self.fill)
            if hi:
                W.narrow(a, W.shape[a] - hi, hi).fill_(self.fill)
        self.bulk(W).copy_(x)
        self.exchange_(W)
        return self._restrict(W, self.out_box)

    def adjoint(self, dy: torch.Tensor) -> torch.Tensor:
        """H* dy: halo contents added back into their owners' bulk (reverse order)."""
        if tuple(dy.shape) != self.out_shape:
            raise ShapeError(f"halo exchange adjoint expects {self.out_shape}, "
                             f"got {tuple(dy.shape)}")
        if self.identity and not self.steps:
            return dy.clone(memory_format=torch.contiguous_format)
        if self.out_box == tuple((0, n) for n in self.work_shape):
            G = dy.clone(memory_format=torch.contiguous_format)
        else:
            G = torch.zeros(self.work_shape, dtype=dy.dtype, device=dy.device)
            self.result(G).copy_(dy)
        self.exchange_adjoint_(G)
        return self._restrict(G, self.bulk_box, copy=False)  # a view: autograd accepts it

    def _restrict(self, W: torch.Tensor, box: Box, copy: bool = True) -> torch.Tensor:
        if box == tuple((0, n) for n in W.shape):
            return W
        view = W[tuple(slice(a, b) for a, b in box)]
        return view.contiguous() if copy else view


class _HaloFunction(torch.autograd.Function):
    """Autograd bridge: forward H, backward H*."""

    @staticmethod
    def forward(ctx, plan: HaloPlan, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.in_shape = plan, tuple(x.shape)
        return plan.forward(x.detach())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        plan: HaloPlan = ctx.plan
        if not plan.active:
            return None, dy.new_zeros(ctx.in_shape)
        return None, plan.adjoint(dy)


def halo_exchange(plan: HaloPlan, x: torch.Tensor) -> torch.Tensor:
    """Apply the halo exchange of ``plan`` to this worker's block (autograd: adjoint)."""
    return _HaloFunction.apply(plan, x)


class HaloExchange(torch.nn.Module):
    """Halo exchange for a sliding-kernel operator on a tensor distributed over ``P_x``.

    Kernel parameters follow :func:`gpudist.halo.geometry.normalize_params` (ints apply to
    the spatial dims ``2:`` of a >=3-D tensor; shorter sequences align with the trailing dims;
    a padding entry is an int or a ``(left, right)`` pair). Alternatively pass ``geometry``
    (one :class:`HaloGeometry` per dimension).

    The global shape comes from ``global_shape`` or ``geometry``, else it is found by an
    all-gather of local shapes over ``P_x`` and cached per local shape. The cache assumes
    every worker sees a change of global shape (e.g. a smaller last batch) as a change of its
    own local shape; if that can fail (a batch dim split over the partition), pass
    ``global_shape``. Bad configurations raise :class:`HaloError` on every active worker
    (on every rank, at construction, when the shape is known up front).

    ``pad_value``: ``None`` (default) returns halos and trimmed bulk only -- the layer adds
    the global padding (``plan.pads``); a number also adds the padding, filled with it, in
    the same working buffer (no extra copy). ``op_padding=True`` (with ``pad_value``) adds
    only the asymmetric part and leaves the symmetric part, ``plan.pads``, to the local
    op's own ``padding`` argument; a worker with nothing to exchange, trim or pad then gets
    its block back untouched (no copy). Inactive ranks take and return zero-volume tensors.
    """

    def __init__(
        self,
        P_x: Partition,
        kernel_size: int | Sequence[int] = 1,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int | tuple[int, int]] = 0,
        dilation: int | Sequence[int] = 1,
        *,
        global_shape: Sequence[int] | None = None,
        geometry: Sequence[HaloGeometry] | None = None,
        pad_value: float | None = None,
        op_padding: bool = False,
        packer: str | None = None,
    ) -> None:
        super().__init__()
        if op_padding and pad_value is None:
            raise ValueError("HaloExchange: op_padding=True needs a pad_value")
        self.P_x = P_x
        self.params = (kernel_size, stride, padding, dilation)
        self.pad_value = pad_value
        self.op_padding = op_padding
        self.packer = packer
        self._plans: dict[tuple[int, ...], HaloPlan] = {}
        self._by_local: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.last_plan: HaloPlan | None = None
        if geometry is not None:
            plan = self._new_plan(geometry)
            self._plans[plan.global_shape] = plan
            self._fixed: tuple[int, ...] | None = plan.global_shape
        elif global_shape is not None:
            self._fixed = tuple(int(s) for s in global_shape)
            self.plan(self._fixed)  # raises HaloError on every rank now
        else:
            self._fixed = None

    def plan(self, global_shape: Sequence[int]) -> HaloPlan:
        """The (cached) plan for ``global_shape``."""
        g = tuple(int(s) for s in global_shape)
        p = self._plans.get(g)
        if p is None:
            p = self._new_plan(halo_spec(g, self.P_x.shape, *self.params))
            self._plans[g] = p
        return p

    def _new_plan(self, geometry: Sequence[HaloGeometry]) -> HaloPlan:
        return HaloPlan(self.P_x, geometry, self.packer, self.pad_value, self.op_padding)

    def global_shape_of(self, x: torch.Tensor) -> tuple[int, ...]:
        """Global shape of the distributed tensor whose local block is ``x`` (collective
        over ``P_x`` on the first call per local shape)."""
        if self._fixed is not None:
            return self._fixed
        local = tuple(x.shape)
        g = self._by_local.get(local)
        if g is None:
            g = gather_global_shape(self.P_x, x)
            self._by_local[local] = g
        return g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return halo_exchange(_inactive_plan(self.P_x), x)
        if x.dim() != self.P_x.dim:
            raise ShapeError(f"tensor has {x.dim()} dimensions but the partition has "
                             f"{self.P_x.dim}: local shape {tuple(x.shape)}, partition "
                             f"{self.P_x.shape}")
        plan = self.plan(self.global_shape_of(x))
        self.last_plan = plan
        if self.op_padding and plan.identity and not plan.steps:
            return x
        return halo_exchange(plan, x)


def _inactive_plan(P: Partition) -> HaloPlan:
    p = HaloPlan.__new__(HaloPlan)
    p.P, p.geometry, p.active, p.me, p.steps, p._bufs = P, (), False, (), (), {}
    p.prefer, p.global_shape, p.in_shape = None, (), (0,)
    return p


def gather_global_shape(P: Partition, x: torch.Tensor) -> tuple[int, ...]:
    """All-gather local shapes over ``P``; check they form a block decomposition.

    Raises :class:`ShapeError` on every member if they do not.
    """
    local = tuple(int(s) for s in x.shape)
    if P.size == 1 or P.group is None:
        return local
    w = P.world
    dev = x.device if w.backend == "nccl" else torch.device("cpu")
    mine = torch.tensor(local, dtype=torch.int64, device=dev)
    out = torch.empty(P.size * len(local), dtype=torch.int64, device=dev)
    w.transport.all_gather(out, mine, P.group).wait(w.timeout)
    rows = out.cpu().view(P.size, len(local)).tolist()
    shapes = {P.coords_of(P.ranks.index(r)): tuple(row) for r, row in zip(P.group.ranks, rows)}
    g = []
    for a in range(P.dim):
        tot = 0
        for i in range(P.shape[a]):
            c = tuple(i if b == a else 0 for b in range(P.dim))
            tot += shapes[c][a]
        g.append(tot)
    dec = Decomposition(tuple(g), P.shape)
    bad = [(c, s) for c, s in sorted(shapes.items()) if dec.local_shape(c) != s]
    if bad:
        c, s = bad[0]
        raise ShapeError(
            f"local shapes over partition {P.shape} are not a block decomposition of "
            f"{tuple(g)}: worker {c} holds {s}, expected {dec.local_shape(c)}"
        )
    return tuple(g)
