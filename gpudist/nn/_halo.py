"""Halo exchange for a local op that pads by itself (conv, pooling).

The halo gives each worker ``[halo | trimmed bulk | halo]``; the global padding at the
boundary is split: the symmetric part per dimension goes to the local torch op's own
``padding`` argument (no copy), the rest is added with ``F.pad``. A worker with nothing to
exchange or trim passes its block through untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..halo import HaloExchange


def exchange_for_op(halo: HaloExchange, x: torch.Tensor, fill: float, spatial: int
                    ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(H x with the asymmetric part of the padding, symmetric padding left to the op).

    ``halo`` must be built with ``pad_value=None`` over (N, C, spatial...) tensors.
    """
    if not halo.P_x.active:
        return halo(x), (0,) * spatial
    plan = halo.plan(halo.global_shape_of(x))
    pads = plan.pads[2:]
    sym = tuple(min(lr) for lr in pads)
    xh = x if plan.identity and not plan.steps else halo(x)
    rest = [v for (lo, hi), s in reversed(list(zip(pads, sym))) for v in (lo - s, hi - s)]
    if any(rest):
        xh = F.pad(xh, rest, value=fill)
    return xh, sym
