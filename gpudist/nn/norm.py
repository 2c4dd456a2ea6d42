"""Distributed batch normalization over a partitioned (N, C, ...) tensor.

Statistics: every worker computes its block's per-channel count, mean and variance (torch's
stable kernel), and AllSumReduces over the non-channel axes merge them in float64 (Chan et
al.: ``n var = sum_i n_i var_i + sum_i n_i (mean_i - mean)^2``): one sums the counts, the
count-weighted means and variances, a second the squared deviations of the block means
from the global mean, so large means do not cancel (reading the second sum off
``sum n_i mean_i^2 - n mean^2`` in one reduction lost 5-6 digits at mean/std = 3e5). The
channel axis may be partitioned: each channel block is reduced over its own fibre.
gamma/beta live on the workers at (0, j, 0, ..), one per fibre.

The backward is hand-written (one more AllSumReduce, self-adjoint):
``dx = w invstd (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean)))``. Where batch
statistics are used (training, or no running statistics), gamma/beta ride along in the
first forward reduction (only their home worker adds them) and their gradients come out of
the backward one, so a step runs three collectives; elsewhere (evaluation with running
statistics, a batch of 0) they are broadcast, with the SumReduce as adjoint. Empty blocks
(more workers than entries) take part with zero counts. Options as
``torch.nn.BatchNormNd``: ``eps``, ``momentum`` (``None``: cumulative average), ``affine``,
``track_running_stats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import MismatchError, PartitionError, ShapeError, raised_everywhere
from ..meta import OK, Row, exchange, same_program
from ..partition import Partition
from ..primitives import AllSumReduce, Broadcast, Plan
from ..primitives.base import layer_adjoint
from ..spec import PARTIAL, REPLICATE, TensorSpec, stable_hash
from ._layer import DistributedModule, ShardedParameters, state_digest
from ._params import parameter


@dataclass
class _NormPlan:
    out: TensorSpec
    stats: Plan
    params: Plan | None
    count: int  # global entries per channel


class DistributedBatchNorm(ShardedParameters, DistributedModule):
    """BatchNorm over dims (0, 2, 3, ...) of a tensor partitioned by ``P_x``."""

    live_options = ("eps", "momentum")

    same_dtype_as_parameters = "half"  # torch's batch norm takes half inputs, float32 stats

    def __init__(self, P_x: Partition, num_features: int, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if P_x.dim < 2:
            raise raised_everywhere(PartitionError(
                f"DistributedBatchNorm: the partition needs (N, C, ...) dimensions, got "
                f"{P_x.shape}"))
        pc = P_x.shape[1]
        if num_features < pc:
            raise raised_everywhere(PartitionError(
                f"DistributedBatchNorm: {num_features} channels cannot be split over {pc} "
                f"workers"))
        self.P_x, self.eps, self.momentum = P_x, eps, momentum
        self.num_features, self.affine = num_features, affine
        self.track_running_stats = track_running_stats
        self.setup(P_x, P_x.ranks)
        dev = device if device is not None else P_x.world.device
        kw = {"dtype": dtype or torch.get_default_dtype(), "device": dev}
        k = P_x.dim
        self.P_home = Partition([P_x.world_rank_of((0, j) + (0,) * (k - 2)) for j in range(pc)],
                                (pc,), P_x.world)
        self.root = Partition([self.P_home.ranks[0]], (1,), P_x.world)
        # my channel block (every worker of P_x keeps the running statistics of its block)
        c0, c1 = _channel_range(num_features, P_x)
        ones, zeros = torch.ones(num_features, **kw), torch.zeros(num_features, **kw)
        home = self.P_home.active
        if affine:
            self.weight = parameter(ones[c0:c1] if home else None, ones, 1)
            self.bias = parameter(zeros[c0:c1] if home else None, ones, 1)
            self.params = Broadcast(self.P_home.reshape((1, pc) + (1,) * (k - 2)), P_x)
        else:
            self.weight = self.bias = None
            self.params = None
        self.homes = {"weight": (self.P_home, (num_features,)),
                      "bias": (self.P_home, (num_features,))} if affine else {}
        if track_running_stats:
            self.register_buffer("running_mean", zeros[c0:c1].clone())
            self.register_buffer("running_var", ones[c0:c1].clone())
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long,
                                                                     device=dev))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None
        self.stats = AllSumReduce(P_x, [a for a in range(k) if a != 1])

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}, "
                f"partition={self.P_x.shape}")

    def config(self) -> int:
        """The layer's options and whether it normalises with the batch's statistics or
        the running ones: ``eval()`` on some ranks only is a MismatchError at the next
        call, naming the ranks, not a wait in the other mode's exchange."""
        use_batch = self.training or not self.track_running_stats
        return stable_hash((super().config(), use_batch))

    def make_plan(self, spec: TensorSpec) -> _NormPlan:
        g = spec.global_shape
        if not spec.standard or spec.ndim != self.P_x.dim or g[1] != self.num_features:
            raise raised_everywhere(ShapeError(
                f"DistributedBatchNorm: expected (N, {self.num_features}, ...) blocks split the "
                f"standard way, got {spec.describe()}"))
        k, dev = self.P_x.dim, spec.device_type
        rows = 5 if self.affine else 3  # the parameters ride along with the statistics
        st = TensorSpec(self.P_x, (rows, g[1]), torch.float64, dev,
                        (PARTIAL, 1) + (PARTIAL,) * (k - 2))
        params = None
        if self.params is not None:
            params = self.params.plan(TensorSpec(self.params.P_src, (g[1],), spec.dtype, dev,
                                                 (REPLICATE, 0) + (REPLICATE,) * (k - 2)))
        count = math.prod(g) // max(g[1], 1)
        return _NormPlan(spec, self.stats.plan(st), params, count)

    def check_call(self, plan: _NormPlan) -> None:
        # like torch: wherever batch statistics are used (also in eval mode without
        # running statistics), one value per channel is refused
        if (self.training or not self.track_running_stats) and plan.count == 1:
            raise raised_everywhere(ValueError(
                f"Expected more than 1 value per channel when training, got input size "
                f"{list(plan.out.global_shape)}"))
        # the first call normalising with the running statistics after training (or after
        # a load) compares their copies first (every rank calls this: the flag is alike)
        if self.training or not self.track_running_stats:
            self.__dict__["_copies_checked"] = False
        elif not self.__dict__.get("_copies_checked"):
            self._check_running_copies(f"{type(self).__name__} in eval mode")
            self.__dict__["_copies_checked"] = True

    def run(self, x: torch.Tensor, plan: _NormPlan) -> torch.Tensor:
        use_batch = self.training or not self.track_running_stats
        if use_batch and plan.count:  # the parameters travel in the statistics' reduction
            y, mean, var = _SyncBatchNorm.apply(x, self.weight, self.bias, self.stats,
                                                plan.stats, self.eps)
        else:
            share = self.params
            w = share.apply_plan(self.weight, plan.params) if share is not None else None
            b = share.apply_plan(self.bias, plan.params) if share is not None else None
            if not use_batch:
                return _affine(x, self.running_mean, torch.rsqrt(self.running_var + self.eps),
                               w, b)
            # a batch of 0, as torch: an empty output, zero gradients for the parameters,
            # the running statistics as they were (the step still counted)
            if self.training and self.track_running_stats:
                with torch.no_grad():
                    self.num_batches_tracked.add_(1)
            y = x.clone()
            for p in (w, b):
                if p is not None:
                    y = y + p.sum() * 0
            return y
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                     else self.momentum)
                n = plan.count
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean), alpha=m)
                self.running_var.mul_(1 - m).add_(var.to(self.running_var) * (n / (n - 1)),
                                                  alpha=m)
        return y

    # -- global state -------------------------------------------------------------------
    def load_global_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True
                               ) -> None:
        """Take a sequential ``torch.nn.BatchNormNd`` state dict (every rank passes it)."""
        super().load_global_state_dict(sd, strict)
        self.__dict__["_copies_checked"] = False
        if not self.track_running_stats:
            return
        c0, c1 = _channel_range(self.num_features, self.P_x)
        with torch.no_grad():
            for k in ("running_mean", "running_var"):
                if k in sd:
                    getattr(self, k).copy_(sd[k][c0:c1])
            if "num_batches_tracked" in sd:
                self.num_batches_tracked.copy_(sd["num_batches_tracked"])

    def _global_entries(self) -> dict[str, tuple[int, ...]]:
        out = super()._global_entries()
        if self.track_running_stats:
            c = self.num_features
            out.update({"running_mean": (c,), "running_var": (c,), "num_batches_tracked": ()})
        return out

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The sequential layer's state dict on the first worker, ``{}`` elsewhere. Every
        worker of ``P_x`` keeps its channel block's running statistics; the copies of one
        block are compared first (a MismatchError on every rank where they differ)."""
        if self.track_running_stats:
            self._check_running_copies(f"{type(self).__name__}.global_state_dict")
        out = super().global_state_dict()
        if self.track_running_stats:
            for k in ("running_mean", "running_var"):
                v = self._running(k)
                if self.root.active:
                    out[k] = v
            if self.root.active:
                out["num_batches_tracked"] = self.num_batches_tracked.detach().clone()
        return out

    def _check_running_copies(self, name: str) -> None:
        """Collective over the world: the workers holding one channel block's running
        statistics must hold the same values (they change alike on every worker unless a
        program edits them on some ranks only)."""
        w = self.world
        if w.size == 1:
            return
        block = self.P_x.coords[1] if self.P_x.active else -1
        digest = state_digest({k: getattr(self, k) for k in (
            "running_mean", "running_var", "num_batches_tracked")}) if block >= 0 else 0
        group = self.world_group
        rows = exchange(group, Row.make(name[-24:], OK, self._layer_config(), None, "cpu",
                                        [block + 1], None, digest), name)
        same_program(rows, group.ranks, name)  # every rank at this layer's same check
        copies: dict[int, dict[int, list[int]]] = {}
        for r, x in zip(group.ranks, rows):
            if x.local[0] > 0:
                copies.setdefault(x.local[0] - 1, {}).setdefault(x.spec_hash, []).append(r)
        bad = {j: list(d.values()) for j, d in copies.items() if len(d) > 1}
        if bad:
            detail = "; ".join(f"channel block {j}: ranks {' vs '.join(map(str, g))}"
                               for j, g in sorted(bad.items()))
            raise raised_everywhere(MismatchError(
                f"{name}: the copies of the running statistics differ ({detail}); every "
                f"worker of the input partition keeps a copy of its channel block's "
                f"running_mean / running_var / num_batches_tracked, and they stay equal "
                f"unless they are changed on some ranks only (load them with "
                f"load_global_state_dict on every rank)"))

    def _running(self, k: str) -> torch.Tensor:
        """Collect a running statistic from the channel-block homes to the root."""
        ops = getattr(self, "_collect_running", None)
        if ops is None:
            from ..primitives import Repartition

            ops = Repartition(self.P_home, Partition(self.root.ranks, (1,), self.world))
            self._collect_running = ops
        t = getattr(self, k).detach()
        return ops(t if self.P_home.active else t.new_zeros(0))


def _same_layout(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``dy`` laid out alike for torch's fused batch-norm reductions, which read
    ``dy`` in ``x``'s memory format: a block whose strides make it channels-last (a
    transposed copy with size-1 dimensions can) against a contiguous ``dy`` gave wrong
    sums (randomized check, round N). A copy only where the layouts differ."""
    if x.is_contiguous():
        return x, dy.contiguous()
    cl = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if cl is not None and x.is_contiguous(memory_format=cl):
        return x, dy.contiguous(memory_format=cl)
    return x.contiguous(), dy.contiguous()


