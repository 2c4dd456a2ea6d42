"""Distributed embedding: the vocabulary and/or the embedding dim partitioned.

Partitions: the work partition ``P = (P_0, .., P_{n-1}, P_v, P_d)``: ``n`` axes split the
index tensor (data parallelism), ``P_v`` the vocabulary (rows of the weight), ``P_d`` the
embedding dim (its columns). The indices (an integer tensor of ``n`` dims) come on
``P_x = (P_0, .., P_{n-1})`` (default: P's workers at v = d = 0), the output (``n + 1`` dims,
the last one ``embedding_dim``) goes to ``P_y = (P_0, .., P_{n-1}, P_d)`` (default: P's
workers at v = 0).

Forward::

    i^ <- B[P_x -> P] i          every worker of a (v, d) block sees its indices
    W^ <- B[P_home -> P] W       the (v, d) block of W (ZeRO: AllGather within the fibre)
    y^ = embedding(i^ - v0, W^), zero where i^ is outside [v0, v1)   (partial sums over v)
    y  <- R[P -> P_y] y^         SumReduce over the vocabulary blocks

Adjoint (by autograd): Broadcast ``dy`` back over v; the lookup's adjoint (dy added into
the rows looked up, nothing at ``padding_idx`` or outside the block); SumReduce of the
block gradients over the index axes into the home block (ZeRO: ReduceScatter). Indices
carry no gradient.

``max_norm`` and ``scale_grad_by_freq`` need per-row facts of the whole batch: one
AllSumReduce over the index and embedding axes of (count of each row in the indices,
``sum |W_row|^p`` of the stored entries) per call; rows looked up with a norm above
``max_norm`` are rescaled in place where they are stored (as torch does), and the row
gradients are divided by the global counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..decomposition import block_range
from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import AllSumReduce, Broadcast, Plan, SumReduce
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, ShardedParameters
from ._params import block, connect, parameter
from ._zero import ZeroParameters, ZeroShards

R, P_ = REPLICATE, PARTIAL


@dataclass
class _EmbPlan:
    out: TensorSpec
    idx: Plan
    weight: Plan | None
    y: Plan
    stats: Plan | None


class _Embedding(DistributedModule):
    """What both embeddings share (the weight's placement differs: ``_place``)."""

    same_dtype_as_parameters = False  # the input is indices
    floating_input = False

    def __init__(self, P: Partition, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, *, P_x: Partition | None = None,
                 P_y: Partition | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        seq = self._build(P, num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                          scale_grad_by_freq, sparse, P_x, P_y, dtype, device)
        self._place(seq)

    def _place(self, seq: torch.nn.Embedding) -> None:
        """Keep this worker's part of the sequential layer's weight."""
        raise NotImplementedError

    def _build(self, P: Partition, num_embeddings: int, embedding_dim: int, padding_idx,
               max_norm, norm_type: float, scale_grad_by_freq: bool, sparse: bool,
               P_x: Partition | None, P_y: Partition | None, dtype, device
               ) -> torch.nn.Embedding:
        name = type(self).__name__
        if P.dim < 3:
            raise raised_everywhere(PartitionError(
                f"{name}: the work partition needs (index dims..., vocabulary, embedding) "
                f"axes, at least 3; got {P.shape}"))
        n = P.dim - 2
        pv, pd = P.shape[n], P.shape[n + 1]
        if num_embeddings < pv or embedding_dim < pd:
            raise raised_everywhere(PartitionError(
                f"{name}: a {num_embeddings} x {embedding_dim} weight cannot be split into "
                f"{pv} x {pd} blocks (partition {P.shape})"))
        if sparse:
            raise raised_everywhere(ValueError(
                f"{name}: sparse=True is not supported (the weight gradient is summed over "
                f"workers by dense collectives)"))
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise raised_everywhere(ValueError(
                    f"{name}: padding_idx must be within num_embeddings ({num_embeddings}), "
                    f"got {padding_idx}"))
            padding_idx %= num_embeddings
        if max_norm is not None and not (0 < norm_type < math.inf):
            raise raised_everywhere(ValueError(
                f"{name}: max_norm needs a finite positive norm_type, got {norm_type}"))
        PI = P.shape[:n]
        if P_x is None:
            P_x = Partition([P.world_rank_of(c + (0, 0)) for c in np.ndindex(*PI)], PI,
                            P.world)
        if P_y is None:
            P_y = Partition([P.world_rank_of(c[:n] + (0,) + c[n:])
                             for c in np.ndindex(*PI, pd)], PI + (pd,), P.world)
        if P_x.shape != PI or P_y.shape != PI + (pd,):
            raise raised_everywhere(PartitionError(
                f"{name}: work partition {P.shape} needs the indices on a partition of shape "
                f"{PI} and the output on {PI + (pd,)}; got {P_x.shape} and {P_y.shape}"))
        self.P, self.P_x, self.P_y, self.n = P, P_x, P_y, n
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.setup(P_x, set(P.ranks) | set(P_x.ranks) | set(P_y.ranks))
        dev = device if device is not None else P.world.device
        seq = torch.nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype,
                                 device=dev)
        self.idx_bcast = Broadcast(P_x.reshape(PI + (1, 1)), P)
        self.y_reduce = SumReduce(P, P_y.reshape(PI + (1, pd)))
        self.row_stats = None
        if max_norm is not None or scale_grad_by_freq:
            self.row_stats = AllSumReduce(P, list(range(n)) + [n + 1])
        # my vocabulary and column blocks
        self.v0 = self.v1 = self.cols = 0
        if P.active:
            self.v0, self.v1 = block_range(num_embeddings, pv, P.coords[n])
            c0, c1 = block_range(embedding_dim, pd, P.coords[n + 1])
            self.cols = c1 - c0
        self.pad_local = None
        if padding_idx is not None and self.v0 <= padding_idx < self.v1:
            self.pad_local = padding_idx - self.v0
        return seq

    # -- plans ------------------------------------------------------------------------
    def make_plan(self, spec: TensorSpec) -> _EmbPlan:
        n, P = self.n, self.P
        if not spec.standard or spec.ndim != n or spec.dtype not in (torch.int64, torch.int32):
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected int64/int32 indices of {n} dimension(s) split the "
                f"standard way over partition {self.P_x.shape}, got {spec.describe()}"))
        g, dev = spec.global_shape, spec.device_type
        wdt = self.weight.dtype
        idx = TensorSpec(self.idx_bcast.P_src, g, spec.dtype, dev, tuple(range(n)) + (R, R))
        y = g + (self.embedding_dim,)
        partial = TensorSpec(P, y, wdt, dev, tuple(range(n)) + (P_, n))
        stats = None
        if self.row_stats is not None:
            stats = self.row_stats.plan(TensorSpec(P, (2, self.num_embeddings), torch.float64,
                                                   dev, (P_,) * n + (1, P_)))
        return _EmbPlan(TensorSpec(self.P_y, y, wdt, dev), self.idx_bcast.plan(idx),
                        self.weight_plan(dev), self.y_reduce.plan(partial), stats)

    def weight_plan(self, device_type: str) -> Plan | None:
        raise NotImplementedError

    def weight_block(self, plan: _EmbPlan) -> torch.Tensor:
        """This worker's (v, d) block of the weight (zero-volume off ``P``)."""
        raise NotImplementedError

    def stored_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored weight entries (flat) and the row of the block each belongs to."""
        raise NotImplementedError

    # -- forward ----------------------------------------------------------------------
    def run(self, idx: torch.Tensor, plan: _EmbPlan) -> torch.Tensor:
        n, P = self.n, self.P
        self._check_range(idx)
        iw = self.idx_bcast.apply_plan(idx, plan.idx)
        li, inside = iw, None
        nb = self.v1 - self.v0
        if P.active and P.shape[n] > 1:  # indices of my vocabulary block; others masked
            inside = (iw >= self.v0) & (iw < self.v1)
            # indices outside the vocabulary (only on CUDA, unchecked: see _check_range) stay
            # out of range: the lookup raises as torch's
            keep = inside | (iw < 0) | (iw >= self.num_embeddings)
            li = torch.where(keep, iw - self.v0, torch.zeros_like(iw))
        inv = None
        if plan.stats is not None and P.active:
            inv = self._row_stats(iw - self.v0, plan.stats, nb)
        w = self.weight_block(plan)
        if not P.active:
            e = connect(w.new_zeros(plan.y.spec.local_shape), w)
            return self.y_reduce.apply_plan(e, plan.y)
        if inv is not None:
            w = _RowGradScale.apply(w, inv)
        e = F.embedding(li, w, self.pad_local)
        if inside is not None:
            e = e * inside.unsqueeze(-1).to(e.dtype)
        return self.y_reduce.apply_plan(e, plan.y)

    def _check_range(self, idx: torch.Tensor) -> None:
        """An index outside ``[0, num_embeddings)`` in this rank's block: an IndexError
        naming it, raised here before the indices move (posted to the world: the layer's
        other ranks raise a RemoteError carrying it). torch raised it after the broadcast
        on the ranks holding the index, with no name of the layer. On CUDA the check is
        left to torch's device-side assert (it would synchronise with the host)."""
        if not idx.numel() or idx.is_cuda:
            return
        lo, hi = torch.aminmax(idx)
        if lo < 0 or hi >= self.num_embeddings:
            bad = int(lo) if lo < 0 else int(hi)
            raise IndexError(
                f"{self.name}: index {bad} is out of range for {self.num_embeddings} "
                f"embeddings (valid: 0 to {self.num_embeddings - 1}), in rank "
                f"{self.P.world.rank}'s block of the indices")

    def _row_stats(self, li: torch.Tensor, plan: Plan, nb: int) -> torch.Tensor | None:
        """``li``: the indices relative to my block's first row (outside ``[0, nb)``: rows
        of other blocks). Global counts of my block's rows in the indices; renormalizes the
        stored rows looked up whose norm exceeds ``max_norm``. Returns 1/count (0 where unused) if
        ``scale_grad_by_freq``."""
        P, n = self.P, self.n
        f64 = torch.float64
        loc = torch.zeros(2, nb, dtype=f64, device=self.weight.device)
        renorm = self.max_norm is not None
        stored, rows = self.stored_rows() if renorm else (None, None)
        if P.active and P.coords[n + 1] == 0:  # one column block counts the indices
            ok = (li >= 0) & (li < nb)
            bucket = torch.where(ok, li, torch.full_like(li, nb)).reshape(-1)
            cnt = torch.zeros(nb + 1, dtype=f64, device=loc.device)
            cnt.index_add_(0, bucket, torch.ones(bucket.shape, dtype=f64, device=loc.device))
            loc[0] = cnt[:nb]
        p = float(self.norm_type)
        if renorm and stored.numel():
            loc[1].index_add_(0, rows, stored.detach().abs().to(f64).pow(p))
        tot = self.row_stats.apply_plan(loc, plan)
        count = tot[0]
        if renorm and stored.numel():
            norm = tot[1].pow(1.0 / p)
            scale = torch.where((count > 0) & (norm > self.max_norm),
                                self.max_norm / (norm + 1e-7), torch.ones_like(norm))
            with torch.no_grad():
                stored.mul_(scale[rows].to(stored.dtype))
        if not self.scale_grad_by_freq:
            return None
        return torch.where(count > 0, 1.0 / count.clamp_min(1), torch.zeros_like(count))

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, partition={self.P.shape}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}, norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s


