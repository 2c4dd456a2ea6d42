"""The halo exchange H as a primitive: forward fills each worker's halos with copies of
its neighbours' bulk, the adjoint H* sends halo contents back and adds them into the
owners' bulk (see :mod:`gpudist.halo.plan` for the messages).

The result of H is local: ``[pad | halo | trimmed bulk | halo | pad]`` blocks overlap, so
they do not form a distributed tensor; the layer's local operator consumes them. The
forward writes the block into a working buffer kept by the plan (allocated once per
global shape and dtype, reused whenever the previous result has been released) and
exchanges only halo bytes in place; the adjoint does the same on a second buffer and
returns the bulk of it, with no per-call allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from ..buffers import alias
from ..errors import ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives.base import Plan, Primitive
from ..spec import TensorSpec
from .geometry import HaloGeometry, halo_spec
from .plan import HaloPlan, Shell, fill_value, slices

GeometryFn = Callable[[TensorSpec], Sequence[HaloGeometry]]


class HaloExchange(Primitive):
    """Halo exchange for a sliding-kernel operator on a tensor distributed over ``P_x``.

    Kernel parameters follow :func:`gpudist.halo.geometry.normalize_params` (ints apply to
    the spatial dims ``2:`` of a >=3-D tensor; shorter sequences align with the trailing
    dims; a padding entry is an int or a ``(left, right)`` pair). Alternatively
    ``geometry``: per-dimension :class:`HaloGeometry` objects, or a function of the global
    shape returning them (layers whose padding depends on it, e.g. ``ceil_mode``).

    ``geometry`` as a function receives the tensor's :class:`~gpudist.spec.TensorSpec`.

    ``pad_value``: ``None`` (default) returns halos and trimmed bulk only, the caller adds
    the global padding (``plan.pads``); a number also writes the padding, filled with it,
    into the same buffer. ``op_padding=True`` (with ``pad_value``) writes only the
    asymmetric part and leaves the symmetric part, ``plan.pads``, to the local op's own
    ``padding`` argument; a worker with nothing to exchange, trim or pad then gets its
    block back untouched (no copy). Bad configurations raise :class:`HaloError` on every
    rank.

    ``owns_gradient=True`` (for layers whose local op is the result's only consumer): the
    adjoint works in place on the incoming gradient where it covers the whole buffer,
    saving a copy of the block.
    """

    name = "HaloExchange"
    collective = False  # only neighbours take part in each message
    # whether the layers' own op runs while the exchange is in flight (False: an InFlight
    # completes on entry); None: where the transport moves messages by itself
    # (``Transport.progresses_alone``: gloo, NCCL; MPI only with MPICH's progress thread)
    overlap: bool | None = None

    def __init__(
        self,
        P_x: Partition,
        kernel_size: int | Sequence[int] = 1,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int | tuple[int, int]] = 0,
        dilation: int | Sequence[int] = 1,
        *,
        geometry: Sequence[HaloGeometry] | GeometryFn | None = None,
        pad_value: float | None = None,
        op_padding: bool = False,
        packer: str | None = None,
        owns_gradient: bool = False,
    ) -> None:
        if op_padding and pad_value is None:
            raise raised_everywhere(ValueError("HaloExchange: op_padding=True needs a "
                                               "pad_value"))
        self.P_x = P_x
        self.params = (kernel_size, stride, padding, dilation)
        self.pad_value, self.op_padding, self.packer = pad_value, op_padding, packer
        self.owns_gradient = owns_gradient
        fixed = geometry is not None and not callable(geometry)
        self._geometry: GeometryFn | None = (
            (lambda spec, geo=tuple(geometry): geo) if fixed else geometry)
        super().__init__(P_x.world, P_x.ranks,
                         (P_x.key, repr(self.params), pad_value, op_padding,
                          repr(geometry) if fixed else None))
        self.in_partition = P_x
        self.tag = 1024 + (P_x.world.next_uid(P_x.key) % 600) * 48

    def geometry_of(self, spec: TensorSpec) -> tuple[HaloGeometry, ...]:
        """Per-dimension halo geometry for a tensor (raises HaloError everywhere)."""
        g = spec.global_shape
        if self._geometry is not None:
            geo = tuple(self._geometry(spec))
            if tuple(x.size for x in geo) != g:
                raise raised_everywhere(ShapeError(
                    f"HaloExchange: geometry for global shape {tuple(x.size for x in geo)}, "
                    f"tensor of global shape {g}"))
            return geo
        return halo_spec(g, self.P_x.shape, *self.params)

    def out_spec(self, spec: TensorSpec) -> TensorSpec | None:
        if not spec.standard:
            raise raised_everywhere(ShapeError(
                f"HaloExchange: the tensor must be split the standard way (tensor dim i "
                f"along partition dim i); got {spec.describe()}"))
        self.geometry_of(spec)
        return None  # the result is local (overlapping blocks), not a distributed tensor

    def make_plan(self, spec, out):
        fill = None if self.pad_value is None else fill_value(self.pad_value, spec.dtype)
        hp = HaloPlan(self.P_x, self.geometry_of(spec), self.packer, fill, self.op_padding,
                      self.tag)
        return hp, False

    def local_plan(self, spec: TensorSpec) -> HaloPlan:
        """This worker's :class:`HaloPlan` for a tensor of ``spec`` (padding, boxes)."""
        return self.plan(spec).local

    def kept_nbytes(self) -> int:
        """The pooled working buffers and each cached plan's send/receive buffers."""
        return super().kept_nbytes() + sum(p.local.kept_nbytes() for p in self._plans.values()
                                           if p.local is not None)

    # -- for layers that compute on the block itself (the edge splits, conv strips) ------
    def shell_exchange(self, x: torch.Tensor, plan: Plan, shell: Shell) -> InFlight:
        """H on the working buffer holding only ``shell`` (its padding filled, its bulk
        entries copied from the block ``x``), in flight: ``with`` it, compute what needs no
        halo (the messages move meanwhile); after the ``with``, ``.buffer`` holds the
        halos. One call of this operator on every worker, messages or none."""
        hp: HaloPlan = plan.local
        W = self.buffers.get("work", hp.work_shape, x.dtype, x.device)
        for box in shell.fill:
            W[slices(box)].fill_(hp.fill)
        for wb, xb in shell.pairs:
            W[slices(wb)].copy_(x[slices(xb)])
        return InFlight(hp, W, False, self.numbered(plan), nullcontext(), self._overlaps())

    def shell_gradient(self, plan: Plan, shell: Shell, like: torch.Tensor) -> torch.Tensor:
        """The gradient buffer for :meth:`shell_return`, zero where it must be."""
        G = self.buffers.get("grad", plan.local.work_shape, like.dtype, like.device)
        for box in shell.zero:
            G[slices(box)].zero_()
        return G

    def shell_return(self, G: torch.Tensor, plan: Plan) -> InFlight:
        """H* on ``G`` (the caller wrote the gradients of what it read), in flight: ``with``
        it, compute the block's own gradient; then :meth:`shell_add` into it."""
        return InFlight(plan.local, G, True, self.numbered(plan, adjoint=True),
                        self.world.control.scope(self._adj_scope), self._overlaps())

    def _overlaps(self) -> bool:
        o = self.overlap
        return self.world.transport.progresses_alone if o is None else o

    @staticmethod
    def shell_add(G: torch.Tensor, shell: Shell, dx: torch.Tensor) -> None:
        """The shell's entries of ``G`` (after H*) added into the block gradient ``dx``."""
        for wb, xb in shell.pairs:
            dx[slices(xb)] += G[slices(wb)]

    # -- the two directions ------------------------------------------------------------------
    def forward(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        hp: HaloPlan = plan.local
        if hp.passthrough:
            return x
        W = self.buffers.get("work", hp.work_shape, x.dtype, x.device)
        if hp.pad_slabs:
            hp.fill_padding(W)
        hp.bulk(W).copy_(x)
        hp.exchange_(W)
        if hp.only_padding:
            out = self.buffers.get("padding", hp.out_shape, x.dtype, x.device)
            return out.fill_(hp.fill)
        return _box_of(W, hp.out_box)

    def adjoint(self, dy: torch.Tensor, plan: Plan) -> torch.Tensor:
        hp: HaloPlan = plan.local
        if hp.passthrough:
            return dy
        if (self.owns_gradient and not hp.only_padding and dy.is_contiguous()
                and hp.out_box == tuple((0, n) for n in hp.work_shape)):
            hp.exchange_adjoint_(dy)  # the gradient is ours: no copy
            return hp.bulk(dy)
        G = self.buffers.get("grad", hp.work_shape, dy.dtype, dy.device)
        if hp.only_padding:  # the gradient of padding goes nowhere
            G.zero_()
        else:
            hp.zero_outside(G)
            hp.result(G).copy_(dy)
        hp.exchange_adjoint_(G)
        return _box_of(G, hp.bulk_box)


class InFlight:
    """An exchange posted on entering ``with`` and completed on leaving it (also when the
    body raises: the peers' messages are matched either way). The body overlaps the first
    step's messages and must leave ``buffer`` alone."""

    __slots__ = ("hp", "buffer", "adjoint", "numbered", "scope", "overlap", "works")

    def __init__(self, hp: HaloPlan, buffer: torch.Tensor, adjoint: bool,
                 numbered: AbstractContextManager, scope: AbstractContextManager,
                 overlap: bool = True) -> None:
        self.hp, self.buffer, self.adjoint, self.numbered = hp, buffer, adjoint, numbered
        self.scope, self.overlap, self.works = scope, overlap, None

    def _run(self, fn, *args):
        with self.scope, self.numbered:  # both reusable: entered once per half
            return fn(*args)

    def __enter__(self) -> InFlight:
        self.works = self._run(self.hp.begin, self.buffer, self.adjoint)
        if not self.overlap:
            self._finish()
        return self

    def __exit__(self, kind, e, tb) -> bool:
        self._finish()
        return False

    def _finish(self) -> None:
        if self.works is not None:
            works, self.works = self.works, None
            self._run(self.hp.end, self.buffer, self.adjoint, works)


def _box_of(W: torch.Tensor, box) -> torch.Tensor:
    """``W[box]`` as a tensor of its own on W's storage (W itself when the box is all)."""
    if all(a == 0 and b == n for (a, b), n in zip(box, W.shape)):
        return W
    v = W[tuple(slice(a, b) for a, b in box)]
    return alias(W, v.storage_offset() - W.storage_offset(), v.shape, v.stride())


def halo_exchange(H: HaloExchange, x: torch.Tensor) -> torch.Tensor:
    """``H(x)``: kept for callers of the functional form."""
    return H(x)
