"""Where parameters live: a global tensor's block on this rank, or zero-volume."""

from __future__ import annotations

import torch

from ..decomposition import Decomposition
from ..partition import Partition


def block(t: torch.Tensor, P: Partition) -> torch.Tensor:
    """This rank's block of the global tensor ``t`` under ``P`` (zero-volume if inactive)."""
    if not P.active:
        return t.new_zeros((0,) * t.dim())
    sl = Decomposition(tuple(t.shape), P.shape).global_slices(P.coords)
    return t[sl].detach().clone()


def parameter(t: torch.Tensor | None, like: torch.Tensor, ndim: int) -> torch.nn.Parameter:
    """A Parameter holding ``t``, or a zero-volume one (so every rank has the same names)."""
    if t is None:
        t = like.new_zeros((0,) * ndim)
    return torch.nn.Parameter(t.detach().clone())


def connect(t: torch.Tensor, *others: torch.Tensor | None) -> torch.Tensor:
    """``t`` plus 0 x each (zero-volume) tensor in ``others``.

    Keeps their producers in this rank's backward graph: autograd prunes nodes the requested
    gradients do not reach, and a rank that skipped the adjoint of a collective would leave
    its peers waiting.
    """
    for o in others:
        if o is not None and o.requires_grad:
            t = t + o.sum() * 0
    return t
