"""Gradient clipping by the whole model's norm (``torch.nn.utils.clip_grad_norm_``) and
loss scaling (``torch.amp.GradScaler``) for a model whose parameters are split over
ranks.

torch's versions see one rank's blocks only: each rank would clip by another norm, or
skip a step its peers take, and the ranks' blocks would stop being one model. Here the
ranks combine what they see (one small collective) and act alike: the sequential model's
clipping and scaling.
"""

from __future__ import annotations

import math

import torch

from ..errors import MismatchError, raised_everywhere
from ..partition import Partition
from ..primitives import AllGather, AllSumReduce
from ..runtime import require_world
from ..spec import PARTIAL, DistTensor, TensorSpec
from ._layer import ShardedParameters

_REPLICA_RTOL = 1e-6  # replicated gradients after an all-reduce agree to rounding


def _part(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """sum |g|^p over these gradients (max |g| for p = inf, min for -inf), float64: what
    adds up over blocks (NaN propagates)."""
    if math.isinf(p):
        one = torch.amax if p > 0 else torch.amin
        vals = [one(g.detach().abs()).double() for g in grads if g.numel()]
    else:
        vals = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64) ** p
                for g in grads if g.numel()]
    if not vals:  # the combination's identity
        return torch.tensor(math.inf if p == -math.inf else 0.0, dtype=torch.float64)
    both = torch.stack([v.to(vals[0].device) for v in vals])  # no host sync per gradient
    return _combine(both, p).cpu()


def _combine(parts: torch.Tensor, p: float) -> torch.Tensor:
    return parts.max() if p == math.inf else parts.min() if p == -math.inf else parts.sum()


def clip_grad_norm_(module: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None
                    ) -> torch.Tensor:
    """Scale the gradients of ``module``'s parameters so that the whole model's gradient
    norm is at most ``max_norm``; returns that norm (before clipping, float64, the same on
    every rank). Collective: every rank calls it, with the same ``max_norm`` and
    ``norm_type`` (checked). ``foreach`` is accepted as torch's (the sums are per tensor
    here either way).

    The parameters of gpudist's layers are blocks: each element lives on one rank, and
    the ranks' parts add up. Any other parameter (a plain torch layer's) is taken as
    replicated: the same gradient on every rank (as after a data-parallel all-reduce),
    counted once; where those gradients differ between ranks, a MismatchError on every
    rank (clipping them would make the replicas diverge)."""
    if not isinstance(module, torch.nn.Module):  # (torch's takes parameters: it need not
        raise raised_everywhere(TypeError(        # know which are blocks)
            f"gpudist.nn.clip_grad_norm_ takes the model (a torch.nn.Module), not "
            f"{type(module).__name__}: it tells gpudist layers' parameter blocks from "
            f"replicated parameters by the modules holding them"))
    w = require_world(None)
    p = float(norm_type)
    if p == 0 or math.isnan(p):  # torch's order 0 counts whole tensors: blocks differ
        raise raised_everywhere(ValueError(
            f"gpudist.nn.clip_grad_norm_: norm_type {norm_type} is not supported (order 0 "
            f"counts torch's tensors, which a split model does not have); use another"))
    sharded = {id(q) for m in module.modules() if isinstance(m, ShardedParameters)
               for q in m.parameters()}
    params = [q for q in module.parameters() if q.grad is not None]
    mine = _part([q.grad for q in params if id(q) in sharded], p)
    replicated = _part([q.grad for q in params if id(q) not in sharded], p)
    some = sum(1 for q in params if q.grad.numel())  # (none anywhere: torch's 0)
    row = torch.cat([torch.stack([mine, replicated]),
                     torch.tensor([p, float(max_norm), some], dtype=torch.float64)])
    if w.size > 1:
        P = Partition.grid((w.size,))
        gather = AllGather(P, 0, 0)
        spec = TensorSpec(P, (5 * w.size,), torch.float64, w.device.type)
        row = gather(DistTensor(row.to(w.device), spec)).local
    rows = row.cpu().view(-1, 5).tolist()
    if len({(r[2], r[3]) for r in rows}) > 1:
        raise raised_everywhere(MismatchError(
            f"clip_grad_norm_: the ranks passed different (norm_type, max_norm): "
            f"{[(r[2], r[3]) for r in rows]}"))
    if not any(r[4] for r in rows):  # no gradient anywhere: torch's 0, nothing to scale
        return torch.zeros((), dtype=torch.float64)
    rep = [r[1] for r in rows]
    finite = all(math.isfinite(v) for v in rep)
    if (max(rep) - min(rep) > _REPLICA_RTOL * max(abs(v) for v in rep) if finite else
            len({str(v) for v in rep}) > 1):  # (inf or nan on some ranks only)
        raise raised_everywhere(MismatchError(
            f"clip_grad_norm_: the gradients of the parameters outside gpudist's layers "
            f"(taken as replicated) differ between ranks (their sum of |g|^p per rank: "
            f"{rep}); make them equal first (e.g. all-reduce them, as data parallelism "
            f"does)"))
    parts = _combine(torch.tensor([r[0] for r in rows] + [rep[0]], dtype=torch.float64), p)
    total = float(parts if math.isinf(p) else parts ** (1.0 / p))
    if error_if_nonfinite and not math.isfinite(total):
        raise raised_everywhere(RuntimeError(
            f"clip_grad_norm_: the total norm of order {p} of the gradients is non-finite "
            f"({total}), so it cannot be clipped (error_if_nonfinite=True)"))
    coef = min(float(max_norm) / (total + 1e-6), 1.0)
    with torch.no_grad():
        for q in params:
            q.grad.mul_(coef)
    return torch.tensor(total, dtype=torch.float64)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a model split over ranks: whether a gradient overflowed
    is agreed across the world (one all-reduce of one number per unscale, no host sync),
    so every rank skips or takes the step and changes its scale alike, as the sequential
    model's scaler does. torch's scaler on one rank sees that rank's blocks only: one rank
    would skip a step its peers take, and their scales would differ from then on.
    Collective where it unscales (``unscale_``, ``step``): every rank calls it."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        w = require_world(None)
        if w.size == 1:
            return per_device
        if not per_device:  # no gradient here: a rank's vote, and step() needs an entry
            per_device[found_inf.device] = torch.zeros_like(found_inf)
        mine = sum(v.to(w.device, torch.float32).reshape(1) for v in per_device.values())
        total = getattr(self, "_gpudist_sum", None)
        if total is None:  # world-collective, made once
            total = self._gpudist_sum = AllSumReduce(Partition.grid((w.size,)), axes=(0,))
        spec = TensorSpec(total.P, (1,), torch.float32, w.device.type, (PARTIAL,))
        anywhere = total(DistTensor(mine, spec)).local.clamp(max=1.0)
        for v in per_device.values():
            v.copy_(anywhere.reshape(()))
        return per_device

    def __getstate__(self):  # copies and pickles as torch's (the primitive made again)
        state = super().__getstate__()
        state.pop("_gpudist_sum", None)
        return state
