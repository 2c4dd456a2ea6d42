"""Distributed up-/down-sampling with torch's semantics (``torch.nn.Upsample`` /
``F.interpolate``) on a tensor partitioned over its spatial dims (batch/channel splits work
too: they need no halo).

Interpolation is separable and linear in ``x``: per spatial dimension of global input
length ``L`` and output length ``M``, output ``o`` is ``sum_t w_t[o] * x[idx_t[o]]`` over a
few *taps* (nearest: 1; linear: 2; bicubic: 4; area: the window length). The taps come
from torch's own index math (``aten/src/ATen/native/UpSample.h``), reproduced exactly:

* ``scale``: with ``scale_factor`` given (``recompute_scale_factor`` not set) the source
  index uses ``1/scale_factor``, else ``L/M``; ``align_corners=True`` uses
  ``(L-1)/(M-1)`` (0 if ``M == 1``);
* nearest: ``min(floorf(o*scale), L-1)``; nearest-exact: ``min(floorf(max(scale*(o+0.5)
  - 0.5, 0) + 0.5), L-1)``, in the input's opmath dtype -- except where torch's CPU forward
  takes its ``nearest_idx`` kernel (2 spatial dims with output ``H + W <= 128``): scale in
  float32 and, for nearest, copy when ``M == L`` and ``o >> 1`` when ``M == 2L``. (torch's
  nearest *backward* always uses ``nearest_idx``, so where the two rules differ torch's
  gradient is not the adjoint of its forward; this layer's gradient is always the exact
  adjoint of its forward);
* linear: ``r = scale*o`` (aligned) or ``max(scale*(o+0.5) - 0.5, 0)``, ``i0 =
  min(floor(r), L-1)``, ``i1 = min(i0+1, L-1)``, ``l1 = clamp(r - i0, 0, 1)``, copy when
  ``M == L``; bicubic: the same ``r`` unclamped, Keys' coefficients (A = -0.75) on the
  clamped indices ``i0-1 .. i0+2``;
* area: adaptive average pooling, window ``[floor(oL/M), ceil((o+1)L/M))``.

The distributed layer: outputs are block-balanced over the partition like every gpudist
layer; per dimension each worker's output range maps through its taps to a needed input
interval; :meth:`~gpudist.halo.HaloGeometry.from_intervals` turns these intervals into a
halo geometry (data from beyond a worker's direct neighbours comes over several hops; a
geometry it cannot express is a :class:`~gpudist.errors.HaloError` on every worker), the
halo exchange fetches the halos, and
each worker applies the taps dimension by dimension with ``index_select`` and its weights.
The adjoint is autograd's (``index_add`` of the weighted gradients, then the exchange's
adjoint H*). The global input shape comes with a DistTensor (a plain block: one exchange per call).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..buffers import LRU
from ..decomposition import block_range
from ..errors import HaloError, PartitionError, ShapeError, raised_everywhere
from ..halo import HaloExchange, HaloGeometry
from ..halo.geometry import require_nonempty
from ..partition import Partition
from ..spec import TensorSpec
from ._layer import DistributedModule, per_dim
from .sampling_edges import EdgePlan, upsample_edges

# mode -> the spatial ranks it supports (torch's rule)
MODES: dict[str, tuple[int, ...]] = {
    "nearest": (1, 2, 3), "nearest-exact": (1, 2, 3), "area": (1, 2, 3),
    "linear": (1,), "bilinear": (2,), "bicubic": (2,), "trilinear": (3,),
}
_INTERPOLATING = ("linear", "bilinear", "bicubic", "trilinear")
_CUBIC_A = -0.75


# --------------------------------------------------------------------------- index math


def output_length(L: int, size: int | None, scale: float | None) -> int:
    """torch's output length: ``size``, or ``floor(L * scale_factor)``."""
    return int(size) if size is not None else int(math.floor(L * scale))


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch does its index/weight math in for input ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_scale(L: int, M: int, scale: float | None, dt: torch.dtype) -> torch.Tensor:
    """compute_scales_value: ``1/scale_factor`` if given (> 0), else ``L / M``, in ``dt``."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=torch.float64).to(dt)
    return torch.tensor(L, dtype=dt) / torch.tensor(M, dtype=dt)


def _area_scale(L: int, M: int, align: bool, scale: float | None,
                dt: torch.dtype) -> torch.Tensor:
    """area_pixel_compute_scale."""
    if align:
        if M > 1:
            return torch.tensor(L - 1, dtype=dt) / torch.tensor(M - 1, dtype=dt)
        return torch.zeros((), dtype=dt)
    return _compute_scale(L, M, scale, dt)


def _source_index(L: int, M: int, align: bool, scale: float | None, dt: torch.dtype,
                  cubic: bool) -> torch.Tensor:
    """area_pixel_compute_source_index for every output index (in ``dt``)."""
    sc = _area_scale(L, M, align, scale, dt)
    o = torch.arange(M, dtype=torch.int64).to(dt)
    if align:
        return sc * o
    r = sc * (o + 0.5) - 0.5
    return r if cubic else torch.clamp(r, min=0.0)


def _guard(real: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """guard_index_and_lambda: ``i = min(floorf(r), L-1)`` (floorf: via float32, as torch
    does even for double), ``lambda = clamp(r - i, 0, 1)``."""
    i = torch.floor(real.to(torch.float32)).to(torch.int64).clamp(max=L - 1)
    lam = torch.clamp(real - i.to(real.dtype), 0.0, 1.0)
    return i, lam


def uses_legacy_nearest(out_spatial: Sequence[int]) -> bool:
    """Whether torch's CPU forward of nearest/nearest-exact takes the ``nearest_idx`` kernel
    for a contiguous input with these output spatial sizes: 2 spatial dims with
    ``H_out + W_out <= 128`` (its channels-last kernel; otherwise, and always for 1-D and
    3-D, the generic kernel). Channels-last inputs with C > 3 are not modelled."""
    return len(out_spatial) == 2 and out_spatial[0] + out_spatial[1] <= 128


@dataclass(frozen=True)
class Taps:
    """Per-dimension interpolation taps for all ``M`` outputs: output ``o`` is
    ``sum_t weight[t, o] * x[index[t, o]]`` over the taps with ``valid[t, o]``, divided by
    ``divisor[o]``. ``weight``/``valid``/``divisor`` are None where trivial (all ones / all
    valid / no division); ``identity``: ``M == L`` and output ``o`` is input ``o``."""

    index: torch.Tensor             # (K, M) int64
    weight: torch.Tensor | None     # (K, M) opmath dtype
    valid: torch.Tensor | None      # (K, M) bool
    divisor: torch.Tensor | None    # (M,) opmath dtype
    identity: bool = False

    def reads(self, o0: int, o1: int) -> tuple[int, int]:
        """Half-open input range read by outputs ``[o0, o1)`` (empty if no output)."""
        if o1 <= o0:
            return (0, 0)
        idx = self.index[:, o0:o1]
        return int(idx.min()), int(idx.max()) + 1


def source_taps(mode: str, L: int, M: int, align_corners: bool = False,
                scale: float | None = None, dtype: torch.dtype = torch.float64,
                legacy_nearest: bool = False) -> Taps:
    """torch's taps for one dimension: input length ``L``, output length ``M``, the user's
    ``scale`` factor (None if the size was given or is recomputed), index/weight math in
    ``dtype`` (the opmath dtype of the input: float64 for float64, else float32).

    Nearest modes have two index rules in torch's CPU forward: the generic kernel's
    (``r = scale*o`` resp. ``max(scale*(o+0.5) - 0.5, 0) + 0.5`` in ``dtype``, then
    ``floorf``) and, with ``legacy_nearest``, ``nearest_idx``/``nearest_exact_idx`` (scale in
    float32; nearest copies when ``M == L`` and uses ``o >> 1`` when ``M == 2L``), which torch
    takes for 2 spatial dims when the output's ``H + W <= 128`` (see
    :func:`uses_legacy_nearest`). They differ only at rounding boundaries and when a
    ``scale_factor`` gives ``M == L`` or ``M == 2L`` without being exactly 1 or 2.
    """
    if L < 1 or M < 1:
        raise ShapeError(f"interpolation: input and output sizes should be greater than 0, "
                         f"got input {L}, output {M}")
    if mode in ("nearest", "nearest-exact"):
        o = torch.arange(M, dtype=torch.int64)
        exact = mode == "nearest-exact"
        if legacy_nearest and not exact and M == L:
            return Taps(o[None], None, None, None, identity=True)
        if legacy_nearest and not exact and M == 2 * L:
            return Taps((o >> 1)[None], None, None, None)
        if legacy_nearest:  # compute_scales_value<float>, float32 products
            sc = _compute_scale(L, M, scale, torch.float32)
            if exact:  # floorf(double(o + 0.5) * double(scale))
                src = ((o.to(torch.float64) + 0.5) * sc.to(torch.float64)).to(torch.float32)
            else:      # floorf(float(o) * scale)
                src = o.to(torch.float32) * sc
        else:  # generic kernel: area_pixel_compute_scale/source_index in opmath, floorf
            sc = _area_scale(L, M, False, scale, dtype)
            od = o.to(dtype)
            src = (torch.clamp(sc * (od + 0.5) - 0.5, min=0.0) + 0.5) if exact else sc * od
            src = src.to(torch.float32)
        idx = torch.floor(src).to(torch.int64).clamp(max=L - 1)
        return Taps(idx[None], None, None, None)
    if mode == "area":  # adaptive average pooling
        o = torch.arange(M, dtype=torch.int64)
        start = (o * L) // M
        end = ((o + 1) * L + M - 1) // M
        n = end - start
        K = int(n.max())
        t = torch.arange(K, dtype=torch.int64)[:, None]
        valid = t < n[None]
        idx = torch.where(valid, start[None] + t, start[None])
        trivial = bool((n == 1).all())
        return Taps(idx, None, None if bool(valid.all()) else valid,
                    None if trivial else n.to(dtype), identity=trivial and M == L)
    if mode in ("linear", "bilinear", "trilinear"):
        if M == L:  # torch copies
            idx = torch.arange(M, dtype=torch.int64)
            return Taps(idx[None], None, None, None, identity=True)
        i0, l1 = _guard(_source_index(L, M, align_corners, scale, dtype, cubic=False), L)
        i1 = torch.clamp(i0 + 1, max=L - 1)
        return Taps(torch.stack([i0, i1]), torch.stack([1.0 - l1, l1]), None, None)
    if mode == "bicubic":
        i0, t = _guard(_source_index(L, M, align_corners, scale, dtype, cubic=True), L)
        A = _CUBIC_A

        def c1(x):
            return ((A + 2) * x - (A + 3)) * x * x + 1

        def c2(x):
            return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A

        w = torch.stack([c2(t + 1.0), c1(t), c1(1.0 - t), c2(2.0 - t)])
        idx = torch.stack([torch.clamp(i0 - 1 + j, 0, L - 1) for j in range(4)])
        return Taps(idx, w, None, None)
    raise ValueError(f"interpolation: unknown mode {mode!r} (choose from {sorted(MODES)})")


# --------------------------------------------------------------------------- the layer


@dataclass
class _DimOp:
    """The taps of one spatial dim on this worker, in local indices, ready to broadcast."""

    dim: int
    index: list[torch.Tensor]
    weight: list[torch.Tensor | None]
    valid: list[torch.Tensor | None]
    divisor: torch.Tensor | None
    ratio: float  # local outputs / local inputs (dims that shrink go first)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        y = None
        for idx, w, ok in zip(self.index, self.weight, self.valid):
            s = x.index_select(self.dim, idx)
            if ok is not None:
                s = torch.where(ok, s, s.new_zeros(()))
            if y is None:
                y = s if w is None else s * w
            else:
                y = y + s if w is None else torch.addcmul(y, s, w)
        if self.divisor is not None:
            y = y / self.divisor
        return y


class _Plan:
    """Everything for one global input shape (and opmath dtype): the halo plan, the global
    output shape, this worker's per-dim taps (global; localized per dtype/device)."""

    def __init__(self, layer: DistributedUpsample, spec: TensorSpec) -> None:
        P = layer.P_x
        g = spec.global_shape
        self.global_shape = g
        sizes = layer.output_sizes(g[2:])
        self.output_shape = tuple(g[:2]) + sizes
        self.out = TensorSpec(P, self.output_shape, spec.dtype, spec.device_type)
        geos, all_taps = layer.dims(spec)
        self.taps: list[tuple[Taps, tuple[int, int], tuple[int, int]]] = []
        bulks = []
        if P.active:
            for a, taps in enumerate(all_taps):
                me = geos[a + 2].worker(P.coords[a + 2])
                self.taps.append((taps, me.outputs, me.needed))
                bulks.append(me.bulk)
        self.halo = layer.halo.plan(spec) if P.active else None
        self.empty_out = P.active and 0 in self.out.local_shape
        self._ops: dict[tuple, list[_DimOp]] = {}
        self.fast = self._fast_path(layer, g, sizes)
        # the fast path without resampling the halos (outputs aligned with the blocks)
        self.edges = None
        if (self.fast is not None and self.halo is not None and not self.empty_out
                and layer.edge_split):
            self.edges = EdgePlan.make(self.halo.local, [int(s) for s in self.fast[0]],
                                       [o for _, o, _ in self.taps], bulks, g[2:])

    def _fast_path(self, layer: DistributedUpsample, g: tuple[int, ...],
                   sizes: tuple[int, ...]) -> tuple[tuple[float, ...], tuple] | None:
        """(scale factors, crop) when torch's own kernel on the halo-extended block gives
        this worker's outputs: linear modes, align_corners=False, integer ratios M = s L
        with torch's scale 1/s. Then the source index of global output o is the local one
        plus the block's global start (the map is shift-invariant), and the halo holds
        every tap of the kept outputs, so no local clamping touches them."""
        if layer.mode not in ("linear", "bilinear", "trilinear") or layer.align_corners:
            return None
        scales, crop = [], []
        for a, ((_, (o0, o1), (i0, i1)), L, M) in enumerate(zip(self.taps, g[2:], sizes)):
            sf = layer.scale_for(a)
            if M % L or (sf is not None and sf != M // L) or o1 <= o0 or i1 <= i0:
                return None
            k = M // L
            scales.append(float(k))
            crop.append(slice(o0 - k * i0, o1 - k * i0))
        return tuple(scales), (slice(None), slice(None), *crop)

    def ops(self, like: torch.Tensor) -> list[_DimOp]:
        """This worker's per-dim ops for ``like``'s dtype and device (cached)."""
        key = (like.dtype, like.device)
        ops = self._ops.get(key)
        if ops is None:
            ops = []
            nd = like.dim()
            for a, (taps, (o0, o1), (i0, i1)) in enumerate(self.taps):
                d = a + 2
                if taps.identity:
                    continue

                def bc(t: torch.Tensor, d: int = d) -> torch.Tensor:
                    return t.reshape([-1 if b == d else 1 for b in range(nd)])

                K = taps.index.shape[0]
                idx = [(taps.index[t, o0:o1] - i0).to(like.device) for t in range(K)]
                w = [None] * K if taps.weight is None else \
                    [bc(taps.weight[t, o0:o1].to(dtype=like.dtype, device=like.device))
                     for t in range(K)]
                ok: list[torch.Tensor | None] = [None] * K
                if taps.valid is not None:
                    for t in range(K):
                        v = taps.valid[t, o0:o1]
                        if not bool(v.all()):
                            ok[t] = bc(v.to(like.device))
                div = None if taps.divisor is None else \
                    bc(taps.divisor[o0:o1].to(dtype=like.dtype, device=like.device))
                ratio = (o1 - o0) / max(1, i1 - i0)
                ops.append(_DimOp(d, idx, w, ok, div, ratio))
            ops.sort(key=lambda op: op.ratio)  # shrink first: smaller intermediates
            self._ops[key] = ops
        return ops


class DistributedUpsample(DistributedModule):
    """Up- or down-sampling of a tensor partitioned over ``P_x`` = (P_b, P_c, P_0, ..),
    equal to ``torch.nn.Upsample(size, scale_factor, mode, align_corners,
    recompute_scale_factor)`` on the global tensor (a ``scale_factor`` < 1 or a smaller
    ``size`` down-samples).

    Modes: ``nearest``, ``nearest-exact``, ``area`` (1-3 spatial dims), ``linear`` (1),
    ``bilinear``/``bicubic`` (2), ``trilinear`` (3); the spatial rank is ``P_x.dim - 2``.
    ``align_corners`` only with the interpolating modes (default False). The output is
    block-balanced over ``P_x`` like the input; a halo wider than a neighbour's block
    comes over several hops (a geometry the halo cannot express is a :class:`HaloError` on
    every worker). Inactive ranks take and return zero-volume tensors. Bad options raise a
    ``ValueError`` naming the option at construction, on every rank.

    Without a spatial split (``P_x`` = (P_b, P_c, 1, ..)) every block holds whole spatial
    slices and the layer calls ``F.interpolate`` on it (torch's kernels and gradient),
    except in the nearest modes, whose torch gradient is not always the adjoint.
    """

    autocast = "probe"  # torch.autocast: 3-D area (adaptive pooling) in float32 on the CPU

    def autocast_probe(self, x):
        return F.interpolate(x, tuple(x.shape[2:]), None, self.mode, self._align_arg)

    #: linear modes by integer scales, outputs aligned with the blocks: torch's kernel on
    #: the block and the edge outputs from thin strips of the halo
    #: (:mod:`gpudist.nn.sampling_edges`) instead of resampling the extended block and
    #: cropping it (a copy of the output; False takes that path)
    edge_split: bool = True

    def __init__(self, P_x: Partition, size: int | Sequence[int] | None = None,
                 scale_factor: float | Sequence[float] | None = None, mode: str = "nearest",
                 align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        n = P_x.dim - 2
        if n not in (1, 2, 3):
            raise PartitionError(f"{name}: the input partition must have 3, 4 or 5 dimensions "
                                 f"(N, C and 1-3 spatial), got {P_x.shape}")
        if mode not in MODES:
            raise ValueError(f"{name}: unknown mode {mode!r} (choose from "
                             f"{', '.join(sorted(MODES))})")
        if n not in MODES[mode]:
            want = " or ".join(f"{r} spatial dim{'s' if r > 1 else ''}" for r in MODES[mode])
            raise ValueError(f"{name}: mode {mode!r} needs {want} (a {2 + MODES[mode][0]}-D "
                             f"partition), but P_x {P_x.shape} has {n}")
        if (size is None) == (scale_factor is None):
            raise ValueError(f"{name}: give exactly one of size or scale_factor, got "
                             f"size={size!r}, scale_factor={scale_factor!r}")
        if mode in _INTERPOLATING:
            align_corners = bool(align_corners) if align_corners is not None else False
        elif align_corners is not None:
            raise ValueError(f"{name}: align_corners option can only be set with the "
                             f"interpolating modes: linear | bilinear | bicubic | trilinear "
                             f"(mode={mode!r})")
        if recompute_scale_factor and size is not None:
            raise ValueError(f"{name}: recompute_scale_factor is not meaningful with an "
                             f"explicit size")
        self.P_x, self.spatial, self.mode = P_x, n, mode
        self.size = per_dim("size", name, size, n, int, allow_none=True, exact=True)
        self.scale_factor = per_dim("scale_factor", name, scale_factor, n, float,
                                    allow_none=True, exact=True)
        # (torch's area mode, an adaptive pooling, takes an output size of 0: empty output)
        if self.size is not None and any(s < (0 if mode == "area" else 1) for s in self.size):
            raise ValueError(f"{name}: size must be positive"
                             f"{' (or 0 in area mode)' if mode == 'area' else ''}, "
                             f"got {size!r}")
        if self.scale_factor is not None and not all(
                math.isfinite(s) and s > 0 for s in self.scale_factor):
            raise ValueError(f"{name}: scale_factor must be positive and finite, "
                             f"got {scale_factor!r}")
        self.align_corners = bool(align_corners)
        self._align_arg = align_corners
        self.recompute_scale_factor = recompute_scale_factor
        # torch: area always uses the output size (scale recomputed as L/M)
        self._recompute = bool(recompute_scale_factor) or mode == "area"
        self.setup(P_x, P_x.ranks)
        self.geo_cache = LRU(self.world.cache_size)
        self.halo = HaloExchange(P_x, geometry=self._geometry)
        # no spatial split: every block holds whole spatial slices, torch's op is exact --
        # but not torch's nearest backward, which is not always the adjoint of its forward
        # (the taps path's is)
        self.local_torch = all(s == 1 for s in P_x.shape[2:]) and \
            mode not in ("nearest", "nearest-exact")

    def extra_repr(self) -> str:
        s = f"size={self.size}" if self.size is not None else \
            f"scale_factor={self.scale_factor}"
        s += f", mode={self.mode!r}"
        if self.mode in _INTERPOLATING:
            s += f", align_corners={self.align_corners}"
        return s

    # -- shapes ---------------------------------------------------------------------
    def output_sizes(self, spatial: Sequence[int]) -> tuple[int, ...]:
        """Global output spatial sizes for global input spatial sizes ``spatial``."""
        out = []
        for a, L in enumerate(spatial):
            M = output_length(L, None if self.size is None else self.size[a],
                              None if self.scale_factor is None else self.scale_factor[a])
            if L < 1 or M < (0 if self.mode == "area" else 1):  # (area: as torch's)
                raise ShapeError(f"{self.name}: input and output sizes should be greater than "
                                 f"0 (an output of 0 only in area mode), got input "
                                 f"{tuple(spatial)} -> output {M} in spatial dim {a}")
            out.append(M)
        return tuple(out)

    def output_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Global output shape for a global input shape."""
        g = tuple(int(s) for s in global_shape)
        return g[:2] + self.output_sizes(g[2:])

    def scale_for(self, a: int) -> float | None:
        """The scale factor torch's index math sees in spatial dim ``a`` (None: L/M)."""
        if self.scale_factor is None or self._recompute:
            return None
        return self.scale_factor[a]

    def opmath(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the index math for inputs of ``dtype`` (area: integer math)."""
        return torch.float64 if self.mode == "area" else _opmath(dtype)

    def dims(self, spec: TensorSpec) -> tuple[tuple[HaloGeometry, ...], list[Taps]]:
        """Per-dim halo geometry and taps for an input tensor (cached; raises HaloError on
        every rank where the halo cannot express what a worker needs)."""
        return self.geo_cache.get_or_make(spec, lambda: self._dims(spec))

    def _dims(self, spec: TensorSpec):
        P, n = self.P_x, self.spatial
        g, dt = spec.global_shape, self.opmath(spec.dtype)
        require_nonempty(g, self.name)
        sizes = self.output_sizes(g[2:])
        geos = [HaloGeometry(g[0], P.shape[0], axis=0), HaloGeometry(g[1], P.shape[1], axis=1)]
        all_taps = []
        legacy = uses_legacy_nearest(sizes)
        for a in range(n):
            d, L, M = a + 2, g[a + 2], sizes[a]
            taps = source_taps(self.mode, L, M, self.align_corners, self.scale_for(a), dt,
                               legacy_nearest=legacy)
            outs = [block_range(M, P.shape[d], i) for i in range(P.shape[d])]
            needs = [taps.reads(*o) for o in outs]
            try:
                geos.append(HaloGeometry.from_intervals(L, outs, needs, axis=d))
            except HaloError as e:
                raise raised_everywhere(HaloError(
                    f"{self.name}: input size {L} -> output size {M} in spatial dim {a} over "
                    f"{P.shape[d]} workers: {e}")) from None
            all_taps.append(taps)
        return tuple(geos), all_taps

    def _geometry(self, spec: TensorSpec) -> tuple[HaloGeometry, ...]:
        return self.dims(spec)[0]

    def make_plan(self, spec: TensorSpec) -> _Plan:
        if not spec.standard or spec.ndim != self.spatial + 2:
            raise raised_everywhere(ShapeError(
                f"{self.name}: expected a {self.spatial + 2}-D block (N, C, spatial) split the "
                f"standard way, got {spec.describe()}"))
        out = self.output_shape(spec.global_shape)
        if self.local_torch or 0 in out[2:]:  # no halo needed: torch's op on each block,
            # or an empty output (area mode only: every block empty, no halo)
            return _TorchPlan(TensorSpec(self.P_x, out, spec.dtype, spec.device_type))
        return _Plan(self, spec)

    # -- forward ----------------------------------------------------------------------
    def run(self, x: torch.Tensor, plan) -> torch.Tensor:
        if isinstance(plan, _TorchPlan):
            if x.numel() == 0 or 0 in plan.out.local_shape:  # torch refuses empty blocks
                return x.new_zeros(plan.out.local_shape) + x.sum() * 0
            return F.interpolate(x, self.size, self.scale_factor, self.mode, self._align_arg,
                                 self.recompute_scale_factor)
        if plan.edges is not None:  # torch's kernel on the block, the edges from strips
            return upsample_edges(self.halo, plan.halo, plan.edges, x)
        y = self.halo.apply_plan(x, plan.halo)
        if plan.empty_out:
            return y.new_zeros(plan.out.local_shape) + y.sum() * 0
        if plan.fast is not None:  # torch's fused kernel on the extended block, cropped
            scales, crop = plan.fast
            full = F.interpolate(y, scale_factor=scales, mode=self.mode, align_corners=False)
            out = full[crop]
            return out if out.shape == full.shape else out.contiguous()
        for op in plan.ops(x):
            y = op.apply(y)
        if y is x:  # every dim an identity: still a new tensor, like torch
            y = x.clone()
        return y


@dataclass
class _TorchPlan:
    out: TensorSpec


def _check_2d(name: str, P_x: Partition) -> None:
    if P_x.dim != 4:
        raise PartitionError(f"{name}: the input partition must have 4 dimensions (N, C, H, W), "
                             f"got {P_x.shape}")


class DistributedUpsamplingNearest2d(DistributedUpsample):
    """As ``torch.nn.UpsamplingNearest2d``: ``DistributedUpsample`` with mode nearest."""

    def __init__(self, P_x: Partition, size: int | Sequence[int] | None = None,
                 scale_factor: float | Sequence[float] | None = None) -> None:
        _check_2d(type(self).__name__, P_x)
        super().__init__(P_x, size, scale_factor, mode="nearest")


class DistributedUpsamplingBilinear2d(DistributedUpsample):
    """As ``torch.nn.UpsamplingBilinear2d``: bilinear with ``align_corners=True``."""

    def __init__(self, P_x: Partition, size: int | Sequence[int] | None = None,
                 scale_factor: float | Sequence[float] | None = None) -> None:
        _check_2d(type(self).__name__, P_x)
        super().__init__(P_x, size, scale_factor, mode="bilinear", align_corners=True)


DistributedInterpolate = DistributedUpsample
"""Alias (``F.interpolate``'s name; down-sampling reads better with it)."""
