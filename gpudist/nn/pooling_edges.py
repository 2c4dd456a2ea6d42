"""Max pooling of a halo-exchanged block without copying the block into the halo buffer.

torch's max pool of the block alone, padded by ``E = halo + padding`` on both sides (its
``-inf`` padding), gives this worker's outputs on the same grid -- but for the windows
that reach into a halo. Those edge outputs are recomputed from thin strips of the working
buffer (the halo and a few bulk rows, ``-inf`` where the global padding is) and written
over the block's:

    y = maxpool(x, padding=E);   y[R_j] = maxpool(S_j)[crop_j]   (disjoint regions R_j)

Only the boundary shell the strips and the neighbours read goes into the working buffer.
Backward (hand-written, exact): torch's pool backward of the block, minus what it scattered
from the edge outputs (their block indices), plus the strips' scatter (their indices) into
the working buffer, which goes through H* and is added into the shell.

:class:`PoolEdgePlan` is the geometry (made once per input spec); :func:`max_pool_edges`
runs it. Used by the max-pooling layers where the grids agree (2-D and 3-D, no window
of padding only; with no halo at all it is torch's pool of the block, no copy); elsewhere
the layer pools the whole working buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..halo import HaloExchange
from ..halo.plan import Box, HaloPlan, Shell, numel, slices
from ..primitives import Plan
from ..primitives.base import layer_adjoint

_POOL = {2: F.max_pool2d, 3: F.max_pool3d}
_BACK = {2: torch.ops.aten.max_pool2d_with_indices_backward,
         3: torch.ops.aten.max_pool3d_with_indices_backward}


def padding_only_window(L: int, k: int, s: int, p: int, d: int, m: int) -> bool:
    """Whether some of the ``m`` pooling windows reads padding only (no entry of
    ``[0, L)``), which a dilation can cause."""
    o = torch.arange(m, dtype=torch.int64)
    first = o * s - p  # the first tap of each window
    j = (-first).clamp(min=0).add(d - 1).div(d, rounding_mode="floor")  # first tap >= 0
    return bool(((j >= k) | (first + j * d >= L)).any())


@dataclass(frozen=True)
class _Strip:
    """One edge region ``y_box`` of the output; the strip buffer's ``shape``, where the
    working-buffer slab ``src`` goes in it (``dst``; ``-inf`` elsewhere), the strip pool's
    ``padding`` and where the region sits in its output (``crop``)."""

    y_box: Box
    shape: tuple[int, ...]
    src: Box
    dst: Box
    padding: tuple[int, ...]
    crop: Box


@dataclass(frozen=True)
class PoolEdgePlan:
    """The split for one worker and one input spec (see the module docstring)."""

    padding: tuple[int, ...]  # E per spatial dim: the block pool's own padding
    strips: tuple[_Strip, ...]
    shell: Shell  # what the strips and the neighbours need in the working buffer

    @classmethod
    def make(cls, hp: HaloPlan, kernel: Sequence[int], stride: Sequence[int],
             dilation: Sequence[int], out_shape: Sequence[int]) -> PoolEdgePlan | None:
        """The split for halo plan ``hp`` (op padding ``hp.pads``) of an (N, C, spatial..)
        block with this worker's output block shape ``out_shape``; None where it does not
        apply (grids that differ, a padding torch refuses, tiny blocks)."""
        n = len(kernel)
        if n not in _POOL or hp.only_padding:
            return None
        full = tuple((0, w) for w in hp.work_shape)
        bb, W = hp.bulk_box, hp.work_shape
        if hp.out_box != full or bb[:2] != full[:2] or 0 in out_shape:
            return None
        E, dims = [], []
        for a in range(n):
            t = 2 + a
            k, s, d = kernel[a], stride[a], dilation[a]
            span = d * (k - 1) + 1
            P = hp.pads[t][0]  # torch's own (symmetric) padding; the rest is in W
            lo, L, hi = bb[t][0], bb[t][1] - bb[t][0], W[t] - bb[t][1]
            m = out_shape[t]
            e = lo + P  # the block's pool pads by e on both sides: the same grid if it
            if L < 1 or e > k // 2 or L + 2 * e < span or (L + 2 * e - span) // s + 1 != m:
                return None  # gives m outputs (windows past the true extent would not)
            if padding_only_window(L, k, s, e, d, m):  # the block's pool would report an
                return None  # index outside the block there (its backward writes there)
            halo_lo, halo_hi = lo - hp.inbuf[t][0], hi - hp.inbuf[t][1]  # W's -inf aside
            left = math.ceil(e / s) if halo_lo > 0 else 0
            i0 = max(0, math.ceil((lo + L + P - span + 1) / s)) if halo_hi > 0 else m
            if left > i0 or i0 * s - P < 0 and i0 < m:
                return None
            E.append(e)
            dims.append((k, s, span, P, left, i0, m))
        strips = []
        for a in range(n):
            t = 2 + a
            k, s, span, P, left, i0, m = dims[a]
            for side, (o0, o1) in (("left", (0, left)), ("right", (i0, m))):
                if o1 <= o0:
                    continue
                if side == "left":
                    q0, q1 = 0, min(W[t], (left - 1) * s - P + span)
                    at, length = P, P + q1  # -inf rows before the slab
                else:
                    q0, q1 = i0 * s - P, W[t]
                    at, length = 0, W[t] - q0 + P  # -inf rows after it
                if (length - span) // s + 1 < o1 - o0:
                    return None
                y_box, shape, src, dst, crop = [], [], [], [], []
                for u in range(len(W)):
                    if u == t:
                        y_box.append((o0, o1))
                        shape.append(length)
                        src.append((q0, q1))
                        dst.append((at, at + q1 - q0))
                        crop.append((0, o1 - o0))
                        continue
                    if u < 2:
                        r = full[u]
                    else:  # earlier dims skip their own edges (the regions are disjoint)
                        _, _, _, _, lu, iu, mu = dims[u - 2]
                        r = (lu, iu) if u < t else (0, mu)
                    y_box.append(r)
                    shape.append(W[u])
                    src.append(full[u])
                    dst.append(full[u])
                    crop.append(r)
                if numel(tuple(y_box)):
                    pad = tuple(0 if u == t else dims[u - 2][3] for u in range(2, len(W)))
                    strips.append(_Strip(tuple(y_box), tuple(shape), tuple(src), tuple(dst),
                                         pad, tuple(crop)))
        return cls(tuple(E), tuple(strips), Shell.of(hp, [st.src for st in strips]))


def max_pool_edges(H: HaloExchange, plan: Plan, ep: PoolEdgePlan, x: torch.Tensor,
                   kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
                   ) -> torch.Tensor:
    """This worker's max-pool outputs by the split (module docstring)."""
    return _EdgeMaxPool.apply(H, plan, ep, (tuple(kernel), tuple(stride), tuple(dilation)),
                              x.contiguous())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[1], -1)


