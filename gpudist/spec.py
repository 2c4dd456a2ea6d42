"""The distributed tensor value: a local block plus the spec every rank agrees on.

:class:`TensorSpec` is a small frozen value (partition, global shape, dtype, device type):
every rank of the program holds the same one, so every rank can compute every worker's
block shape, and the operators that consume a tensor plan their communication without
asking anyone (no metadata collective in steady state).

:class:`DistTensor` pairs a spec with this rank's block (``local``, a plain tensor: autograd
sees only plain tensors). Primitives and layers take and return it; point-wise torch
functions (``F.relu``, ``torch.tanh``, ``x + y``, ...) apply to the blocks and keep the spec;
anything whose meaning depends on the partition (a reduction, a reshape) is refused with a
message saying what to use instead.
"""

from __future__ import annotations

import math
import numbers
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from .decomposition import Decomposition, block_range
from .errors import ShapeError, raised_everywhere
from .partition import Partition

DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128,
    torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
) + tuple(getattr(torch, n) for n in (  # (after the first twelve: their codes stay)
    "uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def dtype_of(code: int) -> torch.dtype | None:
    return DTYPES[code] if 0 <= code < len(DTYPES) else None


def stable_hash(obj: object) -> int:
    """A hash that is the same in every process (31 bits)."""
    return zlib.crc32(repr(obj).encode()) & 0x7FFFFFFF


REPLICATE = -1  # placement: every worker along this partition dim holds the whole extent
PARTIAL = -2    # placement: ... holds a whole-extent summand (the tensor is their sum)


def placement_name(p: int) -> str:
    return "R" if p == REPLICATE else "P" if p == PARTIAL else f"S({p})"


@dataclass(frozen=True)
class TensorSpec:
    """What every rank knows about a distributed tensor.

    ``placements`` has one entry per partition dimension: a tensor dimension ``d >= 0``
    that this partition dimension splits into balanced blocks (remainder to the lowest
    indices), :data:`REPLICATE` or :data:`PARTIAL`. The default (partition and tensor of
    the same rank) splits tensor dim ``i`` along partition dim ``i``: the layout between
    layers. A partition dimension of extent 1 is stored as ``REPLICATE`` whatever it was
    given as (its one worker holds the whole extent either way), so equal layouts compare
    equal.
    """

    partition: Partition
    global_shape: tuple[int, ...]
    dtype: torch.dtype = field(default=torch.float32)
    device_type: str = "cpu"
    placements: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        g = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", g)
        P = self.partition
        pl = self.placements
        if pl is None:
            if len(g) != P.dim:
                raise raised_everywhere(ShapeError(
                    f"global shape {g} has {len(g)} dimensions but partition {P.shape} has "
                    f"{P.dim}: give placements, or a tensor with one dimension per partition "
                    f"dimension"))
            pl = tuple(range(P.dim))
        pl = tuple(REPLICATE if P.shape[i] == 1 else int(p) for i, p in enumerate(pl))
        object.__setattr__(self, "placements", pl)
        if any(s < 0 for s in g) or len(pl) != P.dim:
            raise raised_everywhere(ShapeError(
                f"global shape {g} with placements {pl} does not fit partition {P.shape}"))
        shards = [p for p in pl if p >= 0]
        if len(set(shards)) != len(shards) or any(p >= len(g) for p in shards) or any(
                p < PARTIAL for p in pl):
            raise raised_everywhere(ShapeError(
                f"placements {[placement_name(p) for p in pl]} of a tensor of shape {g}: "
                f"each tensor dimension may be split by one partition dimension"))

    def __hash__(self) -> int:  # the fields' hash, made once (plans are looked up per call)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.partition, self.global_shape, self.dtype, self.device_type,
                      self.placements))
            object.__setattr__(self, "_hash", h)
        return h

    # -- blocks ---------------------------------------------------------------------
    @property
    def standard(self) -> bool:
        """Tensor dim ``i`` split along partition dim ``i`` (or not split at all)."""
        return len(self.global_shape) == self.partition.dim and all(
            p in (i, REPLICATE) and (p == i or self.partition.shape[i] == 1)
            for i, p in enumerate(self.placements))

    @cached_property
    def decomposition(self) -> Decomposition:
        if not self.standard:
            raise ShapeError(f"a tensor with placements {self.placements} has no standard "
                             f"block decomposition")
        return Decomposition(self.global_shape, self.partition.shape)

    def local_shape_of(self, coords: Sequence[int]) -> tuple[int, ...]:
        """The block shape of the worker at partition ``coords``."""
        shape = list(self.global_shape)
        for i, p in enumerate(self.placements):
            if p >= 0:
                lo, hi = block_range(self.global_shape[p], self.partition.shape[i], coords[i])
                shape[p] = hi - lo
        return tuple(shape)

    def local_start_of(self, coords: Sequence[int]) -> tuple[int, ...]:
        start = [0] * len(self.global_shape)
        for i, p in enumerate(self.placements):
            if p >= 0:
                start[p] = block_range(self.global_shape[p], self.partition.shape[i],
                                       coords[i])[0]
        return tuple(start)

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        """This rank's block shape (all zeros when the rank is not in the partition)."""
        if not self.partition.active:
            return (0,) * self.ndim
        return self.local_shape_of(self.partition.coords)

    @cached_property
    def local_start(self) -> tuple[int, ...]:
        if not self.partition.active:
            return (0,) * self.ndim
        return self.local_start_of(self.partition.coords)

    @property
    def ndim(self) -> int:
        return len(self.global_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    # -- values ---------------------------------------------------------------------
    def replace(self, **changes) -> TensorSpec:
        if "partition" in changes and "placements" not in changes and \
                changes["partition"].dim != self.partition.dim:
            changes["placements"] = None
        return replace(self, **changes)

    @cached_property
    def fingerprint(self) -> int:
        return stable_hash((self.partition.key, self.global_shape, str(self.dtype),
                            self.device_type, self.placements))

    def describe(self) -> str:
        P = self.partition
        pl = "" if self.standard else \
            f" placed {'/'.join(placement_name(p) for p in self.placements)}"
        return (f"{self.global_shape} {str(self.dtype).replace('torch.', '')} on "
                f"{self.device_type} over partition {P.shape} of ranks {list(P.ranks)}{pl}")

    def matches(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can be this rank's block (shape, dtype, device type)."""
        if t.shape != self.local_shape or t.dtype != self.dtype:
            return False
        kind = self.device_type  # (``t.device`` makes an object: 4x the cost of is_cpu)
        return t.is_cpu if kind == "cpu" else t.is_cuda if kind == "cuda" else (
            t.device.type == kind)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as this rank's block: a rank outside the partition may pass any
        zero-volume tensor (it is reshaped to the spec's all-zero shape)."""
        if not self.partition.active and t.numel() == 0 and tuple(t.shape) != self.local_shape:
            return t.reshape(self.local_shape)
        return t

    def check_local(self, t: torch.Tensor, what: str) -> None:
        """Raise :class:`ShapeError` if ``t`` is not this rank's block of the spec."""
        if self.matches(t):
            return
        rank = self.partition.world.rank
        raise ShapeError(
            f"{what}: rank {rank} holds a block of shape {tuple(t.shape)}, "
            f"{str(t.dtype).replace('torch.', '')} on {t.device.type}, but the tensor is "
            f"{self.describe()}, whose block here is {self.local_shape} "
            f"{str(self.dtype).replace('torch.', '')} on {self.device_type}")

    @classmethod
    def of(cls, t: torch.Tensor, partition: Partition, global_shape: Sequence[int],
           placements: Sequence[int] | None = None) -> TensorSpec:
        return cls(partition, tuple(global_shape), t.dtype, t.device.type,
                   None if placements is None else tuple(placements))


# --------------------------------------------------------------------------- the value
_UNARY = {
    F.relu, torch.relu, F.relu6, F.gelu, F.silu, F.elu, F.selu, F.celu, F.leaky_relu,
    F.hardtanh, F.softplus, F.mish, F.hardswish, F.hardsigmoid, F.tanh, F.sigmoid, F.logsigmoid,
    torch.tanh, torch.sigmoid, torch.exp, torch.abs, torch.neg, torch.square, torch.sqrt,
    torch.sin, torch.cos, torch.log, torch.clamp, torch.relu_, F.relu_, torch.nn.functional.dropout,
    torch.Tensor.relu, torch.Tensor.tanh, torch.Tensor.sigmoid, torch.Tensor.exp,
    torch.Tensor.abs, torch.Tensor.neg, torch.Tensor.clamp, torch.Tensor.square,
    torch.Tensor.sqrt, torch.Tensor.relu_, torch.Tensor.float, torch.Tensor.double,
    torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.contiguous, torch.Tensor.clone,
    torch.clone, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.rsqrt,
    torch.reciprocal, torch.log1p, torch.expm1, torch.erf, torch.isnan, torch.isfinite,
    torch.logical_not, torch.Tensor.sign, torch.Tensor.floor, torch.Tensor.ceil,
    torch.Tensor.round, torch.Tensor.rsqrt, torch.Tensor.reciprocal, torch.Tensor.log,
    torch.Tensor.logical_not, torch.Tensor.__abs__, torch.Tensor.__invert__,
    # (a peer suite found these refused as "would depend on how the tensor is partitioned")
    torch.nan_to_num, torch.Tensor.nan_to_num, F.threshold, F.softsign, F.tanhshrink,
    F.softshrink, F.hardshrink, torch.tan, torch.atan, torch.asin, torch.acos, torch.sinh,
    torch.cosh, torch.asinh, torch.acosh, torch.atanh, torch.log2, torch.log10, torch.exp2,
    torch.erfc, torch.erfinv, torch.frac, torch.isinf, torch.isposinf, torch.isneginf,
    torch.signbit, torch.logit, torch.Tensor.tan, torch.Tensor.atan, torch.Tensor.log2,
    torch.Tensor.log10, torch.Tensor.erf, torch.Tensor.erfc, torch.Tensor.sin,
    torch.Tensor.cos, torch.Tensor.log1p, torch.Tensor.expm1, torch.Tensor.trunc,
    torch.Tensor.frac, torch.Tensor.isnan, torch.Tensor.isinf, torch.Tensor.isfinite,
}
_BINARY = {
    torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum,
    torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul, torch.Tensor.div,
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__, torch.Tensor.add_, torch.Tensor.mul_, torch.Tensor.sub_,
    torch.Tensor.div_, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__,
    torch.Tensor.__rpow__, torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne,
    torch.Tensor.gt, torch.Tensor.lt, torch.Tensor.ge, torch.Tensor.le, torch.Tensor.eq,
    torch.Tensor.ne, torch.Tensor.__gt__, torch.Tensor.__lt__, torch.Tensor.__ge__,
    torch.Tensor.__le__, torch.where, torch.logical_and, torch.logical_or,
    torch.Tensor.logical_and, torch.Tensor.logical_or, torch.Tensor.__and__,
    torch.Tensor.__or__, torch.Tensor.__rand__, torch.Tensor.__ror__, torch.Tensor.__xor__,
    torch.Tensor.__rxor__, torch.logical_xor, torch.isclose, torch.Tensor.isclose,
    torch.hypot, torch.atan2, torch.copysign, torch.fmod, torch.remainder, torch.xlogy,
    torch.logaddexp, torch.logaddexp2, torch.fmax, torch.fmin, torch.lerp, torch.addcmul,
    torch.addcdiv, torch.clamp_min, torch.clamp_max, torch.Tensor.hypot, torch.Tensor.atan2,
    torch.Tensor.copysign, torch.Tensor.fmod, torch.Tensor.remainder, torch.Tensor.xlogy,
    torch.Tensor.logaddexp, torch.Tensor.lerp, torch.Tensor.addcmul, torch.Tensor.addcdiv,
    torch.Tensor.maximum, torch.Tensor.minimum, torch.Tensor.clamp_min,
    torch.Tensor.clamp_max,
}  # (and torch.where's three operands: every DistTensor among them laid out alike)


# on summands (PARTIAL: the tensor is the sum of the blocks) only linear maps are exact
_LINEAR_UNARY = {
    torch.neg, torch.Tensor.neg, torch.clone, torch.Tensor.clone, torch.Tensor.contiguous,
    torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16,
}
_ADDITIVE = {
    torch.add, torch.sub, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.__add__,
    torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.add_,
    torch.Tensor.sub_,
}
_SCALING = {
    torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.Tensor.mul_, torch.div, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.Tensor.div_,
}
_DIVISION = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_}


# torch.Tensor attributes that say what the block is, alike on every rank (a DistTensor
# answers them from its block); the other non-callable ones (x.T, x.mT, x.real) are refused
_BLOCK_FACTS = frozenset({"is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
                          "is_mkldnn", "layout", "is_leaf", "grad_fn"})


def _unsupported(what: str) -> str:
    """The refusal of ``what`` ("does not support cat", "has no .sum()")."""
    return (f"gpudist.DistTensor {what}: its result would depend on how the "
            f"tensor is partitioned. Use a gpudist layer or primitive, or apply it to x.local "
            f"and wrap the result with DistTensor.from_local(..., global_shape=...)")


def _check_linear(func, name: str, args: tuple, kwargs: dict, dts: list) -> None:
    """Refuse a point-wise op that is not exact on summands: ``relu(a + b)`` is not
    ``relu(a) + relu(b)``, nor ``(a + b) + 1`` the sum of ``a + 1`` and ``b + 1``, nor a
    rounded division the sum of the rounded parts."""
    numerator = args[0] if args else kwargs.get("input")
    scalars = [a for a in list(args) + list(kwargs.values())
               if not isinstance(a, DistTensor) and _is_scalar(a)]
    finite = all(_finite(a, func in _DIVISION and a is not numerator) for a in scalars)
    ok = ((func in _LINEAR_UNARY and len(dts) == 1)
          or (func in _ADDITIVE and len(dts) == 2
              and all(isinstance(a, DistTensor) for a in args[:2]))
          or (func in _SCALING and len(dts) == 1 and finite
              and (func not in _DIVISION or (numerator is dts[0]
                                             and kwargs.get("rounding_mode") is None))))
    if not ok:
        raise raised_everywhere(TypeError(
            f"{name} of a tensor held as summands (placement PARTIAL: the tensor is the sum "
            f"of the blocks) would apply to each summand, not to their sum; only negation, "
            f"copies, sums of such tensors and scaling by a finite number (division by a "
            f"nonzero one) are exact. Sum the blocks first (SumReduce or AllSumReduce)"))


def _copies(spec: TensorSpec) -> bool:
    """Whether workers hold copies of one block (REPLICATE along a partition dim of more
    than one worker; an extent-1 dim is REPLICATE too, but holds one copy)."""
    return any(p == REPLICATE and n > 1
               for p, n in zip(spec.placements, spec.partition.shape))


def _is_scalar(a) -> bool:
    """A number alike on every rank (Python's, NumPy's): checked at no cost. A 0-dim
    tensor is each rank's own value and not read (no device sync per call)."""
    return isinstance(a, numbers.Number) and not isinstance(a, bool)


def _finite(a, divisor: bool) -> bool:
    """Whether scaling summands by ``a`` (dividing, if ``divisor``) is exact for their
    sum: inf * (2 + -1) is inf, inf * 2 + inf * -1 is nan."""
    v = complex(a)
    return math.isfinite(v.real) and math.isfinite(v.imag) and not (divisor and v == 0)


def _failed(func, name: str, args: tuple, kwargs: dict, spec: TensorSpec,
            e: Exception) -> None:
    """A point-wise op that raised on this rank: alike on every rank where the same call
    on empty blocks raises too (dtypes, options, a leaf changed in place: every rank
    raises it), else its data's (an integer division by zero, in some blocks only) and
    posted to the world, whose other ranks raise it at their next wait. With a plain
    tensor among the operands (each rank's own value) it is posted without asking."""
    def empty(a):
        t = a.local
        return t.new_empty((0,)).requires_grad_(t.requires_grad and t.is_leaf)

    operands = list(args) + list(kwargs.values())
    if not any(isinstance(a, torch.Tensor) for a in operands):
        try:
            func(*[empty(a) if isinstance(a, DistTensor) else a for a in args],
                 **{k: empty(v) if isinstance(v, DistTensor) else v
                    for k, v in kwargs.items()})
        except Exception:
            raised_everywhere(e)
            return
    with spec.partition.world.control.scope(f"{name} on a DistTensor"):
        raise e


class DistTensor:
    """A tensor distributed over ``spec.partition``: this rank's block ``local`` + ``spec``.

    Inactive ranks hold a zero-volume ``local``. Build one with :meth:`from_local` (the
    global shape given, or found once by a metadata exchange), or get one from
    :func:`gpudist.distribute`, a primitive or a layer.
    """

    __slots__ = ("local", "spec")

    def __init__(self, local: torch.Tensor, spec: TensorSpec, *, check: bool = True) -> None:
        if check and not spec.matches(local):  # this rank's own error: tell the world
            with spec.partition.world.control.scope("DistTensor"):
                spec.check_local(local, "DistTensor")
        self.local, self.spec = local, spec

    @classmethod
    def from_local(cls, local: torch.Tensor, partition: Partition,
                   global_shape: Sequence[int] | None = None) -> DistTensor:
        """Wrap this rank's block. Without ``global_shape`` the blocks' shapes are
        exchanged over ``partition`` once (collective) and checked to tile a tensor."""
        if not isinstance(partition, Partition):
            raise TypeError(f"DistTensor.from_local: partition must be a gpudist.Partition, "
                            f"got {type(partition).__name__}")
        if not isinstance(local, torch.Tensor):
            with partition.world.control.scope("DistTensor.from_local"):
                raise TypeError(f"DistTensor.from_local: local must be a torch.Tensor, got "
                                f"{type(local).__name__}")
        if global_shape is None:
            from .meta import derive_spec

            return cls(local, derive_spec(partition, local, "DistTensor.from_local"))
        try:
            if any(isinstance(n, bool) for n in global_shape):  # (True is an int)
                raise TypeError
            global_shape = tuple(operator.index(n) for n in global_shape)
        except TypeError:
            with partition.world.control.scope("DistTensor.from_local"):
                raise ShapeError(
                    f"DistTensor.from_local: global_shape must be a sequence of integers, "
                    f"got {global_shape!r}") from None
        if not partition.active and local.numel() == 0:
            local = local.reshape((0,) * len(tuple(global_shape)))
        return cls(local, TensorSpec.of(local, partition, global_shape))

    # -- what it is ------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.spec.global_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def partition(self) -> Partition:
        return self.spec.partition

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def ndim(self) -> int:
        return self.spec.ndim

    def dim(self) -> int:
        return self.spec.ndim

    def numel(self) -> int:
        """The global number of elements (as ``shape`` is the global shape)."""
        return self.spec.numel

    def __len__(self) -> int:
        if not self.spec.ndim:
            raise TypeError("len() of a 0-d DistTensor")
        return self.spec.global_shape[0]

    def __getitem__(self, index):
        raise TypeError(_unsupported("does not support indexing"))

    def __setitem__(self, index, value):
        raise TypeError(_unsupported("does not support item assignment"))

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    @property
    def grad(self) -> DistTensor | None:
        g = self.local.grad
        return None if g is None else DistTensor(g, self.spec, check=False)

    def requires_grad_(self, flag: bool = True) -> DistTensor:
        self.local.requires_grad_(flag)
        return self

    def detach(self) -> DistTensor:
        return DistTensor(self.local.detach(), self.spec, check=False)

    def to(self, *args, **kwargs) -> DistTensor:
        t = self.local.to(*args, **kwargs)
        if PARTIAL in self.spec.placements and t.dtype != self.local.dtype and not (
                t.dtype.is_floating_point or t.dtype.is_complex):
            raise raised_everywhere(TypeError(
                f"DistTensor.to({t.dtype}) of a tensor held as summands (placement PARTIAL): "
                f"each summand would be rounded, not their sum. Sum the blocks first "
                f"(SumReduce or AllSumReduce)"))
        return DistTensor(t, self.spec.replace(dtype=t.dtype, device_type=t.device.type),
                          check=False)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> DistTensor:
        """Flatten dims ``start_dim..end_dim``: allowed when the blocks stay the balanced
        blocks of the flattened dim (only its first dim split, into equal parts, or all
        later dims of extent 1); otherwise repartition first."""
        sp, n = self.spec, self.spec.ndim
        if n == 0:
            raise raised_everywhere(TypeError("DistTensor.flatten of a 0-d tensor: apply it "
                                              "to x.local"))
        for d in (start_dim, end_dim):
            if not -n <= d < n:
                raise raised_everywhere(IndexError(
                    f"DistTensor.flatten: dimension out of range (expected to be in range of "
                    f"[{-n}, {n - 1}], but got {d})"))
        a, b = start_dim % n, end_dim % n
        if a > b:
            raise raised_everywhere(RuntimeError(
                "DistTensor.flatten: start_dim cannot come after end_dim"))
        if a == b:
            return self
        if not sp.standard:
            raise raised_everywhere(ShapeError(
                f"DistTensor.flatten({start_dim}, {end_dim}): the tensor is {sp.describe()}, "
                f"not split the standard way (tensor dim i along partition dim i); "
                f"repartition first"))
        P, g = sp.partition, sp.global_shape
        if any(P.shape[d] != 1 for d in range(a + 1, b + 1)):
            raise raised_everywhere(ShapeError(
                f"DistTensor.flatten({start_dim}, {end_dim}): partition {P.shape} splits a "
                f"dimension after the first flattened one; repartition first"))
        inner = math.prod(g[a + 1:b + 1])
        if inner != 1 and g[a] % P.shape[a] != 0:
            raise raised_everywhere(ShapeError(
                f"DistTensor.flatten({start_dim}, {end_dim}): {g[a]} entries of dim {a} over "
                f"{P.shape[a]} workers are uneven blocks, and flattened they would not be "
                f"the balanced blocks of {g[a] * inner}; repartition first"))
        shape = P.shape[:a] + (P.shape[a],) + P.shape[b + 1:]
        Q = P if shape == P.shape else P.reshape(shape)
        gs = g[:a] + (g[a] * inner,) + g[b + 1:]
        loc = self.local.flatten(a, b) if P.active else self.local.reshape((0,) * len(gs))
        return DistTensor(loc, sp.replace(partition=Q, global_shape=gs))

    def __repr__(self) -> str:
        return f"DistTensor({self.spec.describe()}, local={tuple(self.local.shape)})"

    # -- point-wise torch functions ---------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = list(args) + list(kwargs.values())
        dts = [a for a in operands if isinstance(a, DistTensor)]
        if func is torch.numel and len(args) == 1 and dts:
            return dts[0].spec.numel  # (the global count, as x.numel())
        name = getattr(func, "__name__", getattr(func, "__qualname__", str(func)))
        if not dts or not (func in _UNARY or func in _BINARY):  # e.g. torch.cat([x, y])
            raise raised_everywhere(TypeError(_unsupported(f"does not support {name}")))
        spec = dts[0].spec
        for d in dts[1:]:
            if (d.spec.partition, d.spec.global_shape, d.spec.placements) != \
                    (spec.partition, spec.global_shape, spec.placements):
                raise raised_everywhere(ShapeError(
                    f"{name}: operands are distributed differently ({spec.describe()} vs "
                    f"{d.spec.describe()}); repartition one of them first"))
        for a in operands:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                raise raised_everywhere(TypeError(
                    f"{name}: a DistTensor combines only with DistTensors of the same "
                    f"distribution and with scalars, not with a plain tensor of shape "
                    f"{tuple(a.shape)}"))
        if PARTIAL in spec.placements:
            _check_linear(func, name, args, kwargs, dts)
        if func is F.dropout and _copies(spec) and \
                (args[2] if len(args) > 2 else kwargs.get("training", True)) and \
                (args[1] if len(args) > 1 else kwargs.get("p", 0.5)) != 0:
            raise raised_everywhere(TypeError(
                "dropout of a tensor with replicated blocks (placement REPLICATE): each copy "
                "would get its own mask, and the copies would differ. Apply it where the "
                "tensor is split (each rank's block its own mask) or on one copy"))

        def unwrap(a):
            return a.local if isinstance(a, DistTensor) else a

        try:
            out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
        except Exception as e:
            _failed(func, name, args, kwargs, spec, e)
            raise
        if not isinstance(out, torch.Tensor):  # e.g. torch.where(cond): indices of a block
            raise raised_everywhere(TypeError(_unsupported(f"does not support {name} "
                                                           f"returning {type(out).__name__}")))
        return DistTensor(out, spec.replace(dtype=out.dtype, device_type=out.device.type),
                          check=False)

    def _binary(self, func, other):
        return DistTensor.__torch_function__(func, (DistTensor,), (self, other))

    def _inplace(self, func, other):
        """``x += v`` and the like: the block changed in place, as torch's (aliases of x
        see it; torch's casting rules apply)."""
        DistTensor.__torch_function__(func, (DistTensor,), (self, other))
        return self

    def __iadd__(self, o):
        return self._inplace(torch.Tensor.add_, o)

    def __isub__(self, o):
        return self._inplace(torch.Tensor.sub_, o)

    def __imul__(self, o):
        return self._inplace(torch.Tensor.mul_, o)

    def __itruediv__(self, o):
        return self._inplace(torch.Tensor.div_, o)

    def __add__(self, o):
        return self._binary(torch.Tensor.__add__, o)

    def __radd__(self, o):
        return self._binary(torch.Tensor.__radd__, o)

    def __sub__(self, o):
        return self._binary(torch.Tensor.__sub__, o)

    def __rsub__(self, o):
        return self._binary(torch.Tensor.__rsub__, o)

    def __mul__(self, o):
        return self._binary(torch.Tensor.__mul__, o)

    def __rmul__(self, o):
        return self._binary(torch.Tensor.__rmul__, o)

    def __truediv__(self, o):
        return self._binary(torch.Tensor.__truediv__, o)

    def __rtruediv__(self, o):
        return self._binary(torch.Tensor.__rtruediv__, o)

    def __getattr__(self, name: str):
        """Only reached for what the class does not define: torch.Tensor's point-wise
        methods (``x.double()``, ``x.clamp(0)``) pass through ``__torch_function__``; its
        other methods (``x.sum()``, ``x.view(...)``) are refused with what to use instead."""
        if name.startswith("__") or name in DistTensor.__slots__:
            raise AttributeError(name)
        f = getattr(torch.Tensor, name, None)
        if f is not None and (f in _UNARY or f in _BINARY):
            return lambda *a, **k: DistTensor.__torch_function__(f, (DistTensor,), (self, *a), k)
        if callable(f):
            raise AttributeError(_unsupported(f"has no .{name}()"))
        if name in _BLOCK_FACTS:
            return getattr(self.local, name)
        if f is not None:  # a property of torch.Tensor's (x.T, x.mT, x.real, ...)
            raise AttributeError(_unsupported(f"has no .{name}"))
        raise AttributeError(f"'DistTensor' object has no attribute {name!r}")

    def __pow__(self, o):
        return self._binary(torch.Tensor.__pow__, o)

    def __rpow__(self, o):
        return self._binary(torch.Tensor.__rpow__, o)

    def __gt__(self, o):
        return self._binary(torch.Tensor.__gt__, o)

    def __lt__(self, o):
        return self._binary(torch.Tensor.__lt__, o)

    def __ge__(self, o):
        return self._binary(torch.Tensor.__ge__, o)

    def __le__(self, o):
        return self._binary(torch.Tensor.__le__, o)

    def __and__(self, o):
        return self._binary(torch.Tensor.__and__, o)

    def __rand__(self, o):
        return self._binary(torch.Tensor.__rand__, o)

    def __or__(self, o):
        return self._binary(torch.Tensor.__or__, o)

    def __ror__(self, o):
        return self._binary(torch.Tensor.__ror__, o)

    def __xor__(self, o):
        return self._binary(torch.Tensor.__xor__, o)

    def __rxor__(self, o):
        return self._binary(torch.Tensor.__rxor__, o)

    def __bool__(self) -> bool:  # (not marked raised everywhere: asked where a rank asks)
        raise TypeError(
            "the truth value of a gpudist.DistTensor would be each rank's own (its block's), "
            "so ranks could take different branches: reduce it first (e.g. AllSumReduce of "
            "a count) and test the result, or test x.local where a per-rank answer is meant")

    # (== and != stay identity comparisons, as for objects: use torch.eq / torch.ne)

    def __abs__(self):
        return DistTensor.__torch_function__(torch.abs, (DistTensor,), (self,))

    def __invert__(self):
        return DistTensor.__torch_function__(torch.Tensor.__invert__, (DistTensor,), (self,))

    def __matmul__(self, o):
        raise raised_everywhere(TypeError(_unsupported("does not support @ (matmul)")))

    __rmatmul__ = __matmul__

    def __neg__(self):
        return DistTensor.__torch_function__(torch.neg, (DistTensor,), (self,))

    def relu(self) -> DistTensor:
        return DistTensor.__torch_function__(torch.relu, (DistTensor,), (self,))


def local_of(x: DistTensor | torch.Tensor) -> torch.Tensor:
    return x.local if isinstance(x, DistTensor) else x
