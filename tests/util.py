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


def gather(t: torch.Tensor, P: Partition, gshape, root: Partition | None = None):
    """The global tensor whose block ``t`` is (this rank's block over ``P``) on the root
    worker (P's first), zero-volume elsewhere; returns (tensor, root partition)."""
    from gpudist import DistTensor
    from gpudist.primitives import Repartition

    root = root or Partition([P.ranks[0]], (1,) * P.dim)
    x = DistTensor.from_local(t.detach(), P, tuple(gshape))
    return Repartition(P, root)(x).local, root


def maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0