class _EdgeMaxPool(torch.autograd.Function):
    """Forward: shell into the working buffer, H posted, the block's pool, H completed,
    the edge strips. Backward: the strips' part posted through H*, the block's pool
    adjoint by its indices, H* completed and added in."""

    @staticmethod
    def forward(ctx, H, plan, ep, pool, x):  # type: ignore[override]
        k, s, d = pool
        fn = _POOL[x.dim() - 2]
        with H.shell_exchange(x, plan, ep.shell) as ex:  # the block's pool overlaps it
            y, idx = fn(x, k, s, ep.padding, d, return_indices=True)
        W = ex.buffer
        strip_idx = []
        for i, st in enumerate(ep.strips):
            S = H.buffers.get(("strip", i), st.shape, x.dtype, x.device,  # -inf (the
                              init=lambda t: t.fill_(plan.local.fill))  # plan's) but the slab
            S[slices(st.dst)].copy_(W[slices(st.src)])
            ys, js = fn(S, k, s, st.padding, d, return_indices=True)
            y[slices(st.y_box)].copy_(ys[slices(st.crop)])
            strip_idx.append(js[slices(st.crop)].contiguous())
        ctx.save_for_backward(x, idx, *strip_idx)
        ctx.setup = (H, plan, ep, pool)
        return y

    @staticmethod
    @layer_adjoint  # double backward: torch's clear error; failures posted to the world
    def backward(ctx, gy):  # type: ignore[override]
        x, idx, *strip_idx = ctx.saved_tensors
        H, plan, ep, (k, s, d) = ctx.setup
        G = H.shell_gradient(plan, ep.shell, gy)
        for st, js in zip(ep.strips, strip_idx):  # first: their halo parts go out meanwhile
            gS = gy.new_zeros(st.shape)
            _flat(gS).scatter_add_(2, _flat(js), _flat(gy[slices(st.y_box)]))
            G[slices(st.src)] += gS[slices(st.dst)]
        with H.shell_return(G, plan):  # the block's pool adjoint overlaps H*
            gx = _BACK[x.dim() - 2](gy, x, k, s, ep.padding, d, False, idx)
            for st in ep.strips:  # what the block's pool scattered from these outputs
                _flat(gx).scatter_add_(2, _flat(idx[slices(st.y_box)]),  # is not theirs
                                       -_flat(gy[slices(st.y_box)]))
        H.shell_add(G, ep.shell, gx)
        return None, None, None, None, gx
