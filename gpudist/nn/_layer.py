"""What every gpudist layer shares.

:class:`DistributedModule` takes a :class:`~gpudist.spec.DistTensor` (or a plain local
block, whose spec is found at every call by a metadata exchange over the world: every rank
calls every layer), checks the spec across the participants when it differs from the
rank's previous call (:func:`~gpudist.meta.verify`), looks up the plan for that spec (made
at its first use: every rank computes it from the agreed spec alone, so a bad
configuration raises the same error everywhere), checks the block, and runs the layer
inside the control plane's failure scope. A DistTensor in gives a DistTensor out; a plain
tensor gives a plain tensor.

:class:`ShardedParameters` gives layers whose parameters are blocks of global tensors the
global (sequential) state dict both ways, and stamps per-rank state dicts with their
layout so they refuse to load into another one.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import torch

from ..buffers import LRU
from ..checkpoint import refusal, region, top_hooks
from ..errors import (
    DeviceError,
    MismatchError,
    ShapeError,
    not_copyable,
    not_picklable,
    planning_error,
    raised_everywhere,
)
from ..meta import (
    BAD_BLOCK,
    CHECKPOINT_BIT,
    OK,
    PARAM_GRAD_BITS,
    Row,
    barrier,
    config_of,
    derive_spec,
    exchange,
    same_program,
    verify,
)
from ..partition import Partition
from ..primitives import Repartition
from ..primitives.base import entry
from ..spec import DistTensor, TensorSpec, stable_hash
from ._params import block

_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def per_dim(name: str, layer: str, value, n: int, kind: type = int,
            allow_none: bool = False, exact: bool = False) -> tuple | None:
    """An int (or float) or a sequence of 1 or ``n`` of them -> ``n``-tuple (torch's rule;
    ``exact``: a sequence of ``n`` only, as torch's rule for a conv's kernel size and a
    resize's size or scale factor, where it keeps a 1-tuple as given and then fails)."""
    if value is None and allow_none:
        return None
    seq = isinstance(value, (list, tuple))
    vals = list(value) if seq else [value]
    ok = len(vals) in ((n,) if exact and seq else (1, n)) and all(
        not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
        for v in vals)
    if not ok:
        raise raised_everywhere(ValueError(
            f"{layer}: {name} must be a single {kind.__name__} or a tuple of {n} "
            f"{kind.__name__}s (one per spatial dim), got {value!r}"))
    return tuple(kind(v) for v in vals) * (n if len(vals) == 1 else 1)


#: torch's layer options: one set on a gpudist layer that has no attribute of that name
#: (it stores the option in another form) is refused too, not ignored
TORCH_OPTIONS = frozenset((
    "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
    "padding_mode", "output_padding", "ceil_mode", "count_include_pad", "divisor_override",
    "return_indices", "size", "scale_factor", "mode", "align_corners",
    "recompute_scale_factor", "num_embeddings", "embedding_dim", "padding_idx", "max_norm",
    "norm_type", "scale_grad_by_freq", "sparse", "num_features", "affine",
    "track_running_stats", "normalized_shape", "elementwise_affine", "in_features",
    "out_features", "reduction", "ignore_index", "label_smoothing", "log_target", "full",
    "delta", "beta"))
_SIMPLE = (bool, int, float, str, type(None), torch.dtype)
_ABSENT = object()


def _frozen(value):
    """An option's value as recorded: lists as tuples (a list changed in place is seen,
    and ``[3, 3]`` set for ``(3, 3)`` is no change)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (tuple, list)) else value


def _simple(value) -> bool:
    """Whether ``value`` is an option's value (a number, string, dtype, None or a tuple or
    list of them), not a tensor, module, partition or callable."""
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


class DistributedModule(torch.nn.Module):
    """Base of the layers (see the module docstring). Subclasses implement
    ``make_plan(spec) -> plan with .out`` and ``run(local, plan) -> local``."""

    #: whether a checked call includes the ranks outside the layer (they then see what
    #: the check finds too): for inputs beside the tensor that only a rank itself can
    #: check (a loss's target)
    check_outsiders = False
    #: options that may be changed after the layer is built: read at every call (alike on
    #: every rank: part of ``extra_repr``, compared across ranks), or choices of how this
    #: rank computes (``edge_split``, read when a plan is made: for new input specs);
    #: any other option changed after construction is refused at the next call (its
    #: exchanges, plans and parameters were made from it)
    live_options: tuple[str, ...] = ("boundary_strips", "edge_split")

    def __init_subclass__(cls, **kwargs) -> None:
        """Each gpudist layer records its options (:meth:`_options`) once its constructor
        is done (a user's subclass is not wrapped: what its own constructor adds after
        gpudist's is its own state, not an option)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or not cls.__module__.startswith("gpudist."):
            return

        @functools.wraps(init)
        def __init__(self, *args, **kw) -> None:
            init(self, *args, **kw)
            self.__dict__["_built_options"] = self._options()

        cls.__init__ = __init__

    def _options(self) -> dict:
        """The layer's option-like attributes: public, holding numbers, strings, dtypes,
        None or tuples of them (``training`` aside)."""
        return {k: _frozen(v) for k, v in self.__dict__.items()
                if k[0] != "_" and k != "training" and _simple(v)}

    def _changed_options(self) -> list[str]:
        """The options changed since construction that the layer does not read at every
        call (:attr:`live_options`), each as 'name old -> new' (a torch option name it does
        not hold counts as set from 'unset')."""
        built = self.__dict__.get("_built_options")
        if built is None:
            return []
        now = self._options()
        out = []
        for k in sorted(set(built) | set(now)):
            was, new = built.get(k, _ABSENT), now.get(k, _ABSENT)
            same = was == new or (was != was and new != new)  # (NaN: unchanged)
            if k in self.live_options or same or (was is _ABSENT and k not in TORCH_OPTIONS):
                continue
            out.append(f"{k} {'unset' if was is _ABSENT else repr(was)} -> "
                       f"{'unset' if new is _ABSENT else repr(new)}")
        return out

    def setup(self, P_in: Partition, participants: Sequence[int]) -> None:
        self.P_in = P_in
        self.world = P_in.world
        ranks = sorted({int(r) for r in participants})
        self._participants = tuple(ranks)
        n = self.world.size  # every rank calls every layer: plain blocks are described here
        self.world_group = self.world.transport.group(range(n)) if n > 1 else None
        # the participants check a call that differs from the last one (world-collective)
        g = self.world.transport.group(ranks) if len(ranks) > 1 else None
        self._group = g if self.world.rank in ranks else None
        self._uid = self.world.next_uid(("layer", self.participants))
        # the last call's spec, grad state and parameter kinds (None: check the next call)
        self._last: tuple[TensorSpec, int | None, tuple] | None = None
        self._param_modules: tuple[torch.nn.Module, ...] | None = None
        self._plans = LRU(self.world.cache_size)

    @property
    def participants(self) -> tuple[int, ...]:
        """The world ranks that run the layer (fixed when it is built)."""
        return self._participants

    @property
    def name(self) -> str:
        return type(self).__name__

    def __deepcopy__(self, memo):
        raise not_copyable(self.name)

    def __reduce_ex__(self, protocol):
        raise not_picklable(self.name)

    def config(self) -> int:
        """What the participants must agree on beside the layer's instance number, as a
        hash: the layer's kind, input partition and options (``extra_repr``). A layer built
        with other options on some ranks (a stride, a reduction, a mode) is a MismatchError
        at its first call, not a hang in the exchange or a silently wrong result. A subclass's
        ``extra_repr`` must therefore read the same on every rank (options, not blocks)."""
        return stable_hash((self.name, self.P_in.key, self.extra_repr()))

    def spec_of(self, x: torch.Tensor) -> TensorSpec:
        """The spec of a plain block: one metadata exchange over the world at every call.
        A rank cannot tell from its own block whether another rank's block changed (nor
        can a rank outside the layer tell a bad input), so a plain block costs one small
        collective per call; a :class:`DistTensor` costs none."""
        return derive_spec(self.P_in, x, self.name, self.world_group,
                           instance=self._instance())

    def _instance(self) -> int:
        """This layer as its plain blocks' shape exchange names it (made once)."""
        i = self.__dict__.get("_instance_config")
        if i is None:
            i = self.__dict__["_instance_config"] = config_of(self.name, self._uid)
        return i

    #: whether inputs must have the parameters' floating dtype (as torch's layers want;
    #: "half": or float16/bfloat16 with float32 parameters, as torch's batch norm takes)
    same_dtype_as_parameters: bool | str = True
    #: whether the input must be floating point where the layer has floating parameters
    floating_input = True

    def check_kind(self, spec: TensorSpec, kinds: tuple) -> None:
        """The input's device and floating dtype against the parameters' (``kinds``:
        :meth:`_param_kinds`; every rank raises alike: the check across ranks compared the
        parameters' dtypes and devices)."""
        k = next((k for k in kinds if k[0].is_floating_point), None)
        if k is None:
            return
        dtype, device = k[:2]
        if spec.device_type != device:
            raise raised_everywhere(DeviceError(
                f"{self.name}: the input is on {spec.device_type}, the layer's parameters on "
                f"{device}; move one of them (layer.to(device) or x.to(device))"))
        if self.floating_input and not (spec.dtype.is_floating_point or spec.dtype.is_complex):
            raise raised_everywhere(DeviceError(
                f"{self.name}: the input is {str(spec.dtype).replace('torch.', '')}; the layer "
                f"takes floating-point input (its parameters are "
                f"{str(dtype).replace('torch.', '')}; torch's layer refuses it too)"))
        half_ok = (self.same_dtype_as_parameters == "half" and dtype == torch.float32
                   and spec.dtype in (torch.float16, torch.bfloat16))
        cast = spec.dtype in _AUTOCAST_ELIGIBLE and dtype in _AUTOCAST_ELIGIBLE \
            and torch.is_autocast_enabled(device)  # autocast casts both (not float64)
        if (self.same_dtype_as_parameters and spec.dtype != dtype and not half_ok
                and not cast and (spec.dtype.is_floating_point or spec.dtype.is_complex)):
            raise raised_everywhere(DeviceError(
                f"{self.name}: the input is {str(spec.dtype).replace('torch.', '')}, the "
                f"layer's parameters {str(dtype).replace('torch.', '')}; convert one of "
                f"them (torch's layer refuses the mix too)"))

    #: under ``torch.autocast``: "lower" (torch runs the op in autocast's dtype: conv,
    #: linear), "float32" (torch runs it in float32: losses), "probe" (torch's lists
    #: differ by device and op, e.g. 3-D pooling in float32 on the CPU: ask torch, see
    #: :meth:`autocast_probe`) or None (in the input's dtype)
    autocast: str | None = None

    def autocast_probe(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's torch op on a tiny tensor ``x`` (all sizes 1), for ``autocast =
        "probe"``: the dtype of its output under the current autocast is the dtype the
        layer runs in."""
        raise NotImplementedError

    def autocast_dtype(self, spec: TensorSpec) -> torch.dtype | None:
        """The dtype a call on ``spec`` runs in under ``torch.autocast`` (None: the
        input's), by torch's rule: float16, bfloat16 and float32 inputs are cast, others
        (float64, integers) not."""
        if self.autocast is None or spec.dtype not in _AUTOCAST_ELIGIBLE \
                or not torch.is_autocast_enabled(spec.device_type):
            return None
        if self.autocast == "lower":
            dt = torch.get_autocast_dtype(spec.device_type)
        elif self.autocast == "float32":
            dt = torch.float32
        else:  # asked once per (device, autocast dtype, input dtype, rank)
            key = (spec.device_type, torch.get_autocast_dtype(spec.device_type),
                   spec.dtype, spec.ndim)
            probes = self.__dict__.setdefault("_autocast_probes", {})
            dt = probes.get(key)
            if dt is None:
                x = torch.zeros((1,) * spec.ndim, dtype=spec.dtype, device=spec.device_type)
                with torch.no_grad():
                    dt = probes[key] = self.autocast_probe(x).dtype
        return dt if dt != spec.dtype else None

    def take(self, x: DistTensor | torch.Tensor) -> tuple[bool, torch.Tensor, TensorSpec]:
        """(whether ``x`` is a DistTensor, the block a call runs on, its spec): a plain
        block's spec found by :meth:`spec_of`, both cast where autocast casts."""
        dist_in = isinstance(x, DistTensor)
        if dist_in and (self._backward_hooks or self._backward_pre_hooks):
            raise RuntimeError(  # (torch would skip them, warning: gradients silently
                # unhooked) posted to the peers by the layer's failure scope. A global
                # hook, meant for torch's modules too, is skipped as torch skips it.
                f"{self.name}: a module backward hook (register_full_backward_hook / "
                f"register_full_backward_pre_hook) on a layer called with a DistTensor: "
                f"torch's module hooks see tensors only, so it would never run. Hook the "
                f"blocks instead (y.local.register_hook(...)), or call the layer with "
                f"plain blocks")
        if not dist_in and top_hooks(False) is not None and region():
            raise refusal(self.name, "a plain block (its shape exchange)")
        local = x.local if dist_in else x
        spec = x.spec if dist_in else self.spec_of(local)
        local, spec = self.autocast_input(local, spec)
        if self.autocast == "probe":
            self.check_op_dtype(spec)
        return dist_in, local, spec

    def check_op_dtype(self, spec: TensorSpec) -> None:
        """Whether torch's op takes ``spec``'s dtype on its device (its kernels' lists
        differ by op and device: bilinear up-sampling of int64, 3-D average pooling of
        float16 on the CPU), asked once per (device, dtype, rank) with
        :meth:`autocast_probe`: a dtype it refuses is a DeviceError on every rank (the
        spec is alike everywhere), not torch's error on the ranks that hold data only."""
        key = (spec.device_type, spec.dtype, spec.ndim)
        seen = self.__dict__.setdefault("_op_dtypes", {})  # key -> None (taken) or why not
        if key not in seen:
            x = torch.zeros((1,) * spec.ndim, dtype=spec.dtype, device=spec.device_type)
            try:
                with torch.no_grad(), torch.autocast(spec.device_type, enabled=False):
                    self.autocast_probe(x)
                seen[key] = None
            except (NotImplementedError, RuntimeError) as e:
                seen[key] = (str(e).splitlines() or [type(e).__name__])[0][:200]
        why = seen[key]
        if why is not None:
            raise raised_everywhere(DeviceError(
                f"{self.name}: torch's op does not take {str(spec.dtype).replace('torch.', '')}"
                f" input on {spec.device_type} (torch says: {why})"))

    def autocast_input(self, local: torch.Tensor, spec: TensorSpec
                       ) -> tuple[torch.Tensor, TensorSpec]:
        """The block and spec a call runs on: cast at the layer's entry where autocast
        casts (:meth:`autocast_dtype`), so that the whole layer, its halo exchange and
        reductions included, runs in one dtype that every rank agrees on (the spec
        carries it, and the check across ranks compares it: autocast on some ranks only
        is a MismatchError). The cast is in the graph: the input's gradient comes back
        in the input's dtype, as torch's."""
        dt = self.autocast_dtype(spec)
        if dt is None:
            return local, spec
        last = self.__dict__.get("_cast")  # the same spec object: the same cast spec
        if last is None or last[0] is not spec or last[1] != dt:
            last = self.__dict__["_cast"] = (spec, dt, spec.replace(dtype=dt))
        return spec.adopt(local).to(dt), last[2]

    def __setattr__(self, name: str, value) -> None:
        """An option or parameter set after a call (``momentum``, ``eps``, ``weight``,
        ``train()``) makes the next call check its configuration across ranks again: a
        change made on some ranks only is a MismatchError, not a silently different
        layer there."""
        if name[0] != "_" and self.__dict__.get("_last") is not None:
            old = self.__dict__.get(name, _ABSENT)  # (the same value again, e.g. train()
            if not (old is value or (_simple(value) and _simple(old)  # every step: no check)
                                     and old == value)):
                self.__dict__["_last"] = None
        super().__setattr__(name, value)

    def _param_kinds(self) -> tuple:
        """Per parameter: dtype and device (alike on every rank), this rank's block shape,
        requires_grad. One scan per call: a change (``layer.double()`` on one rank) makes
        the call check, and :meth:`grad_state` reads the parameters' grad from it."""
        return tuple((p.dtype, p.device.type, p.shape, p.requires_grad)
                     for m in self._holders() for p in m._parameters.values()
                     if p is not None)

    def _reshaped_parameters(self, kinds: tuple) -> str | None:
        """What changed if a parameter's block no longer has the shape it had at the
        layer's first call (None: nothing). The layer's plans and its peers' buffers are
        made for those blocks: another shape would reach the backend as a size mismatch
        (gloo kills the process). A message with ``{ranks}`` to fill in."""
        shapes = tuple(k[2] for k in kinds)
        first = self.__dict__.get("_param_shapes")
        if first is None:
            first = self.__dict__["_param_shapes"] = self._built_shapes(shapes)
        if shapes == first:
            return None
        names = self._param_names()
        here = "; ".join(f"{n} {tuple(s)} (was {tuple(f)})" for n, s, f
                         in zip(names, shapes, first) if s != f) or \
            f"{len(shapes)} parameter blocks, were {len(first)}"
        return (f"{self.name}: its parameters changed shape on rank(s) {{ranks}} (here: "
                f"{here}); a layer's parameter blocks keep their shapes (its plans and its "
                f"peers' buffers are made for them): load values with load_state_dict or "
                f"load_global_state_dict, or build another layer")

    def _param_names(self) -> list[str]:
        """The parameters' names, in :meth:`_param_kinds`' order."""
        return [f"{mn}.{n}" if mn else n for mn, m in self.named_modules() if m._parameters
                for n, p in m._parameters.items() if p is not None]

    def _built_shapes(self, shapes: tuple) -> tuple:
        """The parameter block shapes the layer was built with (here: ``shapes``, those
        at its first call; :class:`ShardedParameters` knows them from the layout)."""
        return shapes

    def _holders(self) -> tuple[torch.nn.Module, ...]:
        """The layer's modules that hold parameters (fixed once built)."""
        mods = self._param_modules
        if mods is None:
            mods = self._param_modules = tuple(m for m in self.modules() if m._parameters)
        return mods

    def grad_state(self, local: torch.Tensor, kinds: tuple) -> int:
        """What a call on block ``local`` records for backward (ranks must agree on it):
        bit 1 the input's graph, bit 2 + i parameter i's (``kinds``: :meth:`_param_kinds`;
        one frozen on some ranks only would run its peers' adjoints there alone; 0:
        nothing, e.g. under no_grad), with :data:`~gpudist.meta.CHECKPOINT_BIT` inside a
        non-reentrant checkpoint region (ranks must checkpoint alike)."""
        state = region() if top_hooks(False) is not None else 0
        if not torch.is_grad_enabled():
            return state
        state |= 1 if local.requires_grad else 0
        for i, k in enumerate(kinds[:PARAM_GRAD_BITS]):
            if k[3]:
                state |= 2 << i
        if len(kinds) > PARAM_GRAD_BITS and any(k[3] for k in kinds[PARAM_GRAD_BITS:]):
            state |= 2 << PARAM_GRAD_BITS  # (the rest share one bit)
        return state

    def plan(self, spec: TensorSpec, local: torch.Tensor | None = None,
             local_ok: bool = True, bad_text: str | None = None):
        """The layer's plan for input ``spec`` (cached, LRU). At this rank's first call and
        whenever the spec, what the call on block ``local`` records for backward
        (:meth:`grad_state`; no ``local``: not said, as when a layer plans an inner one) or
        the parameters' kinds differ from its last call's, or an option was set since, the
        participants first compare their calls
        (:func:`~gpudist.meta.verify`): two cached plans used one on some ranks and the
        other on the rest, a spec refused on some ranks only, or adjoints recorded on some
        ranks only fail on every rank (see ``Primitive.plan``). ``local_ok``/``bad_text``:
        a rank-local check of something beside the input (a loss's target) that the check
        across ranks then reports on every rank."""
        last, kinds = self._last, self._param_kinds()
        grad = self.grad_state(local, kinds) if local is not None else None
        member = self.world.rank in self.participants
        outsiders = self.check_outsiders and len(self.participants) < self.world.size
        if outsiders and not member:
            grad = None  # (what an outsider records is nobody's concern: not a trigger)
        new_spec = last is None or last[2] != kinds or (last[0] is not spec and last[0] != spec)
        if new_spec or last[1] != grad:
            reshaped = self._reshaped_parameters(kinds)
            if reshaped is not None:  # reported as a bad block would be
                local_ok, bad_text = False, reshaped
            elif bad_text is None:  # (what a rank whose blocks are right says of its peers)
                bad_text = (f"{self.name}: rank(s) {{ranks}} hold a block that does not "
                            f"match the tensor {spec.describe()}, or parameters whose shape "
                            f"changed since the layer's first call (each of those ranks' "
                            f"error says which)")
            # a layer that checks its outsiders does so where every rank sees a change (a
            # spec, an option); a change of the members' grad state alone the members check
            world_wide = outsiders and new_spec
            changed = self._changed_options()
            if changed:  # said first (a block or target judged by the changed options may
                local_ok, bad_text = True, None  # look wrong); raised alike after the check
            if member or world_wide:  # (options changed on some ranks only: a mismatch)
                config = config_of((self.config(), [k[:2] for k in kinds], changed),
                                   self._uid)
                self.__dict__["_checked_world"] = world_wide  # (what a loss reads when
                # this check finds a bad target: was it every rank's?)
                # (outsiders record nothing the members' adjoints need: their grad state
                # is not compared)
                verify(self.world_group if world_wide else self._group, self.name, config,
                       spec, local_ok, grad=grad if member else None, bad_text=bad_text,
                       param_names=self._param_names)
            elif reshaped is not None:
                raise ShapeError(reshaped.format(ranks=[self.world.rank]))
            if changed:  # alike on every rank that compared
                live = [o for o in self.live_options if hasattr(self, o)]
                raise raised_everywhere(ValueError(
                    f"{self.name}: option(s) changed after the layer was built "
                    f"({'; '.join(changed)}); its exchanges, plans and parameters were made "
                    f"from the options it was built with: build another layer"
                    + (f" (options that may change: {', '.join(live)})" if live
                       else "")))
            self.__dict__["_last"] = (spec, grad, kinds)
        if grad == CHECKPOINT_BIT and member:  # (alike on every member: checked above)
            raise raised_everywhere(refusal(self.name, "a call that records nothing for "
                                                       "backward"))
        self.check_kind(spec, kinds)
        if spec.partition != self.P_in:
            raise raised_everywhere(ShapeError(
                f"{self.name}: the input is distributed over partition {spec.partition.shape}"
                f" of ranks {list(spec.partition.ranks)}, the layer over {self.P_in.shape} of "
                f"ranks {list(self.P_in.ranks)}"))
        try:
            return self._plans.get_or_make(spec, lambda: self.make_plan(spec))
        except Exception as e:
            planning_error(e)
            raise

    @entry
    def forward(self, x: DistTensor | torch.Tensor) -> DistTensor | torch.Tensor:
        with self.world.control.scope(self.name):
            dist_in, local, spec = self.take(x)
            local = spec.adopt(local)
            ok = spec.matches(local)  # a checked call reports a bad block on every rank
            plan = self.plan(spec, local, ok)
            self.check_call(plan)
            if not ok:
                spec.check_local(local, self.name)
            if self.world.rank in self.participants:
                y = self.run(local, plan)
            else:  # records the graph where a participant's output would: through the
                # input or the layer's parameters (ranks must agree on it for the adjoints)
                y = local.new_zeros(plan.out.local_shape, dtype=plan.out.dtype)
                tie = local if local.requires_grad else next(
                    (p for p in self.parameters() if p.requires_grad), None)
                if tie is not None and torch.is_grad_enabled():
                    y = y + tie.sum() * 0
            if y.dtype != plan.out.dtype:  # (autocast's promotions differ between ranks)
                y = y.to(plan.out.dtype)
            return DistTensor(y, plan.out, check=False) if dist_in else y

    def make_plan(self, spec: TensorSpec):
        raise NotImplementedError

    def check_call(self, plan) -> None:
        """Checks of a call that depend on the module's state too (e.g. training), run on
        every rank, so every rank raises alike."""

    def run(self, x: torch.Tensor, plan) -> torch.Tensor:
        raise NotImplementedError


def state_digest(sd: dict) -> int:
    """A hash of a state dict's keys, dtypes, shapes and values' bytes (62 bits): equal on
    two ranks only for the same dict (rows swapped, or a NaN beside other changes, keep
    sums alike but not this)."""
    h = hashlib.blake2b(digest_size=8)
    for k, v in sorted(sd.items(), key=lambda kv: str(kv[0])):
        if not isinstance(v, torch.Tensor):
            continue
        h.update(repr((str(k), str(v.dtype), tuple(v.shape))).encode())
        t = v.detach()
        try:
            t = t.to_dense() if t.layout != torch.strided else t
            t = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
            h.update(t.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # (a layout without bytes to view: its values)
            h.update(repr(t.tolist()).encode())
    return int.from_bytes(h.digest(), "little") & 0x3FFFFFFFFFFFFFFF


class ShardedParameters:
    """State dicts of a layer whose parameters are blocks of global tensors.

    ``self.homes``: parameter/buffer name -> (partition holding its blocks, global shape);
    ``self.root``: the one-worker partition the global state dict lands on.
    """

    homes: dict[str, tuple[Partition, tuple[int, ...]]]
    root: Partition

    def _collectors(self) -> dict[str, Repartition]:
        c = getattr(self, "_collect", None)
        if c is None:  # world-collective: made once, in the same order on every rank
            c = {k: Repartition(P, Partition(self.root.ranks, (1,) * P.dim, P.world))
                 for k, (P, _) in self.homes.items()}
            object.__setattr__(self, "_collect", c)
        return c

    def load_global_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True
                               ) -> None:
        """Keep this rank's blocks of a sequential layer's state dict. Collective: every
        rank passes the same whole dict (``global_state_dict()`` returns it on the root
        only: broadcast it or load it from a file on every rank). The ranks compare what
        they were given (keys, shapes, a hash of the values' bytes) and raise the same error
        everywhere where it differs, lacks a key of the layer or has one it does not
        know (``strict=False``: missing and unknown keys allowed, as torch's)."""
        name = f"{type(self).__name__}.load_global_state_dict"
        mine = [k for k, _ in self.homes.items() if getattr(self, k, None) is not None]
        entries = self._global_entries()
        missing = [k for k in entries if k not in sd]
        unknown = [k for k in sd if k not in entries and k not in self.homes]
        shapes = [k for k, shape in entries.items()
                  if k in sd and (not isinstance(sd[k], torch.Tensor)
                                  or tuple(sd[k].shape) != tuple(shape))]
        wrong = shapes + (missing + unknown if strict else [])
        w = self.root.world
        group = w.transport.group(range(w.size)) if w.size > 1 else None
        rows = exchange(group, Row.make(name[-24:], BAD_BLOCK if wrong else OK,
                                        self._layer_config(), None, "cpu", None, None,
                                        state_digest(sd)), name)
        ranks = group.ranks if group is not None else (w.rank,)
        # a peer at another operator, or this layer built otherwise there (its options, or
        # its number among the layers built: the programs diverged), not a bad dict
        same_program(rows, ranks, name)
        bad = [r for r, x in zip(ranks, rows) if x.status != OK]
        if bad:
            here = "; ".join(f"{what} {ks}" for what, ks in (
                ("missing", missing if strict else []), ("unknown", unknown if strict else []),
                ("of another shape", shapes)) if ks)
            raise raised_everywhere(ShapeError(
                f"{name}: the state dict does not fit the layer on rank(s) {bad}"
                + (f" (here: {here})" if here else "") + f"; the layer's entries "
                f"{entries}; every rank passes the whole "
                f"sequential state dict (global_state_dict() returns it on the root only)"))
        if len({x.spec_hash for x in rows}) > 1:
            raise raised_everywhere(MismatchError(
                f"{name}: the ranks were given different state dicts (keys, shapes or "
                f"values differ); every rank passes the same whole sequential state dict"))
        with torch.no_grad():
            for k in mine:
                if k in sd:
                    p = getattr(self, k)
                    p.data = self._cut(k, sd[k]).to(p)

    def _layer_config(self) -> int:
        """This layer as the ranks' checks outside its calls compare it: its options and
        its number among the layers built (a layer built otherwise on some ranks moves
        every later layer's number there: the world ends, as at its first call)."""
        return config_of(self.config(), self._uid)

    def _same_layer(self, name: str) -> None:
        """Collective over the world: every rank is at this check of this layer, built
        alike (else a MismatchError on every rank, the world ended)."""
        w = self.root.world
        if w.size > 1:
            barrier(w.transport.group(range(w.size)), name, w, self._layer_config())

    def _global_entries(self) -> dict[str, tuple[int, ...]]:
        """The sequential layer's state dict entries this layer holds, with their global
        shapes (a subclass adds what it loads itself, e.g. running statistics)."""
        return {k: tuple(shape) for k, (_, shape) in self.homes.items()
                if getattr(self, k, None) is not None}

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global parameter ``t``."""
        return block(t, self.homes[name][0])

    def _built_shapes(self, shapes: tuple) -> tuple:
        """This rank's block shapes as the layout makes them (a parameter replaced by one
        of another shape before the layer's first call is caught too)."""
        out = []
        for n, s in zip(self._param_names(), shapes):
            if n in self.homes:  # cut from a tensor without storage
                s = self._cut(n, torch.empty(self.homes[n][1], device="meta")).shape
            out.append(torch.Size(s))
        return tuple(out)

    def _gathered(self, pick, name: str) -> dict[str, torch.Tensor]:
        self._same_layer(f"{type(self).__name__}.{name}")
        out = {}
        for k, op in self._collectors().items():
            p = getattr(self, k)
            if p is None:
                continue
            v = op(pick(p))
            if self.root.active:
                out[k] = v
        return out

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the sequential layer's state dict on the root worker, ``{}``
        elsewhere."""
        return self._gathered(lambda p: p.detach(), "global_state_dict")

    def global_grads(self) -> dict[str, torch.Tensor]:
        """Collective: the full gradients on the root worker, ``{}`` elsewhere."""
        return self._gathered(lambda p: p.grad if p.grad is not None else torch.zeros_like(p),
                             "global_grads")

    # -- per-rank checkpoints carry their layout ------------------------------------------
    def layout(self) -> dict:
        """What a per-rank checkpoint's blocks depend on: this rank, the world size, the
        layer's input partition (e.g. batch norm's running statistics follow it) and where
        each parameter's blocks live."""
        w = self.root.world
        P_in = getattr(self, "P_in", None)
        return {"rank": w.rank, "world_size": w.size, "layer": type(self).__name__,
                "input": [list(P_in.ranks), list(P_in.shape)] if P_in is not None else None,
                "blocks": {k: [list(P.ranks), list(P.shape), list(shape)]
                           for k, (P, shape) in self.homes.items()}}

    def get_extra_state(self) -> dict:
        return {"gpudist_layout": self.layout()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # the layout is checked before torch copies any tensor (a refused checkpoint must
        # not leave the blocks it could copy loaded)
        extra = state_dict.get(prefix + "_extra_state")
        if extra is not None:
            self.set_extra_state(extra)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def set_extra_state(self, state) -> None:
        saved = (state or {}).get("gpudist_layout") if isinstance(state, dict) else None
        mine = self.layout()
        if saved is not None and saved != mine:
            diff = [k for k in mine if saved.get(k) != mine[k]]
            what = "; ".join(f"{k}: saved {saved.get(k)}, here {mine[k]}"
                             for k in diff if k not in ("rank", "world_size"))
            raise ShapeError(
                f"{type(self).__name__}: this per-rank state dict was saved by rank "
                f"{saved.get('rank')} of {saved.get('world_size')}; here it is rank "
                f"{mine['rank']} of {mine['world_size']} (differs in: {', '.join(diff)}"
                + (f"; {what}" if what else "") + "). Per-rank checkpoints load only into "
                "the same layout; use global_state_dict() / load_global_state_dict() to "
                "move between layouts")
