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
