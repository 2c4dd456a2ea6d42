"""AllSumReduce over chosen partition axes: self-adjoint."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ShapeError, raised_everywhere
from ..meta import derive_spec
from ..partition import Partition
from ..spec import PARTIAL, REPLICATE, TensorSpec
from . import ring
from .base import Plan, Primitive, steady_into

_CPU = torch.device("cpu")


class AllSumReduce(Primitive):
    """F: every worker gets the sum of the blocks of the workers that share its coordinates
    off ``axes`` (summands along ``axes``, whole copies after). F* = F."""

    sums = True

    name = "AllSumReduce"

    def __init__(self, P: Partition, axes: Sequence[int]) -> None:
        self.P, self.axes = P, tuple(sorted({int(a) % P.dim for a in axes}))
        super().__init__(P.world, P.ranks, (P.key, self.axes))
        self.sub = P.sub(self.axes)  # world-collective
        self.in_partition = P
        g = self.sub.group
        self._backend = P.world.transport.prepare("all_reduce", g) if g is not None else None

    def derive(self, x):
        P, axes = self.P, self.axes  # (blocks of another rank: opaque summands)
        return derive_spec(P, x, self.name, self.group,
                           lambda nd: [PARTIAL if (i in axes or nd != P.dim) else i
                                       for i in range(P.dim)], self.config)

    def out_spec(self, spec: TensorSpec) -> TensorSpec:
        pl = list(spec.placements)
        for a in self.axes:
            if pl[a] >= 0:
                raise raised_everywhere(ShapeError(
                    f"AllSumReduce: partition axis {a} is summed but the tensor is split "
                    f"along it (tensor dim {pl[a]}): blocks of different parts cannot be "
                    f"added"))
            pl[a] = REPLICATE
        return spec.replace(placements=tuple(pl))

    def make_plan(self, spec, out):
        return None, self.sub.group is None

    def _sum(self, x, plan: Plan, name: str):
        y = self.buffer(plan, name, x.shape, x)
        ring.all_reduce(self.world.transport, y, x.contiguous(), self.sub.group,
                        self.tag + (name == "adjoint"), self._backend)
        return y

    def steady(self, plan: Plan):
        shape, dt = plan.spec.local_shape, plan.spec.dtype
        if not ring.backend_sums(shape, dt, self.sub.group):
            return None, None
        return tuple(steady_into(plan, shape, self.buffers.slot(name, shape, dt, _CPU),
                                 self._backend, general)
                     for name, general in (("out", self.forward), ("adjoint", self.adjoint)))

    def forward(self, x, plan: Plan):
        return self._sum(x, plan, "out")

    def adjoint(self, dy, plan: Plan):
        return self._sum(dy, plan, "adjoint")
