"""Helpers shared by multi-rank tests (run inside rank pools)."""

import torch

from gpudist import Decomposition, Partition
from gpudist.primitives import zero_volume


def global_tensor(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def block_of(G: torch.Tensor, P: Partition) -> torch.Tensor:
    """This rank's block of the global tensor G under P (zero-volume if inactive)."""
    if not P.active:
        return zero_volume(G.dim(), like=G)
    sl = Decomposition(tuple(G.shape), P.shape).global_slices(P.coords)
    return G[sl].clone()
