"""ZeRO storage: each model-parallel block of a parameter cut into chunks over the workers
that share it (its *fibre*), all-gathered on use; the adjoint reduce-scatters the
gradients. Used by the ``*Zero`` layers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..decomposition import Decomposition, block_range
from ..partition import Partition
from ..primitives import AllGather, Plan, Repartition
from ..spec import DistTensor, TensorSpec
from ._layer import ShardedParameters


class ZeroShards:
    """ZeRO storage of parameters whose model-parallel blocks are split by axes of ``P``.

    ``split`` maps partition axes of ``P`` to the parameter dims they split (in increasing
    order); the other axes are replica axes. A *fibre* is the set of workers that share
    their coordinates on the split axes: they all need the same block of the parameter.
    Each fibre's block, flattened in C order, is cut into balanced chunks over the fibre's
    ``A`` workers (C order of their replica coordinates); worker ``r`` keeps chunk ``r``,
    so the partition holds every entry exactly once.

    Use: ``gather`` (AllGather within the fibre) gives the block; its adjoint, a
    ReduceScatter, sums the fibre's block gradients and keeps this worker's chunk.
    Construction is collective over the world (one AllGather per fibre, in order).
    """

    def __init__(self, P: Partition, split: dict[int, int], shape: Sequence[int]) -> None:
        self.P, self.shape = P, tuple(int(s) for s in shape)
        self.split = dict(split)
        model = sorted(split)
        assert [split[a] for a in model] == sorted(split.values()), split
        replica = [a for a in range(P.dim) if a not in split]
        pshape = [1] * len(self.shape)
        for a in model:
            pshape[split[a]] = P.shape[a]
        self.param_shape = tuple(pshape)  # the model-parallel partition of the parameter
        self.decomp = Decomposition(self.shape, self.param_shape)
        rext = [P.shape[a] for a in replica]
        self.A = math.prod(rext)
        self.gathers: list[AllGather] = []
        heads, mine = [], None
        for mc in np.ndindex(*[P.shape[a] for a in model]):  # same order on every rank
            members = []
            for rc in np.ndindex(*rext):
                c = [0] * P.dim
                for a, v in zip(model, mc):
                    c[a] = v
                for a, v in zip(replica, rc):
                    c[a] = v
                members.append(P.world_rank_of(c))
            fibre = Partition(members, (self.A,), P.world)
            self.gathers.append(AllGather(fibre, 0, 0))
            heads.append(members[0])
            if fibre.active:
                mine = (len(self.gathers) - 1, fibre.index, mc)
        # the first worker of every fibre, laid out like the parameter's blocks
        self.P_head = Partition(heads, self.param_shape, P.world)
        self.root = Partition([heads[0]], (1,) * len(self.shape), P.world)
        self.collect = Repartition(self.P_head, self.root)
        self.active = mine is not None
        if mine is None:
            self.gather_op, self.r = None, -1
            self.block_shape, self.lo, self.hi = (0,) * len(self.shape), 0, 0
            self.slices = None
            return
        f, self.r, mc = mine
        self.gather_op = self.gathers[f]
        pc = [0] * len(self.shape)
        for a, v in zip(model, mc):
            pc[split[a]] = v
        self.slices = self.decomp.global_slices(pc)
        self.block_shape = self.decomp.local_shape(pc)
        self.numel = math.prod(self.block_shape)
        self.lo, self.hi = block_range(self.numel, self.A, self.r)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This worker's chunk of the global tensor ``t`` (1-D; empty off ``P``)."""
        if not self.active:
            return t.new_zeros(0)
        return t[self.slices].reshape(-1)[self.lo:self.hi].detach().clone()

    def plan(self, dtype: torch.dtype, device_type: str) -> Plan | None:
        """The plan of this worker's fibre AllGather (None off ``P``)."""
        if not self.active:
            return None
        op = self.gather_op
        return op.plan(TensorSpec(op.P, (self.numel,), dtype, device_type))

    def gather(self, shard: torch.Tensor, plan: Plan) -> torch.Tensor:
        """F: the fibre's block (shape ``block_shape``) from the chunks; F*: ReduceScatter."""
        return self.gather_op.apply_plan(shard, plan).view(self.block_shape)

    def to_root(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Collective, no autograd: the whole parameter on the root worker, None elsewhere."""
        with torch.no_grad():
            blk = None
            if self.active:
                blk = self.gather(shard.detach(), self.plan(shard.dtype, shard.device.type))
            loc = blk if self.P_head.active else shard.new_zeros((0,) * len(self.shape))
            spec = TensorSpec(self.P_head, self.shape, shard.dtype, shard.device.type)
            out = self.collect(DistTensor(loc.contiguous(), spec))
        return out.local.clone() if self.root.active else None


class ZeroParameters(ShardedParameters):
    """Global state dicts of parameters stored by :class:`ZeroShards`: ``self.shards``
    maps each parameter name to its store (one shared store, or one per parameter when
    their shapes or splits differ)."""

    shards: dict[str, ZeroShards]

    def _setup_zero(self, zero: ZeroShards, names: Sequence[str]) -> None:
        """One store for every parameter in ``names`` (they have the same shape)."""
        self.zero = zero
        self._setup_shards({k: zero for k in names}, zero.root)

    def _setup_shards(self, shards: dict[str, ZeroShards], root: Partition | None = None
                      ) -> None:
        self.shards = dict(shards)
        self.root = root if root is not None else next(iter(self.shards.values())).root
        # for the layout stamp of per-rank checkpoints: blocks as the fibres' heads see them
        self.homes = {k: (z.P_head, z.shape) for k, z in self.shards.items()}

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return self.shards[name].shard(t)  # this worker's chunk

    def _gathered(self, pick, name: str) -> dict[str, torch.Tensor]:
        self._same_layer(f"{type(self).__name__}.{name}")
        out = {}
        for k, z in self.shards.items():
            v = z.to_root(pick(getattr(self, k)))
            if v is not None:
                out[k] = v
        return out

    def layout(self) -> dict:
        out = super().layout()
        out["zero"] = {k: {"partition": [list(z.P.ranks), list(z.P.shape)],
                           "split": [[a, d] for a, d in sorted(z.split.items())],
                           "fibre_workers": z.A, "chunk": z.r, "range": [z.lo, z.hi]}
                       for k, z in self.shards.items()}
        return out
