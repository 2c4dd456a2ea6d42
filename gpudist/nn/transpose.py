"""Distributed transpose: a tensor split along one dim becomes split along another.

The building block of distributed FFTs (pencil/slab decompositions): with ``x`` split along
dim ``a`` (dim ``b`` whole on every worker), a local FFT along ``b``; then the transpose
makes ``b`` split and ``a`` whole, and a local FFT along ``a`` follows.

``DistributedTranspose(P_in, P_out)`` is the :class:`~gpudist.primitives.Repartition`
between two partitions of the same ranks, usually ``P_out = transposed_partition(P_in, a,
b)``:

* forward ``F``: one all-to-all(v) over those ranks; worker ``r`` sends the part of its
  block that worker ``s``'s output block covers (blocks split the standard way, balanced,
  remainder to the lowest indices);
* adjoint ``F*``: the reverse all-to-all (``F`` only permutes entries: ``F* = F^-1``).

It is not a transpose of the tensor's dims: the global tensor is unchanged, only the
partition it is split by changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import Plan, Repartition
from ..spec import TensorSpec
from ._layer import DistributedModule


def transposed_partition(P: Partition, a: int, b: int) -> Partition:
    """The partner of ``P``: the same ranks, the extents of axes ``a`` and ``b`` swapped.

    The worker at coordinates ``c`` of ``P`` sits at ``c`` with entries ``a`` and ``b``
    swapped. E.g. ``(4, 1)`` (rows split) -> ``(1, 4)`` (columns split). Collective over
    the world, like every partition construction.
    """
    a, b = a % P.dim, b % P.dim
    shape = list(P.shape)
    shape[a], shape[b] = shape[b], shape[a]
    ranks = []
    for c in np.ndindex(*shape):
        c = list(c)
        c[a], c[b] = c[b], c[a]
        ranks.append(P.world_rank_of(c))
    return Partition(ranks, shape, P.world)


@dataclass
class _TransposePlan:
    out: TensorSpec
    move: Plan


class DistributedTranspose(DistributedModule):
    """Move a tensor split by ``P_in`` to the same tensor split by ``P_out`` (the same
    ranks): forward an all-to-all, adjoint the reverse all-to-all (see the module
    docstring). Any dtype, complex included; no parameters."""

    def __init__(self, P_in: Partition, P_out: Partition) -> None:
        super().__init__()
        if P_in.dim != P_out.dim:
            raise raised_everywhere(PartitionError(
                f"DistributedTranspose: partitions {P_in.shape} and {P_out.shape} have "
                f"different numbers of dimensions"))
        if sorted(P_in.ranks) != sorted(P_out.ranks):
            raise raised_everywhere(PartitionError(
                f"DistributedTranspose: P_in (ranks {list(P_in.ranks)}) and P_out (ranks "
                f"{list(P_out.ranks)}) must hold the same ranks; use Repartition to move a "
                f"tensor between different sets of workers"))
        self.P_in, self.P_out = P_in, P_out
        self.setup(P_in, P_in.ranks)
        self.move = Repartition(P_in, P_out)

    def make_plan(self, spec: TensorSpec) -> _TransposePlan:
        if not spec.standard:
            raise raised_everywhere(ShapeError(
                f"DistributedTranspose: expected a tensor split the standard way over "
                f"{self.P_in.shape}, got {spec.describe()}"))
        p = self.move.plan(spec)
        return _TransposePlan(p.out, p)

    def run(self, x, plan: _TransposePlan):
        return self.move.apply_plan(x, plan.move)

    def extra_repr(self) -> str:
        return f"P_in={self.P_in.shape}, P_out={self.P_out.shape}"