class _RowGradScale(torch.autograd.Function):
    """Identity on the weight block; its adjoint scales row j of the gradient by
    ``inv[j]`` (torch's ``scale_grad_by_freq`` with counts over the whole batch)."""

    @staticmethod
    def forward(ctx, w, inv):  # type: ignore[override]
        ctx.save_for_backward(inv)
        return w.view_as(w)

    @staticmethod
    @once_differentiable  # a double backward raises torch's clear error, never a wrong one
    def backward(ctx, g):  # type: ignore[override]
        (inv,) = ctx.saved_tensors
        return g * inv.to(g.dtype)[:, None], None


class DistributedEmbedding(ShardedParameters, _Embedding):
    """``torch.nn.Embedding`` with the weight split in (vocabulary, embedding dim) blocks
    over the last two axes of the work partition ``P`` (see the module docstring).

    The blocks live on P's workers at index coordinates 0 and are broadcast over the index
    axes on use (adjoint: SumReduce of the gradients). Initialized like the torch layer
    from the current RNG state. ``sparse=True`` is not supported.
    """

    def _place(self, seq: torch.nn.Embedding) -> None:
        P, n = self.P, self.n
        num_embeddings, embedding_dim = self.num_embeddings, self.embedding_dim
        pv, pd = P.shape[n], P.shape[n + 1]
        self.P_home = Partition([P.world_rank_of((0,) * n + c) for c in np.ndindex(pv, pd)],
                                (pv, pd), P.world)
        self.root = Partition([self.P_home.ranks[0]], (1, 1), P.world)
        self.weight = parameter(block(seq.weight, self.P_home), seq.weight, 2)
        self.homes = {"weight": (self.P_home, (num_embeddings, embedding_dim))}
        self.P_src = self.P_home.reshape((1,) * n + (pv, pd))
        self.w_bcast = Broadcast(self.P_src, P)

    def weight_plan(self, device_type: str) -> Plan:
        return self.w_bcast.plan(TensorSpec(
            self.P_src, (self.num_embeddings, self.embedding_dim), self.weight.dtype,
            device_type, (R,) * self.n + (0, 1)))

    def weight_block(self, plan: _EmbPlan) -> torch.Tensor:
        return self.w_bcast.apply_plan(self.weight, plan.weight)

    def stored_rows(self):
        w = self.weight
        if not self.P_home.active:
            return w.view(-1), torch.zeros(0, dtype=torch.long, device=w.device)
        rows = torch.arange(w.shape[0], device=w.device).repeat_interleave(w.shape[1])
        return w.view(-1), rows


class DistributedEmbeddingZero(ZeroParameters, _Embedding):
    """``torch.nn.Embedding`` as :class:`DistributedEmbedding`, the weight sharded
    ZeRO-style over the whole partition: each (v, d) block is cut into chunks over the
    workers of its index fibre, all-gathered within the fibre on use (adjoint:
    ReduceScatter of the block gradients)."""

    def _place(self, seq: torch.nn.Embedding) -> None:
        n = self.n
        zero = ZeroShards(self.P, {n: 0, n + 1: 1}, (self.num_embeddings, self.embedding_dim))
        self.weight = torch.nn.Parameter(zero.shard(seq.weight))
        self._setup_zero(zero, ("weight",))

    def weight_plan(self, device_type: str) -> Plan | None:
        return self.zero.plan(self.weight.dtype, device_type)

    def weight_block(self, plan: _EmbPlan) -> torch.Tensor:
        if not self.zero.active:
            return connect(self.weight.new_zeros(0, 0), self.weight)
        return self.zero.gather(self.weight, plan.weight)

    def stored_rows(self):
        w, z = self.weight, self.zero
        cols = max(self.cols, 1)
        rows = torch.arange(z.lo, z.hi, device=w.device) // cols
        return w, rows
