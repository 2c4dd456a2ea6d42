"""Distributed losses: the local loss summed over the partition into the root worker.

Cross-entropy and NLL may have their class dimension (dim 1) split too: each worker then
holds the logits of its classes (a vocabulary-parallel loss, :mod:`.loss_classes`).

F(x) = sum over workers of loss(x_local, target_local), divided for ``"mean"`` by the
global count (elements; for cross-entropy/NLL the summed weights of the non-ignored
targets; for KL's ``"batchmean"`` the global batch size). One SumReduce carries the sum and
the divisor together. Every rank gets a 0-dim tensor: the value on the root, a zero
connected to the graph elsewhere, so every rank calls plain ``loss.backward()`` (which
drives its part of the adjoint: a Broadcast of the loss gradient, then the local loss
adjoints). ``reduction="none"`` returns the element-wise loss distributed like the input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import Plan, SumReduce
from ..primitives.base import entry
from ..spec import PARTIAL, DistTensor, TensorSpec
from ._layer import DistributedModule
from ._params import connect
from .loss_classes import ClassSplit

# name -> (torch function, class-dim loss (target without the class dim), its options)
LOSSES: dict[str, tuple[Callable, bool]] = {
    "mse": (F.mse_loss, False), "l1": (F.l1_loss, False),
    "smooth_l1": (F.smooth_l1_loss, False), "huber": (F.huber_loss, False),
    "bce": (F.binary_cross_entropy, False),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, False),
    "kl_div": (F.kl_div, False), "poisson_nll": (F.poisson_nll_loss, False),
    "cross_entropy": (F.cross_entropy, True), "nll": (F.nll_loss, True),
}
_REDUCTIONS = ("mean", "sum", "none", "batchmean")


@dataclass
class _LossPlan:
    out: TensorSpec
    total: Plan
    count: int   # global elements (or targets) for "mean"
    batch: int   # global batch size for "batchmean"
    spec: TensorSpec | None = None  # the input's, and the class-split sums' plans for it
    split: tuple[Plan, Plan] | None = None


class DistributedLoss(DistributedModule):
    """``loss`` (a name of :data:`LOSSES` or a callable taking ``reduction``) over a tensor
    partitioned by ``P_x``, ``reduction`` as in torch (``"batchmean"`` for ``kl_div``).
    Keyword options go to the torch function (``weight``, ``pos_weight``, ``ignore_index``,
    ``label_smoothing``, ``log_target``, ``log_input``, ``full``, ``beta``, ``delta``...);
    tensor options are cut to this worker's block where they span a split dimension."""

    check_outsiders = True  # a wrong target is reported to every rank at a checked call

    def __init__(self, P_x: Partition, loss: str | Callable = "mse", reduction: str = "mean",
                 **options) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise raised_everywhere(ValueError(
                f"reduction must be one of {', '.join(_REDUCTIONS)}, not {reduction!r}"))
        # torch.autocast runs torch's losses in float32 (a callable: in the input's dtype)
        self.autocast = "float32" if isinstance(loss, str) else None
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise raised_everywhere(ValueError(
                    f"unknown loss {loss!r}; choose from {', '.join(sorted(LOSSES))} or pass "
                    f"a callable"))
            self.fn, self.classwise = LOSSES[loss]
        else:
            self.fn, self.classwise = loss, False
        self.named = isinstance(loss, str)  # a callable's target may have any shape
        if reduction == "batchmean" and self.fn is not F.kl_div:
            raise raised_everywhere(ValueError("reduction='batchmean' is kl_div's only"))
        if self.classwise and P_x.dim < 2:  # torch's unbatched (C,): class dim 0
            raise raised_everywhere(PartitionError(
                f"{loss}: unbatched input (a 1-dimensional partition, P_x {P_x.shape}) is "
                f"not supported: the class dimension is dim 1 of an (N, C, ...) input; "
                f"add a batch dimension (x.unsqueeze(0), target.unsqueeze(0)) and use a "
                f"partition of 2 or more dimensions"))
        split = self.classwise and P_x.shape[1] != 1
        if split and reduction == "none":
            raise raised_everywhere(PartitionError(
                f"{loss}: reduction='none' with the class dimension (dim 1) split (P_x "
                f"{P_x.shape}) is not supported; use 'mean' or 'sum', or a partition with "
                f"extent 1 along dim 1"))
        self.P_x, self.reduction, self.options = P_x, reduction, options
        self.root = Partition([P_x.ranks[0]], (1,) * P_x.dim, P_x.world)
        self.setup(P_x, P_x.ranks)
        self.total = SumReduce(P_x, self.root)
        # the class dim split: its sums across the class axis (None: not split)
        self.split = ClassSplit(P_x, self.fn, options) if split else None
        # what the check across ranks says of wrong targets ({ranks} filled in there;
        # each rank adds what is wrong with its own)
        self._bad_target = (
            f"{self.name}: the target on rank(s) {{ranks}} does not fit: it must be that "
            f"rank's block of a tensor over the input's partition (the input block's shape; "
            f"class indices without the class dim; an empty one on ranks outside the "
            f"input's partition); broadcasting a target is not supported (each of those "
            f"ranks' error says what is wrong with its target)")

    def extra_repr(self) -> str:
        fn = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        opts = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(self.options.items()))
        return f"{fn}, reduction={self.reduction!r}" + (f", {opts}" if opts else "")

    def make_plan(self, spec: TensorSpec) -> _LossPlan:
        g = spec.global_shape
        if not spec.standard:
            raise raised_everywhere(ShapeError(f"{self.name}: the input must be split the "
                                               f"standard way, got {spec.describe()}"))
        if not self.classwise:  # tensor options broadcast to the input, as torch wants
            for name, v in self.options.items():
                if isinstance(v, torch.Tensor) and v.dim() and not _broadcasts(v.shape, g):
                    raise raised_everywhere(ShapeError(
                        f"{self.name}: option {name} of shape {list(v.shape)} does not "
                        f"broadcast to the input's global shape {list(g)}"))
        k = self.P_x.dim
        tot = TensorSpec(self.P_x, (2,), spec.dtype, spec.device_type, (PARTIAL,) * k)
        count = 1
        for i, n in enumerate(g):
            if not (self.classwise and i == 1):
                count *= n
        out = spec if not self.classwise or self.split is not None else TensorSpec(
            spec.partition.reshape(spec.partition.shape[:1] + spec.partition.shape[2:])
            if k > 1 else spec.partition, g[:1] + g[2:], spec.dtype, spec.device_type)
        split = self.split.plans(spec) if self.split is not None else None
        return _LossPlan(out, self.total.plan(tot), count, g[0] if g else 1, spec, split)

    @entry
    def forward(self, x: DistTensor | torch.Tensor, target) -> DistTensor | torch.Tensor:
        with self.world.control.scope(self.name):
            dist_in, local, spec = self.take(x)
            t = target.local if isinstance(target, DistTensor) else target
            problem = self._target_problem(target, t, spec)
            try:
                plan = self.plan(spec, local, problem is None, self._bad_target)
            except ShapeError as e:
                if getattr(e, "bad_ranks", None) is None:  # not the check's bad-target find
                    raise
                err = ShapeError(f"{e} (here: {problem})" if problem is not None else str(e))
                if self._checked_world or len(self.participants) == self.world.size:
                    raise raised_everywhere(err) from None
                raise err from None  # the members alone checked: posted to the others
            local = spec.adopt(local)
            spec.check_local(local, self.name)
            if problem is not None:  # (the check across ranks did not run: a repeated spec)
                raise ShapeError(problem)
            opts = {k: self._cut(v, spec) for k, v in self.options.items()}
            if self.reduction == "none":
                # (an empty block may come with any target: torch's loss is not asked)
                y = self.fn(local, t, reduction="none", **opts) \
                    if self.P_x.active and local.numel() else \
                    connect(local.new_zeros(plan.out.local_shape), local)  # in the graph
                return DistTensor(y, plan.out, check=False) if dist_in else y
            return self._reduced(local, t, opts, plan)

    def _reduced(self, x, t, opts, plan: _LossPlan) -> torch.Tensor:
        if self.split is not None and self.P_x.active:  # (every member joins its sums)
            s = self.split.losses(x, t, plan.spec, plan.split, opts).sum().to(
                x.dtype).reshape(())
            d = self._denominator(x, t, opts) if self.split.first else x.new_zeros(())
        elif self.P_x.active and x.numel():
            s = self.fn(x, t, reduction="sum", **opts).reshape(())
            d = self._denominator(x, t, opts)
        else:
            s = x.sum() * 0
            d = x.new_zeros(())
        v = self.total.apply_plan(torch.stack([s, d.to(s.dtype)]), plan.total)
        if not self.root.active:
            return v.sum() * 0  # a zero that keeps this rank's adjoint in the graph
        if self.reduction == "sum":
            return v[0]
        if self.reduction == "batchmean":
            return v[0] / plan.batch
        # a divisor of 0 (no target counts, or their class weights sum to 0) gives NaN, as
        # torch's 0/0 does, also where label smoothing made the sum non-zero
        d = v[1].detach()
        return v[0] / d.masked_fill(d == 0, math.nan)

    def _target_problem(self, target, t, spec: TensorSpec) -> str | None:
        """What is wrong with the target, or None. It must be this worker's block of a
        tensor over the input's partition: its shape the input block's (class indices:
        without the class dim). torch would broadcast another shape (with a warning,
        dividing by the wrong count); a block of another partition would pair the wrong
        entries. Found at a call the ranks check (the first, another spec or grad state)
        it is raised on every rank; otherwise the rank whose target is wrong raises (its
        peers get the error as a RemoteError)."""
        if (isinstance(target, DistTensor) and self.split is not None
                and not target.spec.dtype.is_floating_point):
            return (f"{self.name}: with the class dimension split, pass the class-index "
                    f"target as a plain tensor (each rank's block, the same on every rank "
                    f"of the class axis), not a DistTensor")
        if isinstance(target, DistTensor):
            P, got = spec.partition, target.spec.partition
            shape = P.shape
            if self.classwise and P.dim > 1 and not target.spec.dtype.is_floating_point:
                shape = shape[:1] + shape[2:]  # class indices: the class dim's extent goes
            if (got.ranks, got.shape) != (P.ranks, shape):
                return (f"{self.name}: the target is distributed over partition "
                        f"{got.shape} of ranks {list(got.ranks)}, but the input over "
                        f"{P.shape} of ranks {list(P.ranks)} takes targets over {shape} of "
                        f"those ranks")
        block = spec.local_shape
        if not isinstance(t, torch.Tensor):
            if self.named and self.P_x.active and math.prod(block):
                return (f"{self.name}: rank {spec.partition.world.rank}'s target is "
                        f"{type(t).__name__}, not a tensor")
            return None
        if not self.P_x.active:
            if t.numel():  # as an input block holding data outside its operator
                return (f"{self.name}: rank {spec.partition.world.rank} is outside the "
                        f"input's partition but passes a target holding {t.numel()} "
                        f"entries (pass an empty one)")
            return None
        if (self.classwise and self.options.get("ignore_index", -100) >= 0 and t.numel()
                and t.is_floating_point()):  # torch's ValueError (ShapeError is one)
            return f"{self.name}: ignore_index is not supported for floating point target"
        if not self.named or (math.prod(block) == 0 and self.split is None):
            return None  # empty blocks may come with any target (they hold nothing; with
            # the classes split, a block of no classes still reads its samples' targets)
        want = block
        if self.classwise and not t.dtype.is_floating_point:
            if t.dtype != torch.int64:  # torch's kernels take int64 class indices only
                return (f"{self.name}: rank {spec.partition.world.rank}'s class-index "
                        f"target is {t.dtype}; torch takes int64 (long) class indices")
            want = want[:1] + want[2:]  # class indices: no class dim
        if tuple(t.shape) != want:
            return (f"{self.name}: rank {spec.partition.world.rank}'s target block has shape "
                    f"{tuple(t.shape)}, its input block {block}: the target must be this "
                    f"rank's block of a tensor over the input's partition (shape {want}); "
                    f"broadcasting a target is not supported")
        return None

    def _denominator(self, x, t, opts) -> torch.Tensor:
        """This block's share of the "mean" divisor."""
        if not self.classwise:  # a fill on the device: no host-to-device copy
            return x.new_full((), float(x.numel()))
        ignore = opts.get("ignore_index", -100)
        if t.dtype.is_floating_point:  # class probabilities: every sample counts
            return x.new_full((), float(math.prod(t.shape[:1] + t.shape[2:])))
        keep = t != ignore
        w = opts.get("weight")
        if w is None:
            return keep.sum().to(x.dtype)
        # (an ignored target may be any value, ignore_index >= C too: index with a valid
        # class there; torch's loss has already refused the other targets out of range)
        return w[t.masked_fill(~keep, 0)].masked_fill(~keep, 0).sum().to(x.dtype)

    def _cut(self, v, spec: TensorSpec):
        """A tensor option cut to this worker's block along the split dims it spans
        (aligned with the input's trailing dims, as torch broadcasts it)."""
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or not self.P_x.active:
            return v
        if self.classwise:  # weight is per class: the class dim is never split
            return v
        g, off = spec.global_shape, spec.ndim - v.dim()
        sl = []
        for i in range(v.dim()):
            d = off + i
            if d >= 0 and v.shape[i] == g[d] and g[d] > 1:
                a = spec.local_start[d]
                sl.append(slice(a, a + spec.local_shape[d]))
            else:
                sl.append(slice(None))
        return v[tuple(sl)]