def _channel_range(C: int, P_x: Partition) -> tuple[int, int]:
    if not P_x.active:
        return 0, 0
    from ..decomposition import block_range

    return block_range(C, P_x.shape[1], P_x.coords[1])


def _shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _affine(x, mean, invstd, w, b):
    """(x - mean) invstd w + b, per channel, in x's dtype: one pass of torch's inference
    batch norm kernel (given the scale as weight, variance 1, eps 0) where it takes the
    dtypes, else three elementwise passes."""
    scale = invstd if w is None else invstd * w
    dt = x.dtype
    if dt in (torch.float32, torch.float64) and x.dim() >= 2:
        one = torch.ones_like(mean, dtype=dt)
        return torch.batch_norm(x, scale.to(dt), None if b is None else b.to(dt), mean.to(dt),
                                one, False, 0.0, 0.0, False)
    s = _shape(x)
    y = torch.sub(x, mean.to(dt).reshape(s)).mul_(scale.to(dt).reshape(s))
    return y if b is None else y.add_(b.to(dt).reshape(s))


class _SyncBatchNorm(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b with the global batch statistics.

    Over the workers that share this channel block, two AllSumReduces forward and one
    backward (the parameters' Broadcast and its SumReduce ride along: 6 -> 3 collectives a
    step). Forward sums each worker's (count, count mean, count var) and, from the
    parameters' home worker only (zeros elsewhere), its ``w`` and ``b``; then each
    worker's count (mean_i - mean)^2. Backward sums (sum dy, sum dy (x - mean)), from which
    every worker also has the whole gradient of ``w`` and ``b`` (the home worker keeps it).
    ``w``/``b``: the parameters as this rank holds them (empty off their home), or None."""

    @staticmethod
    def forward(ctx, x, w, b, allsum: AllSumReduce, plan: Plan, eps: float):  # type: ignore
        C = x.shape[1]
        n_i = x.numel() // C if C else 0
        affine = w is not None
        loc = torch.zeros(5 if affine else 3, C, dtype=torch.float64, device=x.device)
        if n_i:
            m_i, v_i = torch.batch_norm_update_stats(x, None, None, 0.0)
            m_i, v_i = m_i.to(torch.float64), v_i.to(torch.float64)
            loc[0] = n_i
            loc[1] = n_i * m_i
            loc[2] = n_i * v_i
        if affine and w.numel():  # the parameters' home worker (exact: one summand)
            loc[3], loc[4] = w.detach(), b.detach()
        tot = allsum.apply_plan(loc, plan)
        n = tot[0]
        mean = tot[1] / n
        spread = torch.zeros(1, C, dtype=torch.float64, device=x.device)
        if n_i:  # Chan's second sum, with the global mean known: nothing large cancels
            spread[0] = n_i * (m_i - mean) ** 2
        var = ((tot[2] + allsum.apply_plan(spread, plan)[0]) / n).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        wx = bx = None
        if affine:  # in the input's dtype, as the parameters' Broadcast delivered them
            wx, bx = tot[3].to(x.dtype), tot[4].to(x.dtype)
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        y = _affine(x, mean.to(acc), invstd.to(acc), wx, bx) if n_i else x.clone()
        ctx.save_for_backward(x, mean.to(acc), invstd.to(acc), wx)
        ctx.allsum, ctx.plan, ctx.n = allsum, plan, n
        ctx.params = (w.shape, w.dtype, b.dtype) if affine else None
        return y, mean, var

    @staticmethod
    @layer_adjoint  # double backward: torch's clear error; failures posted to the world
    def backward(ctx, dy, _mean, _var):  # type: ignore[override]
        x, mean, invstd, w = ctx.saved_tensors
        C = x.shape[1]
        loc = torch.zeros(2, C, dtype=torch.float64, device=x.device)
        if x.numel():
            dims = [0] + list(range(2, x.dim()))
            x, dy = _same_layout(x, dy)
            if x.is_cuda:  # SyncBatchNorm's kernel: (sum dy, sum dy (x - mean), ...)
                sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
                    dy, x, mean, invstd, w, True, False, False)
            elif dy.dtype == x.dtype:  # torch's fused reduction: sum dy (x - mean) invstd
                _, s, sum_dy = torch.ops.aten.native_batch_norm_backward(
                    dy, x, None, None, None, mean, invstd, True, 0.0, [False, True, True])
                sum_dy_xmu = s / invstd
            else:
                sum_dy = dy.sum(dims)
                sum_dy_xmu = (dy * (x - mean.reshape(_shape(x)))).sum(dims)
            loc[0], loc[1] = sum_dy, sum_dy_xmu
        g = ctx.allsum.apply_plan(loc, ctx.plan)
        n = ctx.n
        dw = db = None
        if ctx.params is not None:  # the whole gradient, kept by the home worker
            shape, wdt, bdt = ctx.params
            if shape.numel():
                dw = (g[1] * invstd.to(torch.float64)).to(wdt)
                db = g[0].to(bdt)
            else:
                dw, db = x.new_zeros(shape, dtype=wdt), x.new_zeros(shape, dtype=bdt)
        if not x.numel():
            return torch.zeros_like(x), dw, db, None, None, None
        acc = mean.dtype
        k1 = invstd if w is None else invstd * w.to(acc)
        k2 = (-k1 * invstd * invstd * (g[1] / n).to(acc))
        mdy = (g[0] / n).to(acc)
        # dx = (x - mean) k2 - mdy k1 + dy k1
        s = _shape(x)
        if x.dtype == acc and x.dim() >= 2:  # two passes, the first _affine's kernel
            dx = _affine(x, mean, k2, None, -mdy * k1).addcmul_(dy, k1.reshape(s))
        else:  # in the accumulation dtype (float32 for half inputs)
            dx = torch.sub(x, mean.reshape(s)).mul_(k2.reshape(s))
            dx.addcmul_(dy, k1.reshape(s)).sub_((mdy * k1).reshape(s))
        return dx.to(x.dtype), dw, db, None, None, None
