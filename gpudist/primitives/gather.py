"""AllGather and ReduceScatter along one partition axis: each other's adjoint.

Even blocks along a leading tensor dimension go straight between the caller's tensor and
the backend (``all_gather`` into the output, ``reduce_scatter`` out of the input: no extra
copy). Otherwise (uneven blocks, padded to the largest; blocks of an inner dimension;
group order differing from partition order) the blocks pass through one staging buffer
the plan keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..decomposition import block_range
from ..errors import ShapeError, raised_everywhere
from ..meta import derive_spec
from ..partition import Partition
from ..spec import PARTIAL, REPLICATE, TensorSpec
from . import ring
from .base import Plan, Primitive, steady_into

_CPU = torch.device("cpu")


class _Along(Primitive):
    """What AllGather and ReduceScatter share: the fiber along ``axis`` and its layout."""

    def __init__(self, P: Partition, axis: int, dim: int) -> None:
        self.P, self.axis, self.dim = P, axis % P.dim, dim
        super().__init__(P.world, P.ranks, (P.key, self.axis, dim))
        self.sub = P.sub([self.axis])  # world-collective
        self.in_partition = P
        g, tr = self.sub.group, P.world.transport
        # the two collectives, prepared once (the transport's leanest call for each)
        self._all_gather = tr.prepare("all_gather", g) if g is not None else None
        self._reduce_scatter_run = tr.prepare("reduce_scatter", g) if g is not None else None
        # slot j of the (ascending-rank) group holds partition position order[j]
        self.order = ([self.sub.ranks.index(r) for r in sorted(self.sub.ranks)]
                      if self.sub.active else [])

    def layout(self, full: TensorSpec) -> dict:
        """Block sizes along ``dim`` (partition order) for the tensor ``full`` (whole along
        ``dim``), and whether the fast path applies."""
        n, d = self.P.shape[self.axis], self.dim
        sizes = [block_range(full.global_shape[d], n, i)[1] - block_range(
            full.global_shape[d], n, i)[0] for i in range(n)]
        shape = full.local_shape
        direct = (len(set(sizes)) == 1 and math.prod(shape[:d]) == 1
                  and self.order == sorted(self.order))
        me = self.sub.index if self.sub.active else 0
        return {"sizes": sizes, "direct": direct, "me": me, "full": shape}

    def steady_gather(self, plan: Plan, given: TensorSpec, name: str, general: Callable
                      ) -> Callable | None:
        """:meth:`gather`'s steady form where the blocks go straight into the output
        (blocks of spec ``given`` in)."""
        lay = plan.local
        if not lay["direct"]:
            return None
        slot = self.buffers.slot(name, lay["full"], given.dtype, _CPU)
        return steady_into(plan, given.local_shape, slot, self._all_gather, general)

    def steady_scatter(self, plan: Plan, given: TensorSpec, name: str, general: Callable
                       ) -> Callable | None:
        """:meth:`scatter`'s steady form where the sum comes straight out of the input in
        one backend call (not the rings)."""
        lay, shape = plan.local, given.local_shape
        if not lay["direct"] or not ring.backend_sums(shape, given.dtype, self.sub.group):
            return None
        blk = list(shape)
        blk[self.dim] = lay["sizes"][lay["me"]]
        slot = self.buffers.slot(name, tuple(blk), given.dtype, _CPU)
        return steady_into(plan, shape, slot, self._reduce_scatter_run, general)

    def gather(self, x: torch.Tensor, plan: Plan, name: str) -> torch.Tensor:
        """Concatenate the fiber's blocks along ``dim`` (``x`` is this worker's block)."""
        lay = plan.local
        d, n = self.dim, len(lay["sizes"])
        out = self.buffer(plan, name, lay["full"], x)
        if lay["direct"]:
            self._all_gather(out, x.contiguous())
            return out
        m = max(lay["sizes"])
        blk = list(x.shape)
        blk[d] = m
        stage = self.buffer(plan, name + "-stage", (n, *blk), x)
        mine = self.buffer(plan, name + "-mine", tuple(blk), x)
        mine.narrow(d, 0, x.shape[d]).copy_(x)
        self._all_gather(stage, mine)
        at = 0
        starts = [sum(lay["sizes"][:i]) for i in range(n)]
        for j in range(n):
            i = self.order[j]
            k = lay["sizes"][i]
            out.narrow(d, starts[i], k).copy_(stage[j].narrow(d, 0, k))
            at += k
        return out

    def scatter(self, x: torch.Tensor, plan: Plan, name: str) -> torch.Tensor:
        """Sum ``x`` (whole along ``dim``) over the fiber and keep this worker's block."""
        lay = plan.local
        d, n = self.dim, len(lay["sizes"])
        sizes, me = lay["sizes"], lay["me"]
        blk = list(x.shape)
        blk[d] = sizes[me]
        if lay["direct"]:
            out = self.buffer(plan, name, tuple(blk), x)
            self._reduce_scatter(out, x.contiguous(), plan, name)
            return out
        m = max(sizes)
        pad = list(x.shape)
        pad[d] = m
        stage = self.buffer(plan, name + "-stage", (n, *pad), x)
        starts = [sum(sizes[:i]) for i in range(n)]
        for j in range(n):
            i = self.order[j]
            stage[j].narrow(d, 0, sizes[i]).copy_(x.narrow(d, starts[i], sizes[i]))
            if sizes[i] < m:
                stage[j].narrow(d, sizes[i], m - sizes[i]).zero_()
        mine = self.buffer(plan, name + "-mine", tuple(pad), x)
        self._reduce_scatter(mine, stage, plan, name)
        out = self.buffer(plan, name, tuple(blk), x)
        out.copy_(mine.narrow(d, 0, sizes[me]))
        return out

    def _reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, plan: Plan, name: str
                        ) -> None:
        """The backend's reduce-scatter, or the ring's for large host tensors
        (:mod:`gpudist.primitives.ring`)."""
        g = self.sub.group
        spare = (self.buffer(plan, name + "-spare", out.shape, out)
                 if ring.needs_spare(x, g) else None)
        ring.reduce_scatter(self.world.transport, out, x, g, spare,
                            self.tag + (name == "adjoint"), self._reduce_scatter_run)


