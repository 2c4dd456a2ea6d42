"""Distributed batch normalization over a partitioned (N, C, ...) tensor.

Per-channel sums over the local block are AllSumReduced over P_x (one collective), so every
worker normalizes with the global batch statistics; gamma/beta live on the first worker and
are broadcast. The backward is hand-written (one more AllSumReduce, self-adjoint); the
parameters' adjoint is the Broadcast's SumReduce.
"""

from __future__ import annotations

import torch

from ..errors import PartitionError
from ..partition import Partition
from ..primitives import AllSumReduceOp, BroadcastOp
from ._params import parameter


class DistributedBatchNorm(torch.nn.Module):
    """BatchNorm over dims (0, 2, 3, ...) of a tensor partitioned by ``P_x`` (P_x.shape[1]=1)."""

    def __init__(self, P_x: Partition, num_features: int, eps: float = 1e-5,
                 momentum: float = 0.1, affine: bool = True, *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if P_x.dim < 2 or P_x.shape[1] != 1:
            raise PartitionError(f"DistributedBatchNorm: channel dimension must not be "
                                 f"partitioned (P_x {P_x.shape})")
        self.P_x, self.eps, self.momentum = P_x, eps, momentum
        dev = device if device is not None else P_x.world.device
        kw = {"dtype": dtype or torch.get_default_dtype(), "device": dev}
        self.root = Partition([P_x.ranks[0]], (1,), P_x.world)
        ones, zeros = torch.ones(num_features, **kw), torch.zeros(num_features, **kw)
        self.affine = affine
        if affine:
            self.weight = parameter(ones if self.root.active else None, ones, 1)
            self.bias = parameter(zeros if self.root.active else None, ones, 1)
            dst = P_x.reshape((P_x.size,))
            self._bcast = BroadcastOp(self.root, dst, shape=(num_features,))
        self.register_buffer("running_mean", zeros.clone())
        self.register_buffer("running_var", ones.clone())
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long,
                                                                 device=dev))
        self._allsum = AllSumReduceOp(P_x, tuple(range(P_x.dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.P_x.active:
            return x
        w = self._bcast(self.weight) if self.affine else None
        b = self._bcast(self.bias) if self.affine else None
        if self.training:
            y, mean, var, n = _SyncBatchNorm.apply(x, w, b, self._allsum, self.eps)
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m, n = self.momentum, int(n)
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * n / max(n - 1, 1))
            return y
        shape = [1, -1] + [1] * (x.dim() - 2)
        scale = torch.rsqrt(self.running_var + self.eps)
        shift = -self.running_mean * scale
        if w is not None:
            scale, shift = scale * w, shift * w + b
        return x * scale.reshape(shape) + shift.reshape(shape)


    # -- global state ---------------------------------------------------------
    def load_global_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take a sequential ``torch.nn.BatchNormNd`` state dict (every rank passes it)."""
        with torch.no_grad():
            if self.affine and self.root.active:
                self.weight.data = sd["weight"].detach().clone().to(self.weight)
                self.bias.data = sd["bias"].detach().clone().to(self.bias)
            for k in ("running_mean", "running_var", "num_batches_tracked"):
                if k in sd:
                    getattr(self, k).copy_(sd[k])

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The sequential layer's state dict on P_x's first worker, ``{}`` elsewhere (the
        running statistics are replicated over P_x, the affine parameters live there)."""
        if not self.root.active:
            return {}
        out = {k: getattr(self, k).detach().clone()
               for k in ("running_mean", "running_var", "num_batches_tracked")}
        if self.affine:
            out.update(weight=self.weight.detach().clone(), bias=self.bias.detach().clone())
        return out


class _SyncBatchNorm(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b with global batch statistics.

    Forward: local per-channel [sum x, sum x^2, count] -> AllSumReduce -> one fused
    scale-and-shift pass. Backward (hand-written, like torch's SyncBatchNorm): local
    [sum dy, sum dy (x - mean)] -> AllSumReduce -> dx in one pass; dw, db are this worker's
    partial sums (the weight Broadcast's adjoint sums them).
    """

    @staticmethod
    def forward(ctx, x, w, b, allsum: AllSumReduceOp, eps: float):  # type: ignore[override]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xa = x.to(acc)
        C = x.shape[1]
        count = torch.full((C,), x.numel() // max(C, 1), dtype=acc, device=x.device)
        tot = allsum._sum(torch.stack([xa.sum(dims), (xa * xa).sum(dims), count]))
        n = tot[2]
        mean = tot[0] / n
        var = (tot[1] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        scale = invstd * w.to(acc) if w is not None else invstd
        shift = (b.to(acc) if b is not None else torch.zeros_like(mean)) - mean * scale
        # (out-of-place addcmul with a broadcast first operand is ~6x slower on CPU)
        y = (xa * scale.reshape(shape)).add_(shift.reshape(shape)).to(x.dtype)
        ctx.save_for_backward(x, mean, invstd, w, n)
        ctx.allsum, ctx.affine = allsum, w is not None
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n[0] if n.numel() else n.sum()

    @staticmethod
    def backward(ctx, dy, _mean, _var, _n):  # type: ignore[override]
        x, mean, invstd, w, n = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        acc = mean.dtype
        xa, dya = x.to(acc), dy.to(acc)
        if xa.dtype == dya.dtype and xa.device.type in ("cpu", "cuda"):
            # torch's fused reduction: (sum dy (x - mean) invstd, sum dy), no temporary
            _, s_dyxhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dya, xa, None, None, None, mean, invstd, True, 0.0, [False, True, True])
            sum_dy_xmu = s_dyxhat / invstd
        else:
            sum_dy = dya.sum(dims)
            sum_dy_xmu = (dya * xa).sum(dims) - mean * sum_dy
        g = ctx.allsum._sum(torch.stack([sum_dy, sum_dy_xmu]))
        k1 = invstd * w.to(acc) if ctx.affine else invstd  # dx = k1 dy + k2 x + k3
        k2 = -k1 * invstd * invstd * g[1] / n
        k3 = -k1 * g[0] / n - mean * k2
        dx = (xa * k2.reshape(shape)).add_(k3.reshape(shape))  # one full-size allocation
        dx.addcmul_(dya, k1.reshape(shape))
        dx = dx.to(x.dtype)
        dw = (sum_dy_xmu * invstd).to(w.dtype) if ctx.affine else None
        db = sum_dy.to(w.dtype) if ctx.affine else None
        return dx, dw, db, None, None
