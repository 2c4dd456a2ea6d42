"""What every primitive shares: plans, the first-call check, the autograd bridge.

A primitive is a linear data movement ``F`` between distributed tensors with its adjoint
``F*``. A subclass states four things:

* ``out_spec(spec)``: the output's :class:`~gpudist.spec.TensorSpec` (pure: every rank
  computes the same, and raises the same error for a spec it cannot take);
* ``make_plan(spec)``: this rank's plan for one input spec (peers, block shapes, buffers);
* ``forward(x, plan)`` and ``adjoint(dy, plan)``: the two directions on local blocks.

:class:`Primitive` does the rest once: plans cached per input spec (an LRU of
``world.cache_size``), the spec checked across the participants at a rank's first call
and whenever it (or whether the call records the adjoint) differs from its previous
call's (:func:`gpudist.meta.verify`: same operator, same spec, same grad mode, every
block right), each call
numbered for the control plane's diagnostics, errors posted to the world
(:meth:`gpudist.control.Control.scope`), and one ``torch.autograd.Function`` whose
backward is the adjoint. A :class:`~gpudist.spec.DistTensor` in gives a DistTensor out; a
plain local tensor in gives a plain tensor out, its spec found by one metadata exchange
per call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from .. import runtime
from ..buffers import LRU, BufferPool
from ..checkpoint import mark, refusal, region, top_hooks
from ..errors import (
    DeviceError,
    ShapeError,
    not_copyable,
    not_picklable,
    planning_error,
    raised_everywhere,
)
from ..meta import CHECKPOINT_BIT, check_call, config_of, derive_spec, verify
from ..partition import Partition
from ..runtime import World
from ..spec import DistTensor, TensorSpec, stable_hash
from ..transport.base import Group

_INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


@functools.cache
def _torch_adds(dtype: torch.dtype, device_type: str) -> str | None:
    """None where torch adds ``dtype`` tensors on ``device_type``, else why not."""
    try:  # (the trees and rings add; gloo's reduce-scatter sums its chunks; tensors of a
        # device the backend cannot take are summed in host memory)
        for dev in dict.fromkeys((device_type, "cpu")):
            z = torch.zeros(2, 1, dtype=dtype, device=dev)
            z[0].add_(z[1])
            torch.sum(z, 0)
    except (RuntimeError, NotImplementedError) as e:
        return (str(e).splitlines() or [type(e).__name__])[0][:160]
    return None


def check_summable(what: str, spec: TensorSpec) -> None:
    """A primitive that adds blocks (its F, or its F* where the call records it) refuses,
    on every rank (the spec is agreed), a dtype torch cannot add there or on the host
    (uint16 on the CPU): it failed on the summing ranks alone."""
    why = _torch_adds(spec.dtype, spec.device_type)
    if why is not None:
        raise raised_everywhere(DeviceError(
            f"{what}: torch cannot add {str(spec.dtype).replace('torch.', '')} tensors on "
            f"{spec.device_type} (torch says: {why}); sum them in a wider dtype"))


def tag_pairs(limit: int) -> range:
    """The point-to-point tags of the host sums' trees and rings, a pair (forward,
    adjoint) per primitive, for a backend taking tags up to ``limit`` (halo exchanges use
    1024-29823): an operator's messages do not meet another's receive where ranks run
    operators in different orders. Primitives of one set of ranks share a pair only
    ``len(range)`` primitives apart; of two sets, by the chance of their offsets (1 in
    ``len``: 2^28 on MPICH and gloo, 496 where a backend takes only MPI's minimum)."""
    if limit >= 1 << 20:
        return range(1 << 15, min(limit, 1 << 30) - 2, 2)
    return range(32, 1024, 2)


def zero_volume(
    ndim: int = 1, *, like: torch.Tensor | None = None, batch: int | None = None,
    requires_grad: bool = False,
) -> torch.Tensor:
    """A tensor with a 0 in its shape: what an inactive worker holds.

    ``batch`` keeps the leading dimension (shape ``(batch, 0, ...)``; ``(0,)`` for one
    dimension).
    """
    shape = [0] * max(ndim, 1)
    if batch is not None:
        shape[0] = batch
        if len(shape) > 1:
            shape[1] = 0
        else:
            shape[0] = 0
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def empty_of(ndim: int, dtype: torch.dtype, device: torch.device
             ) -> Callable[[], torch.Tensor]:
    """:func:`zero_volume`'s tensor for a steady form, made cheaply: a fresh tensor per
    call (its own version counter, as autograd needs), no allocation (0.5 against 2 us)."""
    e, shape = torch.empty(0, dtype=dtype, device=device), (0,) * max(ndim, 1)
    return lambda: e.new_empty(shape)


def is_zero_volume(x: torch.Tensor) -> bool:
    return x.numel() == 0


def outside_inference_mode(fn: Callable) -> Callable:
    """``fn`` (a layer's or primitive's entry) run as under ``no_grad`` where it is called
    under ``torch.inference_mode``: the buffers and plans it caches are then normal
    tensors that a later call in grad mode can reuse (an inference tensor cannot be
    updated in place, or saved for backward, outside inference mode)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


try:  # the frame callback torch.compile installs (None outside it)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _compiling
except ImportError:  # pragma: no cover - another torch: always take the guarded path
    def _compiling() -> bool:
        return True


def entry(fn: Callable) -> Callable:
    """A layer's or loss's call, or a primitive's checked call (its repeated call makes
    the same checks itself first, :meth:`Primitive.__call__`): :func:`outside_inference_mode`,
    and run eagerly under ``torch.compile`` (the checks across ranks and the transports are
    Python that dynamo cannot trace; the model's torch code around the call is still
    compiled).

    ``disable``'s guard (which stops dynamo from compiling the frames the call runs) is
    entered only while dynamo traces the call or its frame callback is set, i.e. inside a
    compiled region: elsewhere the call costs three checks (0.2 us) instead of the guard's
    1-2 us. The guard is made at the first such call: ``torch.compiler.disable`` imports
    dynamo (1.1 s at ``import gpudist`` otherwise, on every rank)."""
    safe = outside_inference_mode(fn)
    guarded = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal guarded
        if torch.compiler.is_compiling() or _compiling():  # (dynamo reads the first as
            if guarded is None:  # True and traces no further)
                guarded = torch.compiler.disable(safe)
            return guarded(*args, **kwargs)
        if torch.is_inference_mode_enabled():
            return safe(*args, **kwargs)
        return fn(*args, **kwargs)

    return eager(call)


def eager(fn: Callable) -> Callable:
    """``fn`` with ``torch.compiler.disable``'s mark, for the paths where dynamo reads it
    before inlining: a compiled region runs it eagerly (its own checks then find dynamo's
    frame callback set and take :func:`entry`'s guard)."""
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = "gpudist call"  # type: ignore[attr-defined]
    fn._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
    return fn


def first_order(backward: Callable) -> Callable:
    """torch's ``once_differentiable`` for an ``autograd.Function``'s hand-written
    backward (a double backward raises torch's clear error, never a wrong one), minus its
    ``no_grad`` block where grad mode is off already: a plain backward (no
    ``create_graph``) calls ``backward`` directly (1-5 us less per node)."""
    twice = once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: torch's wrapper and its error
            return twice(ctx, *grads)
        return backward(ctx, *grads)

    return run


def layer_adjoint(backward: Callable) -> Callable:
    """:func:`first_order` for a layer's hand-written backward, run inside the world's
    failure scope (as a primitive's adjoint is): an error there that not every rank raises
    -- a peer gone in the middle of its reductions -- is posted to the world, so every
    rank's message names it."""
    inner = first_order(backward)
    where = f"{backward.__qualname__.split('.')[0].lstrip('_')} adjoint"

    @functools.wraps(backward)
    def run(ctx, *grads):
        w = runtime._WORLD
        if w is None:
            return inner(ctx, *grads)
        with w.control.scope(where):
            return inner(ctx, *grads)

    return run


@dataclass
class Plan:
    """One input spec's plan: the output spec, this rank's ``local`` plan, and whether the
    operator is the identity here (then it is skipped: no copy, no autograd node)."""

    spec: TensorSpec
    out: TensorSpec
    local: object
    identity: bool = False
    fingerprint: int = 0
    slots: dict = field(default_factory=dict)  # name -> the pool's Slot (Primitive.buffer)
    # F and F* in their steady form (Primitive.steady): block -> block, None: the general
    fwd: Callable[[torch.Tensor], torch.Tensor] | None = None  # forward / adjoint
    adj: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a member's F and F* numbered (Primitive._numbered: the steady form or the general)
    run: tuple[Callable, Callable] | tuple[None, None] = (None, None)
    # a member's repeated call by what it records (record_mode: 0 nothing, 1 F with F*,
    # | CHECKPOINT_BIT inside a non-reentrant checkpoint region; Primitive._repeat)
    again: dict = field(default_factory=dict)


class Primitive(torch.nn.Module):
    """A linear data movement F with its adjoint F* (see the module docstring)."""

    name = "primitive"
    # needs every participant to complete (a halo exchange does not); "some": needs them,
    # but a member may wait for some alone (a broadcast's receiver for its root, an
    # all-to-all's for its senders): the diagnostics' cycles follow True ones only
    collective: bool | str = True
    sums = False  # whether F adds blocks (then torch must add the dtype: checked at plan)

    def __init__(self, world: World, participants: Sequence[int], config: object) -> None:
        super().__init__()
        world.control.ensure_alive()  # not after finalize() or an abort: say so
        self.world = world
        ranks = sorted(set(int(r) for r in participants))
        self.participants = tuple(ranks)
        g = world.transport.group(ranks) if len(ranks) > 1 else None  # world-collective
        self.group: Group | None = g if world.rank in ranks else None
        self.member = world.rank in ranks
        # the n-th primitive these ranks build: two identical layers are still told apart
        self.uid = world.next_uid(("primitive", self.participants))
        # (from what the participants agree on, checked at the first call through
        # ``config``: a count over every primitive built would differ where a rank builds
        # one that the others do not, and their messages would never meet; consecutive
        # primitives of one set of participants get consecutive pairs)
        pairs = tag_pairs(world.transport.tag_limit)
        self.tag = pairs[(stable_hash(self.participants) + self.uid) % len(pairs)]
        self.config = config_of((self.name, config), self.uid)
        # made once: every call names itself to the control plane with these
        self._fwd_label, self._adj_label = f"{self.label} forward", f"{self.label} adjoint"
        self._adj_scope = f"{self.name} adjoint"
        self._plans: LRU = LRU(world.cache_size)
        # the last call's (spec, plan, grad, the plan's repeated call for that grad mode or
        # None): a call with another spec or grad mode is checked across ranks
        self._last: tuple[TensorSpec, Plan, bool | None, Callable | None] | None = None
        self.buffers = BufferPool(max_keys=4 * world.cache_size)

    # -- to implement --------------------------------------------------------------------
    in_partition: Partition

    def out_spec(self, spec: TensorSpec) -> TensorSpec:
        raise NotImplementedError

    def make_plan(self, spec: TensorSpec, out: TensorSpec) -> tuple[object, bool]:
        """(this rank's local plan, whether F is the identity on every rank)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:  # type: ignore[override]
        raise NotImplementedError

    def adjoint(self, dy: torch.Tensor, plan: Plan) -> torch.Tensor:
        raise NotImplementedError

    # -- plans -----------------------------------------------------------------------------
    def check_input(self, spec: TensorSpec) -> None:
        if spec.partition != self.in_partition:
            raise raised_everywhere(ShapeError(
                f"{self.name}: the input is distributed over partition "
                f"{spec.partition.shape} of ranks {list(spec.partition.ranks)}, but this "
                f"operator was built for {self.in_partition.shape} of ranks "
                f"{list(self.in_partition.ranks)}"))

    def plan(self, spec: TensorSpec, local_ok: bool = True, grad: bool | None = None
             ) -> Plan:
        """The cached plan for input ``spec``, checked across the participants
        (:func:`~gpudist.meta.verify`) at this rank's first call and whenever the spec or
        ``grad`` (whether the call records the adjoint for backward; None: not said)
        differs from its last call's. The first check comes before the plan is made, so
        that what it finds wrong in the spec is found alike on every rank.

        Why at every change and not only at a plan's first use: two specs both planned
        earlier, passed one on some ranks and the other on the rest, would otherwise run
        with mismatched counts (a silently wrong result, or a crash in the backend); an
        adjoint recorded on some ranks only would leave a message that a later call
        receives (a broadcast's root and a reduce's senders complete without their
        peers). A rank whose call changed checks; if its peers' did not change they are in
        the data exchange instead, and the control plane reports the mismatch (the
        operator number a peer waits at, run as another operator here) within
        ``diag_after`` seconds. Every call is thus like the previous one on every rank,
        or checked. Cost: none while calls repeat; one metadata exchange per change
        (a layer called with and without grad in turn checks every call)."""
        last = self._last
        if last is not None:
            if grad is None:  # not said (a layer's plan, an inspection): as last time
                grad = last[2]
            if last[0] is spec and last[2] == grad:
                return last[1]
        if self.member and (last is None or last[2] != grad or last[0] != spec):
            verify(self.group, self.name, self.config, spec, local_ok, grad=grad)
            if grad and grad & 1:  # the adjoint adds (a broadcast's sums, a halo's, a
                check_summable(self.name, spec)  # reduce-scatter)
        p = self._plans.get(spec)
        if p is not None:
            self._plans.move_to_end(spec)
            self._remember(spec, p, grad)
            return p
        try:
            if self.sums:
                check_summable(self.name, spec)
            self.check_input(spec)
            out = self.out_spec(spec)
        except Exception as e:
            planning_error(e)
            raise
        if self.member:
            try:
                local, identity = self.make_plan(spec, out)
            except Exception as e:
                planning_error(e)
                raise
        else:
            local, identity = None, True
        fp = stable_hash((self.config, spec.fingerprint))
        p = self._plans.get_or_make(spec, lambda: self._made(spec, out, local, identity, fp))
        self._remember(spec, p, grad)
        return p

    def _remember(self, spec: TensorSpec, p: Plan, grad: int | None) -> None:
        """The call now checked becomes the last one, which the next call may repeat."""
        again = None
        if grad is not None and self.member:
            again = p.again.get(grad)
            if again is None:
                again = p.again[grad] = self._repeat(p, grad)
        self._last = (spec, p, grad, again)

    def _made(self, spec: TensorSpec, out: TensorSpec, local: object, identity: bool,
              fp: int) -> Plan:
        p = Plan(spec, out, local, identity, fp)
        if self.member and not identity and spec.device_type == "cpu":
            p.fwd, p.adj = self.steady(p)
        if self.member:
            p.run = (self._numbered(p.fwd or _late(self.forward, p), self._fwd_label, fp),
                     self._numbered(p.adj or _late(self.adjoint, p), self._adj_label, fp + 1))
            p.again = {0: self._repeat(p, 0), 1: self._repeat(p, 1)}
        return p

    def _numbered(self, f: Callable[[torch.Tensor], torch.Tensor], label: str, fp: int
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``f`` (F or F* of one plan) as one call the control plane counts (every member
        of the group counts the same calls), the call check first where it is on, and at
        every ``World.check_every``-th operator of the group (made once per plan and
        direction: every call runs it; it holds neither the primitive nor the plan, see
        :func:`_late`)."""
        w, ctl, group, parts = self.world, self.world.control, self.group, self.participants
        begin = ctl.numberer(parts, label, fp, self.collective)

        seqs = ctl._seq

        def run(x: torch.Tensor) -> torch.Tensor:
            n = seqs.get(parts, 0)  # (the group's periodic check: as _check_call's)
            if w.check_calls or not (n + 1) % w.check_every:
                check_call(group, label, fp, n, ctl.history(parts))
            prev = begin()
            try:
                return f(x)
            finally:
                ctl._op = prev
        return run

    def steady(self, plan: Plan) -> tuple[Callable | None, Callable | None]:
        """F and F* for ``plan`` in their steady form, made once per plan: the common case
        of :meth:`forward` and :meth:`adjoint` (host blocks of the plan's shapes) with its
        buffers, collective and branches chosen here, a call doing only what moves data
        (a block of another shape takes :meth:`forward` / :meth:`adjoint`). None: no
        steady form (this one has none)."""
        return None, None

    def buffer(self, plan: Plan, name: object, shape: Sequence[int], like: torch.Tensor
               ) -> torch.Tensor:
        """A pooled tensor of ``shape`` with ``like``'s dtype and device, for a call with
        ``plan`` (its slot in the pool kept per plan and name: half the cost of a lookup
        by key, on every call; a plan applied to blocks of other shapes, as batch norm's
        sums are, looks it up again)."""
        s = plan.slots.get(name)
        if s is None or s.shape != shape or not s.fits(like):
            s = plan.slots[name] = self.buffers.slot(name, shape, like.dtype, like.device)
        return s.take()

    def derive(self, x: torch.Tensor) -> TensorSpec:
        """The spec of a plain local block: a metadata exchange over the participants at
        every call (a rank cannot tell from its own block whether a peer's changed); a
        :class:`~gpudist.spec.DistTensor` input needs none."""
        return derive_spec(self.in_partition, x, self.name, self.group,
                           instance=self.config)

    # -- calling -----------------------------------------------------------------------------
    def __call__(self, x: DistTensor | torch.Tensor) -> DistTensor | torch.Tensor:
        """Apply F; autograd's backward applies F*.

        A call like the previous one (the same spec object, the same grad mode, a block
        that fits: every call of a network's step after the first), made outside
        inference mode and compiled code, runs the plan's repeated call
        (:meth:`_repeat`); any other call the checked one, :meth:`_call`. Where dynamo
        compiles this frame (after the graph break its mark makes), the compile checks
        come first, so that it reads none of the primitive's state (a guard on it would
        recompile the frame as the calls change)."""
        if not (_is_compiling() or _compiling() or _inference_mode()):
            last = self._last
            if last is not None and type(x) is DistTensor and x.spec is last[0]:
                again = last[3]
                if again is not None:
                    local = x.local
                    mode = local.requires_grad and _grad_mode()
                    if top_hooks(False) is not None:  # perhaps a checkpoint region
                        mode = record_mode(local)
                    if mode == last[2] and last[0].matches(local):
                        return again(local)
        return self._call(x)

    __call__ = eager(__call__)

    def _repeat(self, plan: Plan, grad: int) -> Callable[[torch.Tensor], DistTensor]:
        """A member's call repeating its previous one with ``plan`` and record mode
        ``grad`` (:func:`record_mode`; spec, plan and mode checked there; the block matches
        the spec, dtype included): :meth:`apply_plan`'s F on the block, or F recorded for
        backward (marked inside a checkpoint region), numbered
        and inside the world's failure scope (what it looks up bound once, per plan; the
        primitive and the plan held weakly, see :func:`_late`)."""
        ctl, name, out, identity, run = (self.world.control, self.name, plan.out,
                                         plan.identity, plan.run[0])
        me, pl = weakref.ref(self), weakref.ref(plan)
        marked = bool(grad & CHECKPOINT_BIT)

        def again(local: torch.Tensor) -> DistTensor:
            if ctl.aborted is not None:
                ctl.ensure_alive()
            try:
                if identity:
                    y = local
                elif grad & 1:
                    y = _record(me(), pl(), local, mark(local) if marked else None)
                elif marked:  # communicates, records nothing, inside a region
                    raise refusal(name, "a call that records nothing for backward")
                else:
                    y = run(local)
            except BaseException as e:
                ctl.failed(e, name)
                raise
            return _wrap(y, out) if out else y
        return again

    @entry
    def _call(self, x: DistTensor | torch.Tensor) -> DistTensor | torch.Tensor:
        with self.world.control.scope(self.name):
            dist_in = isinstance(x, DistTensor)
            local = x.local if dist_in else x
            if local.requires_grad and local.dtype in _INT:
                raise raised_everywhere(DeviceError(
                    f"{self.name}: an integer tensor ({local.dtype}) cannot require grad"))
            if not self.member and not dist_in:  # nothing to do here: a plain block of
                if local.numel():  # a rank outside the operator must hold no data
                    raise ShapeError(
                        f"{self.name}: rank {self.world.rank} is outside the operator (ranks "
                        f"{list(self.participants)}) but passed a block of shape "
                        f"{tuple(local.shape)}; pass an empty tensor there (or a DistTensor)")
                return local
            spec = x.spec if dist_in else self.derive(local)
            local = spec.adopt(local)
            ok = spec.matches(local)
            mode = record_mode(local)
            plan = self.plan(spec, ok, mode)
            if not ok:
                spec.check_local(local, self.name)
            if mode & CHECKPOINT_BIT and self.member and not plan.identity:
                if not dist_in:
                    raise refusal(self.name, "a plain block (its shape exchange)")
                if not mode & 1:
                    raise refusal(self.name, "a call that records nothing for backward")
            y = self.apply_plan(local, plan)
            return _wrap(y, plan.out) if dist_in and plan.out else y

    def apply_plan(self, local: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Run F on this rank's block with a plan from :meth:`plan` (no checks)."""
        if not self.member:  # nothing here; stay in the graph if the input is
            z = zero_volume((plan.out or plan.spec).ndim, like=local)
            return z + local.sum() * 0 if local.requires_grad else z
        if plan.identity:
            return local
        if local.dtype != plan.spec.dtype:  # the wire carries the agreed dtype (autocast's
            local = local.to(plan.spec.dtype)  # promotions can differ between ranks)
        mode = local.requires_grad and torch.is_grad_enabled()
        if top_hooks(False) is not None:  # perhaps a checkpoint region
            mode = record_mode(local)
        if mode & 1:
            return _record(self, plan, local,
                           mark(local) if mode & CHECKPOINT_BIT else None)
        return self.run_forward(local, plan)  # no graph to record: F alone

    def numbered(self, plan: Plan, adjoint: bool = False):
        """``with op.numbered(plan)``: one call of F (or F*) as the control plane counts it
        (every member of the group counts the same calls). With the world's call check on
        (``GPUDIST_CHECK_CALLS=1``), and at the group's periodic check, the members first
        compare what they are about to run and what they ran (:meth:`_check_call`)."""
        label, fp = ((self._adj_label, plan.fingerprint + 1) if adjoint else
                     (self._fwd_label, plan.fingerprint))
        self._check_call(label, fp)
        return self.world.control.op(self.participants, label, fp, self.collective)

    def _check_call(self, label: str, fp: int) -> None:
        """With the world's call check on, the members compare what they are about to run;
        else they do at the group's periodic check (``World.check_every``), before the
        operator is numbered, as :meth:`_numbered` does (the two paths of one operator
        may differ between ranks: the check must come at the same count on both)."""
        w = self.world
        n = w.control.count(self.participants)
        if w.check_calls or not (n + 1) % w.check_every:
            check_call(self.group, label, fp, n, w.control.history(self.participants))

    def run_forward(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        """F on a block, numbered for the control plane (both paths of :meth:`apply_plan`)."""
        return plan.run[0](x)

    def run_adjoint(self, dy: torch.Tensor, plan: Plan) -> torch.Tensor:
        """F* on a gradient block, numbered and inside the failure scope (autograd's
        path; the scope written out)."""
        ctl = self.world.control
        if ctl.aborted is not None:
            ctl.ensure_alive()
        try:
            return plan.run[1](dy)
        except BaseException as e:
            ctl.failed(e, self._adj_scope)
            raise

    def kept_nbytes(self) -> int:
        """Bytes of the buffers this operator keeps between calls (its pooled outputs and
        packing buffers; subclasses add what else they hold). The transport's staging and
        chunk buffers, shared by every operator on a group, are not counted."""
        return self.buffers.nbytes()

    def __deepcopy__(self, memo):
        raise not_copyable(self.label)

    def __reduce_ex__(self, protocol):
        raise not_picklable(self.label)

    @property
    def label(self) -> str:
        """Name and instance: the n-th primitive built on these ranks (for messages)."""
        return f"{self.name} #{self.uid}"

    def extra_repr(self) -> str:
        return f"participants={list(self.participants)}"


class _LinearOp(torch.autograd.Function):
    """The autograd bridge of every primitive: forward F, backward F*. Called through
    :func:`_record` (``apply`` without its Python wrapper)."""

    @staticmethod
    def forward(ctx, op: Primitive, plan: Plan, x: torch.Tensor,  # type: ignore[override]
                m: torch.Tensor | None):
        ctx.op, ctx.plan, ctx.marked = op, plan, m is not None
        y = op.run_forward(x, plan)
        if m is not None:  # inside a non-reentrant checkpoint region: a marker to unpack
            ctx.save_for_backward(m)  # before the adjoint (gpudist.checkpoint)
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        if ctx.marked:
            ctx.saved_tensors  # noqa: B018 - unpacked: the region is recomputed first
        return None, None, ctx.op.run_adjoint(dy.contiguous(), ctx.plan), None


def _late(method: Callable, plan: Plan) -> Callable[[torch.Tensor], torch.Tensor]:
    """``method(x, plan)`` (a primitive's forward or adjoint) holding the primitive and
    the plan weakly: a plan's closures make no reference cycle through them, so an
    operator's buffers go with it, not at the next garbage collection (its plans live
    while it does, and only they call these)."""
    fn, op, pl = method.__func__, weakref.ref(method.__self__), weakref.ref(plan)
    return lambda x: fn(op(), x, pl())


def steady_into(plan: Plan, shape: tuple[int, ...], slot, run: Callable, general: Callable
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A steady form (:meth:`Primitive.steady`) that runs one prepared collective
    ``run(out, block)`` into a tensor of the pool's ``slot``; a block not of ``shape`` (a
    plan applied to blocks of another shape) takes ``general(block, plan)``."""
    def body(x: torch.Tensor) -> torch.Tensor:
        if x.shape != shape:
            return general(x, plan)
        out = slot.take()
        run(out, x.contiguous())
        return out
    return body


def _wrap(y: torch.Tensor, spec: TensorSpec, _new=DistTensor.__new__) -> DistTensor:
    """``DistTensor(y, spec, check=False)`` without its ``__init__`` (0.1 us less a call):
    a block the operator made to ``spec``."""
    t = _new(DistTensor)
    t.local, t.spec = y, spec
    return t


_is_compiling, _inference_mode, _grad_mode = (
    torch.compiler.is_compiling, torch.is_inference_mode_enabled, torch.is_grad_enabled)
_c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LinearOp)
_transforms_active = torch._C._are_functorch_transforms_active


def record_mode(local: torch.Tensor) -> int:
    """What a call on block ``local`` records for backward: 0 nothing, 1 F (its adjoint
    runs in backward), ``| CHECKPOINT_BIT`` inside a non-reentrant checkpoint region (its
    recorded nodes marked; a call there that records nothing is refused where a user
    makes it: see :mod:`gpudist.checkpoint`)."""
    return (1 if local.requires_grad and torch.is_grad_enabled() else 0) | region()


def _record(op: Primitive, plan: Plan, x: torch.Tensor, m: torch.Tensor | None = None
            ) -> torch.Tensor:
    """``_LinearOp.apply(op, plan, x)``: torch's C entry directly (1-1.5 us less a call)
    unless a torch.func transform is active (then its Python wrapper, which handles
    them). What the wrapper adds otherwise does not apply here: no ``setup_context``,
    no functorch wrappers to unwrap."""
    if _transforms_active():
        return _LinearOp.apply(op, plan, x, m)
    return _c_apply(op, plan, x, m)