class AllGather(_Along):
    """F: concatenate the blocks along partition ``axis`` (tensor dim ``dim``) on every
    worker of that axis. F*: ReduceScatter."""

    name = "AllGather"

    def out_spec(self, spec: TensorSpec) -> TensorSpec:
        p = spec.placements[self.axis]
        if p not in (self.dim, REPLICATE) or (p == REPLICATE and self.P.shape[self.axis] > 1):
            raise raised_everywhere(ShapeError(
                f"AllGather along partition axis {self.axis}: the tensor must be split "
                f"along tensor dim {self.dim} there (placements {spec.placements})"))
        pl = list(spec.placements)
        pl[self.axis] = REPLICATE
        return spec.replace(placements=tuple(pl))

    def make_plan(self, spec, out):
        return self.layout(out), self.sub.group is None

    def steady(self, plan: Plan):
        return (self.steady_gather(plan, plan.spec, "out", self.forward),
                self.steady_scatter(plan, plan.out, "adjoint", self.adjoint))

    def forward(self, x, plan: Plan):
        return self.gather(x, plan, "out")

    def adjoint(self, dy, plan: Plan):
        return self.scatter(dy, plan, "adjoint")


class ReduceScatter(_Along):
    """F: sum the (equal-shaped) tensors along partition ``axis`` and keep this worker's
    block of tensor dim ``dim``. F*: AllGather."""

    sums = True

    name = "ReduceScatter"

    def derive(self, x):
        pl = [PARTIAL if i == self.axis else i for i in range(self.P.dim)]
        return derive_spec(self.P, x, self.name, self.group, pl, self.config)

    def out_spec(self, spec: TensorSpec) -> TensorSpec:
        pl = list(spec.placements)
        if pl[self.axis] >= 0 or self.dim in pl:
            raise raised_everywhere(ShapeError(
                f"ReduceScatter along partition axis {self.axis} into tensor dim {self.dim}: "
                f"the input must hold summands or copies along that axis and be whole along "
                f"dim {self.dim} (placements {spec.placements})"))
        pl[self.axis] = self.dim
        return spec.replace(placements=tuple(pl))

    def make_plan(self, spec, out):
        return self.layout(spec), self.sub.group is None

    def steady(self, plan: Plan):
        return (self.steady_scatter(plan, plan.spec, "out", self.forward),
                self.steady_gather(plan, plan.out, "adjoint", self.adjoint))

    def forward(self, x, plan: Plan):
        return self.scatter(x, plan, "out")

    def adjoint(self, dy, plan: Plan):
        return self.gather(dy, plan, "adjoint")
