"""A small 2-D Fourier neural operator, sequential (plain torch) and distributed (gpudist).

The network (Li et al., *Fourier neural operator for parametric PDEs*, 2021)::

    lift:     1x1 conv  in_channels -> width
    layer l:  v <- act(K_l v + W_l v)        (no activation after the last layer)
    project:  1x1 conv  width -> hidden, GELU, 1x1 conv hidden -> out_channels

with ``W_l`` a 1x1 convolution (point-wise channel mixing) and ``K_l`` the spectral
convolution: ``K v = irfft2(R . rfft2(v))``, where only the lowest ``modes`` frequencies
along each spatial dim are kept (``|kx| < m1`` -- rows ``:m1`` and ``-m1:`` of the FFT
along X -- and ``ky < m2`` of the real FFT along Y) and ``R`` is a complex weight per
(input channel, output channel, kept mode): ``(R . u)[o, k] = sum_i u[i, k] R[i, o, k]``.

Distributed (:class:`DistributedSpectralConv2d`): the tensor ``(batch, channels, X, Y)``
lies over ``P_x = (P_b, 1, P_X, 1)`` (X split, optionally the batch too). Forward::

    u = rfft(v, Y)[..., :m2]            local: Y is whole on every worker
    u <- T[P_x -> P_y] u                DistributedTranspose: X whole, the m2 modes split
    u = fft(u, X)                       local
    z = [R1 . u[:m1], 0, R2 . u[-m1:]]  local, this worker's ky columns of R1, R2
    z = ifft(z, X)                      local
    z <- T[P_y -> P_x] z                the transpose back: X split, ky whole
    K v = irfft(z, Y, n=Y)              local (the dropped ky modes are zeros)

with ``P_y = transposed_partition(P_x, 2, 3) = (P_b, 1, 1, P_X)``. Adjoint (autograd): the
local FFTs' adjoints and the reverse all-to-alls (``T* = T^-1``). Only the ``m2`` kept
columns travel, not the whole spectrum. The weights are replicated on every rank; each
worker's products touch only its ky columns of ``R``, so the full gradient is the sum over
the ranks of the local ones (as for the 1x1 convolutions, which act on the local blocks):
the training loop adds them with one :class:`~gpudist.primitives.AllSumReduce`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpudist import DistTensor, Partition, TensorSpec
from gpudist.decomposition import block_range
from gpudist.errors import PartitionError, ShapeError, raised_everywhere
from gpudist.nn._layer import DistributedModule
from gpudist.nn._params import connect
from gpudist.nn.transpose import DistributedTranspose, transposed_partition

COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _mul(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(u . w)[b, o, x, y] = sum_i u[b, i, x, y] w[i, o, x, y]`` (complex)."""
    return torch.einsum("bixy,ioxy->boxy", u, w)


