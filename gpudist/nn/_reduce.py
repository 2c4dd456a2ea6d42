"""Small helpers for layers that sum statistics over a partition."""

from __future__ import annotations

import torch

from ..partition import Partition


def count_over(P: Partition, n: int, device: torch.device) -> int:
    """Sum of the integer ``n`` over the members of ``P`` (collective over P)."""
    if P.group is None:
        return n
    w = P.world
    dev = device if w.backend == "nccl" else torch.device("cpu")
    t = torch.tensor([n], dtype=torch.int64, device=dev)
    w.transport.all_reduce(t, P.group).wait(w.timeout)
    return int(t.item())
