"""A distributed convolution's local step without copying the block into the halo buffer.

With halos ``h`` around the block ``x`` (and zero padding), linearity splits the local conv:

    conv([h | x | h]) = conv(x, padding=E)  +  conv([h | 0 | h])

where ``E`` is the halo width plus the padding (equal on both sides of each dimension, else
this form does not apply). The first term is torch's conv on the block as it is; the second
is nonzero only near the block's boundary and is computed on thin strips, one per face.
Only the block's boundary shell (what the neighbours need) is copied into the exchange's
working buffer. Adjoint (hand-written): the conv adjoints give the block's gradient and the
strips' gradients; the strips' halo parts go back through H* and are added into the shell.
The block's conv (and its adjoint) runs while the exchange's first step is in flight.

:class:`BoundaryStrips` is the plan (pure geometry, made once per input spec);
:func:`conv_with_strips` runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..halo import HaloExchange
from ..halo.plan import Box, HaloPlan, Shell, slices
from ..primitives import Plan
from ..primitives.base import layer_adjoint

_CONV = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d,
         3: torch.nn.functional.conv3d}
_CONV_BACK = torch.ops.aten.convolution_backward


@dataclass(frozen=True)
class _Strip:
    """One face: the strip buffer's shape, where the halo slab goes in it (``dst``) and
    comes from in the working buffer (``src``), the strip conv's padding and the output
    range it corrects (``out``, along tensor dim ``dim``)."""

    dim: int
    shape: tuple[int, ...]
    dst: Box
    src: Box
    padding: tuple[int, ...]
    out: tuple[int, int]


@dataclass(frozen=True)
class BoundaryStrips:
    """Geometry of the split for one worker and one input spec (see the module docstring):
    ``padding`` of the block's conv, the strips, and the ``shell`` of the working buffer
    the exchange and the strips need."""

    padding: tuple[int, ...]
    strips: tuple[_Strip, ...]
    shell: Shell

    @classmethod
    def make(cls, hp: HaloPlan, kernel: Sequence[int], stride: Sequence[int],
             dilation: Sequence[int], pads: Sequence[int], out_shape: Sequence[int]
             ) -> BoundaryStrips | None:
        """The split for halo plan ``hp`` of an (N, C, spatial...) tensor, or None where it
        does not apply (trimmed blocks, unequal extensions, nothing to exchange)."""
        if hp.passthrough or hp.only_padding or not hp.steps:
            return None
        ob, bb = hp.out_box, hp.bulk_box
        if tuple((0, n) for n in hp.work_shape) != ob or ob[:2] != bb[:2]:
            return None
        if any(b1 <= b0 for b0, b1 in bb[2:]):  # an empty block: torch's conv refuses it
            return None
        ext = []
        for a, ((o0, o1), (b0, b1), p) in enumerate(zip(ob[2:], bb[2:], pads)):
            lo, hi = b0 - o0 + p, o1 - b1 + p
            total = lo + (b1 - b0) + hi
            k, s, d = kernel[a], stride[a], dilation[a]
            if lo != hi or o0 > b0 or b1 > o1 or (total - d * (k - 1) - 1) // s + 1 != \
                    out_shape[2 + a]:
                return None
            ext.append(lo)
        strips: list[_Strip] = []  # per face (earlier dims: bulk only)
        n = len(ext)
        for a in range(n):
            t = 2 + a
            k, s, d, p, E = kernel[a], stride[a], dilation[a], pads[a], ext[a]
            (o0, o1), (b0, b1) = ob[t], bb[t]
            span_all = E + (b1 - b0) + E
            m = out_shape[t]

            def add_strip(src_lo: int, src_hi: int, dst_lo: int, length: int,
                          out: tuple[int, int], t: int = t) -> None:
                """A strip of ``length`` along dim ``t`` holding the slab ``[src_lo, src_hi)``
                of the working buffer at ``dst_lo``, correcting outputs ``out``."""
                if src_hi <= src_lo:
                    return
                src, dst, shape = [], [], []
                for u in range(len(ob)):
                    if u == t:
                        src.append((src_lo, src_hi))
                        dst.append((dst_lo, dst_lo + src_hi - src_lo))
                        shape.append(length)
                    elif u < 2:
                        src.append(bb[u])
                        dst.append(bb[u])
                        shape.append(bb[u][1])
                    else:  # earlier spatial dims: bulk only (their own faces hold the rest)
                        lo_, hi_ = bb[u] if u < t else ob[u]
                        src.append((lo_, hi_))
                        dst.append((lo_ - ob[u][0], hi_ - ob[u][0]))
                        shape.append(ob[u][1] - ob[u][0])
                pad = tuple(0 if u == t else pads[u - 2] for u in range(2, len(ob)))
                strips.append(_Strip(t, tuple(shape), tuple(dst), tuple(src), pad, out))

            # left face: outputs [0, c) read it; the strip spans their windows
            c = min(m, math.ceil(E / s))
            halo_lo, halo_hi = b0 - o0 - hp.inbuf[t][0], o1 - b1 - hp.inbuf[t][1]
            if c > 0 and halo_lo > 0:  # a face of global padding only adds zeros
                span = (c - 1) * s + d * (k - 1) + 1
                top = min(E, span) - p  # slab positions the strip holds (after the pad)
                add_strip(o0, o0 + max(0, top), p, span, (0, c))
            # right face: outputs [i0, m) read it
            i0 = max(0, math.ceil((E + (b1 - b0) - d * (k - 1)) / s))
            if i0 < m and halo_hi > 0:
                u0 = i0 * s
                first = max(E + (b1 - b0), u0)  # first slab position the strip holds
                add_strip(b1 + first - (E + (b1 - b0)), o1, first - u0, span_all - u0,
                          (i0, m))
        return cls(tuple(ext), tuple(strips), Shell.of(hp, [st.src for st in strips]))


def conv_with_strips(H: HaloExchange, plan: Plan, sp: BoundaryStrips, x: torch.Tensor,
                     w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int],
                     dilation: Sequence[int], groups: int) -> torch.Tensor:
    """The local conv of a halo-exchanged block, by the split (see the module docstring)."""
    return _StripConv.apply(H, plan, sp, (tuple(stride), tuple(dilation), groups), x, w, b)


class _StripConv(torch.autograd.Function):
    """Forward: shell into the working buffer, H posted, conv of the block, H completed,
    strip corrections. Backward: the strips' adjoints, their halo gradients posted through
    H*, the block's conv adjoint, H* completed and added into the shell."""

    @staticmethod
    def forward(ctx, H, plan, sp, conv, x, w, b):  # type: ignore[override]
        stride, dilation, groups = conv
        fn = _CONV[x.dim() - 2]
        with H.shell_exchange(x, plan, sp.shell) as ex:  # the block's conv overlaps it
            y = fn(x, w, b, stride, sp.padding, dilation, groups)
        W = ex.buffer
        strips = []
        for i, st in enumerate(sp.strips):
            S = H.buffers.get(("strip", i), st.shape, x.dtype, x.device,
                              init=torch.Tensor.zero_)  # zero but for the slab, always
            S[slices(st.dst)].copy_(W[slices(st.src)])
            y.narrow(st.dim, st.out[0], st.out[1] - st.out[0]).add_(
                fn(S, w, None, stride, st.padding, dilation, groups))
            strips.append(S)
        ctx.save_for_backward(x, w, *strips)
        ctx.setup = (H, plan, sp, conv, b is not None)
        return y

    @staticmethod
    @layer_adjoint  # double backward: torch's clear error; failures posted to the world
    def backward(ctx, gy):  # type: ignore[override]
        x, w, *strips = ctx.saved_tensors
        H, plan, sp, (stride, dilation, groups), has_b = ctx.setup
        need_x, need_w, need_b = ctx.needs_input_grad[4:7]
        need_b = need_b and has_b
        zeros = [0] * (x.dim() - 2)
        back = _CONV_BACK
        if need_x:  # H* runs where the input needs a gradient, as the primitive's would
            G = H.shell_gradient(plan, sp.shell, gy)
        gws = []
        for st, S in zip(sp.strips, strips):  # first: their halo parts go out meanwhile
            g = gy.narrow(st.dim, st.out[0], st.out[1] - st.out[0]).contiguous()
            gS, gwS, _ = back(g, S, w, None, stride, st.padding, dilation, False, zeros,
                              groups, [need_x, need_w, False])
            if need_x:
                G[slices(st.src)].copy_(gS[slices(st.dst)])
            gws.append(gwS)

        def block():
            return back(gy, x, w, [w.shape[0]] if has_b else None, stride, sp.padding,
                        dilation, False, zeros, groups, [need_x, need_w, need_b])

        if need_x:
            with H.shell_return(G, plan):  # the block's conv adjoint overlaps H*
                gx, gw, gb = block()
            H.shell_add(G, sp.shell, gx)
        else:
            gx, gw, gb = block()
        if need_w:
            for gwS in gws:
                gw += gwS
        return None, None, None, None, gx, gw, gb