class SpectralConv2d(nn.Module):
    """The sequential spectral convolution ``irfft2(R . rfft2(v))`` (see the module
    docstring); weights drawn like the reference FNO: ``scale * U[0, 1)`` (real and
    imaginary parts)."""

    def __init__(self, in_channels: int, out_channels: int, modes1: int, modes2: int,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes1, self.modes2 = modes1, modes2
        scale = 1.0 / (in_channels * out_channels)
        shape = (in_channels, out_channels, modes1, modes2)
        cd = COMPLEX[dtype]
        self.weights1 = nn.Parameter(scale * torch.rand(shape, dtype=cd))
        self.weights2 = nn.Parameter(scale * torch.rand(shape, dtype=cd))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        b, _, nx, ny = v.shape
        m1, m2 = self.modes1, self.modes2
        u = torch.fft.rfft2(v)
        z = torch.zeros(b, self.out_channels, nx, ny // 2 + 1, dtype=u.dtype, device=u.device)
        z[:, :, :m1, :m2] = _mul(u[:, :, :m1, :m2], self.weights1)
        z[:, :, -m1:, :m2] = _mul(u[:, :, -m1:, :m2], self.weights2)
        return torch.fft.irfft2(z, s=(nx, ny))


@dataclass
class _SpectralPlan:
    out: object     # TensorSpec of the output
    fwd: object     # the transpose P_x -> P_y of the kept modes
    bwd: object     # ... and back
    ky: tuple[int, int]  # this worker's range of the m2 kept ky modes


class DistributedSpectralConv2d(DistributedModule):
    """:class:`SpectralConv2d` on a tensor whose X dim is split over ``P_x = (P_b, 1, P_X,
    1)``: local FFT along Y, transpose, local FFT along X, per-mode weights, and back (see
    the module docstring). Same parameters (names, shapes, initialization from the current
    RNG state) as :class:`SpectralConv2d`, replicated on every rank of ``P_x``."""

    def __init__(self, P_x: Partition, in_channels: int, out_channels: int, modes1: int,
                 modes2: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        if P_x.dim != 4 or P_x.shape[1] != 1 or P_x.shape[3] != 1:
            raise raised_everywhere(PartitionError(
                f"DistributedSpectralConv2d: expected a partition (P_b, 1, P_X, 1) of "
                f"(batch, channels, X, Y), got {P_x.shape}"))
        self.P_x = P_x
        self.P_y = transposed_partition(P_x, 2, 3)
        self.setup(P_x, P_x.ranks)
        seq = SpectralConv2d(in_channels, out_channels, modes1, modes2, dtype)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes1, self.modes2 = modes1, modes2
        self.weights1, self.weights2 = seq.weights1, seq.weights2
        self.to_modes = DistributedTranspose(self.P_x, self.P_y)
        self.to_space = DistributedTranspose(self.P_y, self.P_x)

    def make_plan(self, spec: TensorSpec) -> _SpectralPlan:
        g = spec.global_shape
        if not spec.standard or spec.ndim != 4 or g[1] != self.in_channels:
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected an input (batch, {self.in_channels}, X, Y) split the "
                f"standard way over {self.P_x.shape}, got {spec.describe()}"))
        b, _, nx, ny = g
        if 2 * self.modes1 > nx or self.modes2 > ny // 2 + 1:
            raise raised_everywhere(ShapeError(
                f"{self.name}: modes ({self.modes1}, {self.modes2}) need X >= "
                f"{2 * self.modes1} and Y >= {2 * self.modes2 - 2}, got X={nx}, Y={ny}"))
        cd = COMPLEX.get(spec.dtype)
        if cd is None:
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected a float32/float64 input, got {spec.dtype}"))
        m2, co = self.modes2, self.out_channels
        dev = spec.device_type
        fwd = self.to_modes.plan(TensorSpec(self.P_x, (b, self.in_channels, nx, m2), cd, dev))
        bwd = self.to_space.plan(TensorSpec(self.P_y, (b, co, nx, m2), cd, dev))
        ky = (0, 0)
        if self.P_y.active:
            ky = block_range(m2, self.P_y.shape[3], self.P_y.coords[3])
        return _SpectralPlan(spec.replace(global_shape=(b, co, nx, ny)), fwd, bwd, ky)

    def run(self, v: torch.Tensor, plan: _SpectralPlan) -> torch.Tensor:
        m1, m2 = self.modes1, self.modes2
        ny = plan.out.global_shape[3]
        u = torch.fft.rfft(v, dim=3)[..., :m2].contiguous()
        u = self.to_modes.run(u, plan.fwd)            # X whole, ky split
        lo, hi = plan.ky
        if hi == lo:  # no ky columns here (fewer modes than workers): zeros, kept in the
            z = u.new_zeros(u.shape[0], self.out_channels, u.shape[2], 0)  # graph, so this
            z = connect(z, u, self.weights1, self.weights2)  # rank runs every adjoint
            return torch.fft.irfft(self.to_space.run(z, plan.bwd), n=ny, dim=3)
        u = torch.fft.fft(u, dim=2)
        top = _mul(u[:, :, :m1], self.weights1[..., lo:hi])
        bottom = _mul(u[:, :, -m1:], self.weights2[..., lo:hi])
        gap = top.new_zeros(top.shape[0], top.shape[1], u.shape[2] - 2 * m1, top.shape[3])
        z = torch.fft.ifft(torch.cat([top, gap, bottom], dim=2), dim=2)
        z = self.to_space.run(z.contiguous(), plan.bwd)  # X split, ky whole
        return torch.fft.irfft(z, n=ny, dim=3)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, modes=({self.modes1}, "
                f"{self.modes2}), P_x={self.P_x.shape}")


class FNO2d(nn.Module):
    """The sequential network (see the module docstring), from plain torch layers."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1, width: int = 12,
                 modes: int = 6, layers: int = 2, hidden: int = 32,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.lift = nn.Conv2d(in_channels, width, 1, dtype=dtype)
        self.spectral = nn.ModuleList([self._spectral(width, modes, dtype)
                                       for _ in range(layers)])
        self.mix = nn.ModuleList([nn.Conv2d(width, width, 1, dtype=dtype)
                                  for _ in range(layers)])
        self.proj1 = nn.Conv2d(width, hidden, 1, dtype=dtype)
        self.proj2 = nn.Conv2d(hidden, out_channels, 1, dtype=dtype)

    def _spectral(self, width: int, modes: int, dtype: torch.dtype) -> nn.Module:
        return SpectralConv2d(width, width, modes, modes, dtype)

    def spectral_conv(self, i: int, v: torch.Tensor) -> torch.Tensor:
        return self.spectral[i](v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.lift(x)
        n = len(self.spectral)
        for i in range(n):
            v = self.spectral_conv(i, v) + self.mix[i](v)
            if i < n - 1:
                v = F.gelu(v)
        return self.proj2(F.gelu(self.proj1(v)))


class DistributedFNO2d(FNO2d):
    """:class:`FNO2d` with distributed spectral convolutions over ``P_x`` (collective
    construction). ``forward`` takes and returns this rank's X block (plain tensors: the 1x1
    convolutions act on the local blocks); the parameters, with the sequential network's
    names, are replicated on every rank."""

    def __init__(self, P_x: Partition, in_channels: int = 3, out_channels: int = 1,
                 width: int = 12, modes: int = 6, layers: int = 2, hidden: int = 32,
                 dtype: torch.dtype = torch.float64) -> None:
        self.P_x = P_x
        super().__init__(in_channels, out_channels, width, modes, layers, hidden, dtype)
        self.shape: tuple[int, int, int, int] | None = None

    def _spectral(self, width: int, modes: int, dtype: torch.dtype) -> nn.Module:
        return DistributedSpectralConv2d(self.P_x, width, width, modes, modes, dtype)

    def spectral_conv(self, i: int, v: torch.Tensor) -> torch.Tensor:
        b, _, nx, ny = self.shape
        x = DistTensor.from_local(v, self.P_x, (b, v.shape[1], nx, ny))
        return self.spectral[i](x).local

    def forward(self, x: torch.Tensor, shape: tuple[int, int, int, int] | None = None
                ) -> torch.Tensor:
        """``x``: this rank's block of the global input of ``shape`` (every rank passes
        the same shape: no metadata exchange)."""
        self.shape = tuple(shape) if shape is not None else None
        if self.shape is None:
            raise raised_everywhere(ValueError(
                "DistributedFNO2d.forward needs the global input shape"))
        return super().forward(x)


def make_sequential(seed: int, dtype: torch.dtype = torch.float64, **kw) -> FNO2d:
    """The sequential network with its initial weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return FNO2d(dtype=dtype, **kw)


def make_distributed(P_x: Partition, seq: FNO2d, dtype: torch.dtype = torch.float64,
                     **kw) -> DistributedFNO2d:
    """The distributed network holding ``seq``'s parameters (collective)."""
    net = DistributedFNO2d(P_x, dtype=dtype, **kw)
    net.load_state_dict(seq.state_dict())
    return net
