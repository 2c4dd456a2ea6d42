"""Linear up-sampling of a halo-exchanged block without resampling the halos.

For the linear modes (``align_corners=False``, integer scale ``k`` per dimension) torch's
kernel on the block alone already gives this worker's outputs everywhere but in the first
and last ``c = k // 2 + 1`` outputs of each dimension that has a halo on that side (there
it clamps at the block's edge, where the global tensor goes on). So:

    y = interp(x);   y[R_j] = interp(S_j)[crop_j]   for each edge region R_j

where ``S_j`` is a thin strip of the halo-extended block (``r`` bulk rows and the halo) and
the regions ``R_j`` are disjoint (a later dimension's regions skip the earlier ones'
edges). No copy of the block, none of the output: only the boundary shell the strips and
the neighbours read goes into the exchange's working buffer. Adjoint (hand-written, exact):

    dx = interp*(dy) - sum_j interp_j*(dy[R_j])   (the block's own map on R_j, taken back
                                                  on ``r`` block rows)
    dS_j = strip_j*(dy[R_j]) into the working buffer, then H*, added into dx's shell.

:class:`EdgePlan` is the geometry (pure, made once per input spec); :func:`upsample_edges`
runs it. Used by :class:`gpudist.nn.DistributedUpsample` where the outputs align with the
blocks (``o0 = k b0``); elsewhere the layer resamples the extended block and crops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checkpoint import mark, region, top_hooks
from ..halo import HaloExchange
from ..halo.plan import Box, HaloPlan, Shell, numel, slices
from ..primitives import Plan
from ..primitives.base import layer_adjoint

_MODE = {1: "linear", 2: "bilinear", 3: "trilinear"}


def _interp_backward(g: torch.Tensor, in_shape: Sequence[int], scales: Sequence[float]
                     ) -> torch.Tensor:
    """The adjoint of ``F.interpolate(., scale_factor=scales, mode=linear-kind)`` at an
    input of ``in_shape`` (torch's own backward kernel)."""
    out, ins, aten = list(g.shape[2:]), list(in_shape), torch.ops.aten
    g = g.contiguous()
    if len(scales) == 1:
        return aten.upsample_linear1d_backward(g, out, ins, False, scales[0])
    if len(scales) == 2:
        return aten.upsample_bilinear2d_backward(g, out, ins, False, *scales)
    return aten.upsample_trilinear3d_backward(g, out, ins, False, *scales)


@dataclass(frozen=True)
class _Edge:
    """One edge region: ``y_box`` in the output; its strip ``strip`` (working-buffer box)
    and where the region sits in the strip's interpolation (``strip_crop``); the block rows
    ``block`` (along ``dim``) that give the region by the block's own map, and where it sits
    in their interpolation (``block_crop``)."""

    dim: int
    y_box: Box
    strip: Box
    strip_crop: Box
    block: tuple[int, int]
    block_crop: Box


@dataclass(frozen=True)
class EdgePlan:
    """The split for one worker and one input spec (see the module docstring)."""

    scales: tuple[float, ...]
    edges: tuple[_Edge, ...]
    shell: Shell  # what the strips and the neighbours need in the working buffer

    @classmethod
    def make(cls, hp: HaloPlan, ks: Sequence[int], outputs: Sequence[tuple[int, int]],
             bulks: Sequence[tuple[int, int]], sizes: Sequence[int]) -> EdgePlan | None:
        """The split for halo plan ``hp`` of an (N, C, spatial..) block with integer scales
        ``ks``, this worker's global output ranges ``outputs``, block ranges ``bulks`` and
        global input sizes ``sizes`` per spatial dim; None where it does not apply."""
        if hp.passthrough or hp.only_padding:
            return None
        full = tuple((0, n) for n in hp.work_shape)
        bb = hp.bulk_box
        if hp.out_box != full or bb[:2] != full[:2]:
            return None
        n = len(ks)
        lo = [bb[2 + a][0] for a in range(n)]
        L = [bb[2 + a][1] - bb[2 + a][0] for a in range(n)]
        hi = [hp.work_shape[2 + a] - bb[2 + a][1] for a in range(n)]
        c = [k // 2 + 1 for k in ks]
        r = [-(-ci // k) + 1 for ci, k in zip(c, ks)]
        fixed = []
        for a, k in enumerate(ks):
            (o0, o1), (b0, b1) = outputs[a], bulks[a]
            if (o0, o1) != (k * b0, k * b1) or L[a] < 1:
                return None
            left, right = lo[a] > 0, hi[a] > 0
            # a side without a halo must be the global edge (torch clamps there too)
            if (not left and b0 != 0 and k != 1) or (not right and b1 != sizes[a] and k != 1):
                return None
            if (left or right) and (r[a] > L[a] or 2 * c[a] > k * L[a]):
                return None
            fixed.append((left, right))
        W = hp.work_shape
        edges = []
        for a in range(n):
            t, k = 2 + a, ks[a]
            for side, on in (("left", fixed[a][0]), ("right", fixed[a][1])):
                if not on:
                    continue
                y_box, strip, s_crop, b_crop = [], [], [], []
                for u in range(len(W)):
                    if u < 2:
                        y_box.append(full[u])
                        strip.append(full[u])
                        s_crop.append(full[u])
                        b_crop.append(full[u])
                        continue
                    e, ke = u - 2, ks[u - 2]
                    if u == t:
                        if side == "left":
                            ry, rs = (0, c[a]), (0, lo[a] + r[a])
                            sc, bc = (k * lo[a], k * lo[a] + c[a]), (0, c[a])
                        else:
                            ry = (k * L[a] - c[a], k * L[a])
                            rs = (lo[a] + L[a] - r[a], W[u])
                            sc = bc = (k * r[a] - c[a], k * r[a])
                        y_box.append(ry)
                        strip.append(rs)
                        s_crop.append(sc)
                        b_crop.append(bc)
                        continue
                    if u < t:  # earlier dims: skip their own edge regions (disjoint)
                        e0 = c[e] if fixed[e][0] else 0
                        e1 = ke * L[e] - (c[e] if fixed[e][1] else 0)
                    else:
                        e0, e1 = 0, ke * L[e]
                    y_box.append((e0, e1))
                    strip.append((0, W[u]))  # the halos both ways: right values along u
                    s_crop.append((ke * lo[e] + e0, ke * lo[e] + e1))
                    b_crop.append((e0, e1))
                blk = (0, r[a]) if side == "left" else (L[a] - r[a], L[a])
                if numel(tuple(y_box)):
                    edges.append(_Edge(t, tuple(y_box), tuple(strip), tuple(s_crop), blk,
                                       tuple(b_crop)))
        if not edges:
            return None
        return cls(tuple(float(k) for k in ks), tuple(edges),
                   Shell.of(hp, [e.strip for e in edges]))


def upsample_edges(H: HaloExchange, plan: Plan, ep: EdgePlan, x: torch.Tensor
                   ) -> torch.Tensor:
    """This worker's outputs of a linear up-sampling by the split (module docstring)."""
    m = mark(x) if top_hooks(False) is not None and region() else None
    return _EdgeUpsample.apply(H, plan, ep, x, m)


class _EdgeUpsample(torch.autograd.Function):
    """Forward: shell into the working buffer, H posted, the block's interpolation, H
    completed, the edge regions from the strips. Backward: the strips' gradients posted
    through H*, the block's adjoint, H* completed and added in."""

    @staticmethod
    def forward(ctx, H, plan, ep, x, m):  # type: ignore[override]
        mode = _MODE[x.dim() - 2]
        with H.shell_exchange(x, plan, ep.shell) as ex:  # the block's map overlaps it
            y = F.interpolate(x, scale_factor=ep.scales, mode=mode, align_corners=False)
        W = ex.buffer
        for e in ep.edges:
            s = F.interpolate(W[slices(e.strip)], scale_factor=ep.scales, mode=mode,
                              align_corners=False)
            y[slices(e.y_box)].copy_(s[slices(e.strip_crop)])
        ctx.setup = (H, plan, ep, tuple(x.shape))
        ctx.marked = m is not None
        if m is not None:  # a checkpoint region's marker (gpudist.checkpoint)
            ctx.save_for_backward(m)
        return y

    @staticmethod
    @layer_adjoint  # double backward: torch's clear error; failures posted to the world
    def backward(ctx, gy):  # type: ignore[override]
        H, plan, ep, x_shape = ctx.setup
        if ctx.marked:
            ctx.saved_tensors  # noqa: B018 - unpacked: the region is recomputed first
        sc = ep.scales
        G = H.shell_gradient(plan, ep.shell, gy)
        for e in ep.edges:  # first, the strips' maps taken back: they go out meanwhile
            sshape = [q - p for p, q in e.strip]
            gs = gy.new_zeros(_out_shape(sshape, sc))
            gs[slices(e.strip_crop)] = gy[slices(e.y_box)]
            G[slices(e.strip)].add_(_interp_backward(gs, sshape, sc))
        with H.shell_return(G, plan):  # the block's adjoint overlaps H*
            gx = _interp_backward(gy, x_shape, sc)
            for e in ep.edges:
                # the block's own map on this region, taken back (not the output there)
                b0, b1 = e.block
                bshape = list(x_shape)
                bshape[e.dim] = b1 - b0
                gb = gy.new_zeros(_out_shape(bshape, sc))
                gb[slices(e.block_crop)] = gy[slices(e.y_box)]
                gx.narrow(e.dim, b0, b1 - b0).sub_(_interp_backward(gb, bshape, sc))
        H.shell_add(G, ep.shell, gx)
        return None, None, None, gx, None


def _out_shape(in_shape: Sequence[int], scales: Sequence[float]) -> list[int]:
    """The shape of interpolating an input of ``in_shape`` by the integer ``scales``."""
    return list(in_shape[:2]) + [int(s) * n for s, n in zip(scales, in_shape[2:])]
