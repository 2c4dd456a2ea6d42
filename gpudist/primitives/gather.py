"""AllGather and ReduceScatter along one partition axis: each other's adjoint.

Blocks may be uneven along the gathered tensor dimension; they are padded to the largest
block for the collective and trimmed after.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..partition import Partition
from .base import Primitive, PrimitiveModule, gather_meta


class _Along:
    """The workers along partition ``axis`` through this rank, in partition order."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        self.P, self.axis, self.dim = P, axis % P.dim, dim
        self.sub = P.sub([self.axis])
        self.group = self.sub.group
        if self.sub.active:
            # slot j of the (ascending-rank) group holds partition position order[j]
            self.order = [self.sub.ranks.index(r) for r in sorted(self.sub.ranks)]

    def sizes(self, x: torch.Tensor) -> list[int]:
        """Block sizes along ``dim`` in partition order (checks other dims agree)."""
        metas = gather_meta(self.P.world, self.group, x, True)
        shapes = [None] * len(metas)
        for j, m in enumerate(metas):
            shapes[self.order[j]] = m[3]
        others = {tuple(s[:self.dim] + s[self.dim + 1:]) for s in shapes}
        if len(others) > 1:
            raise ShapeError(f"AllGather along axis {self.axis}: blocks differ outside "
                             f"dimension {self.dim}: {shapes}")
        return [s[self.dim] for s in shapes]

    def exchange(self, x: torch.Tensor, sizes: list[int], reduce: bool) -> torch.Tensor:
        """Gather (``reduce=False``) or reduce-scatter the padded blocks."""
        n, d, m = len(sizes), self.dim, max(sizes)
        tr, me = self.P.world.transport, self.sub.rank
        if not reduce:
            pad = [0, 0] * (x.dim() - d - 1) + [0, m - x.shape[d]]
            xp = torch.nn.functional.pad(x, pad).movedim(d, 0).contiguous()
            out = torch.empty((n,) + tuple(xp.shape), dtype=x.dtype, device=x.device)
            tr.all_gather(out.view(-1), xp.view(-1), self.group).wait(self.P.world.timeout)
            blocks = [out[j][: sizes[self.order[j]]] for j in range(n)]
            ordered = [None] * n
            for j, b in enumerate(blocks):
                ordered[self.order[j]] = b
            return torch.cat(ordered, 0).movedim(0, d).contiguous()
        # reduce-scatter as all-reduce + slice (transport has no reduce_scatter primitive)
        y = x.contiguous().clone()
        tr.all_reduce(y, self.group).wait(self.P.world.timeout)
        lo = sum(sizes[:me])
        return y.narrow(d, lo, sizes[me]).contiguous()


class AllGatherOp(Primitive):
    """F: concatenate the blocks along partition ``axis`` (tensor dim ``dim``) on every
    worker of that axis. F*: ReduceScatter."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        self.along = _Along(P, axis, dim)

    def forward(self, x):
        a = self.along
        if not a.sub.active:
            return x, None
        if a.group is None:
            return x, [x.shape[a.dim]]
        sizes = a.sizes(x)
        return a.exchange(x.contiguous(), sizes, reduce=False), sizes

    def adjoint(self, dy, sizes):
        a = self.along
        if not a.sub.active or a.group is None:
            return dy
        return a.exchange(dy, sizes, reduce=True)


class ReduceScatterOp(Primitive):
    """F: sum the (equal-shaped) tensors along partition ``axis`` and keep this worker's
    block of tensor dim ``dim``. F*: AllGather."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        self.along = _Along(P, axis, dim)

    def forward(self, x):
        a = self.along
        if not a.sub.active:
            return x, None
        n = a.sub.size
        q, r = divmod(x.shape[a.dim], n)
        sizes = [q + (1 if i < r else 0) for i in range(n)]
        if a.group is None:
            return x, sizes
        return a.exchange(x, sizes, reduce=True), sizes

    def adjoint(self, dy, sizes):
        a = self.along
        if not a.sub.active or a.group is None:
            return dy
        return a.exchange(dy.contiguous(), sizes, reduce=False)


class AllGather(PrimitiveModule):
    """Gather blocks along partition ``axis`` into tensor dim ``dim``; adjoint ReduceScatter."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        super().__init__()
        self.op = AllGatherOp(P, axis, dim)


class ReduceScatter(PrimitiveModule):
    """Sum along partition ``axis``, scatter tensor dim ``dim``; adjoint AllGather."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        super().__init__()
        self.op = ReduceScatterOp(P, axis, dim)
