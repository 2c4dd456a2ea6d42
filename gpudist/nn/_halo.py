"""Halo exchange for a local op that pads by itself (conv, pooling).

The halo (built with ``pad_value=fill, op_padding=True``) writes ``[halo | trimmed bulk |
halo]`` plus the asymmetric part of the global padding into one buffer; the symmetric part
per dimension goes to the local torch op's own ``padding`` argument. A worker with nothing
to exchange, trim or pad gets its block back untouched (no copy).
"""

from __future__ import annotations

import torch

from ..halo import HaloExchange


def op_halo(P_x, kernel_size, stride, padding, dilation, fill: float, **kw) -> HaloExchange:
    """A :class:`HaloExchange` that leaves the symmetric padding to the local op."""
    return HaloExchange(P_x, kernel_size, stride, padding, dilation, pad_value=fill,
                        op_padding=True, **kw)


def exchange_for_op(halo: HaloExchange, x: torch.Tensor, spatial: int
                    ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(H x with the asymmetric padding, the symmetric padding the op adds per spatial dim)."""
    if not halo.P_x.active:
        return halo(x), (0,) * spatial
    xh = halo(x)
    return xh, tuple(lo for lo, _ in halo.last_plan.pads[2:])