def _broadcasts(shape: Sequence[int], to: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` without growing it."""
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(reversed(tuple(shape)), reversed(tuple(to))))


def _named(loss: str, doc: str) -> type:
    def __init__(self, P_x: Partition, reduction: str = "mean", **options) -> None:
        DistributedLoss.__init__(self, P_x, loss, reduction, **options)

    return type(f"Distributed{doc}", (DistributedLoss,), {
        "__init__": __init__, "__doc__": f"``torch.nn.{doc}`` on a partitioned tensor."})


DistributedMSELoss = _named("mse", "MSELoss")
DistributedL1Loss = _named("l1", "L1Loss")
DistributedBCELoss = _named("bce", "BCELoss")
DistributedBCEWithLogitsLoss = _named("bce_with_logits", "BCEWithLogitsLoss")
DistributedKLDivLoss = _named("kl_div", "KLDivLoss")
DistributedPoissonNLLLoss = _named("poisson_nll", "PoissonNLLLoss")
DistributedCrossEntropyLoss = _named("cross_entropy", "CrossEntropyLoss")
DistributedNLLLoss = _named("nll", "NLLLoss")


def _describe(v: object) -> str:
    """An option as every rank can state it alike (a tensor by its shape and dtype)."""
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
    return repr(v) if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__
