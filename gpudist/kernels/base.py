"""What the custom (Numba / CuPy) packers share: validation, dtype views, torch fallback.

Each call is described once per (tensor shape, strides, complex?, boxes) and the description
(buffer size, collapsed-box descriptor, its upload to the device) is cached, so a repeated
halo exchange pays only the launch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from .regions import WORD, Regions, describe, flat_base, normalize, real_view, total_numel
from .torch_pack import TorchPacker

PACK, UNPACK, ADD = 0, 1, 2
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


@dataclass
class Prepared:
    """One described call: ``n`` buffer elements; ``desc`` rows of ``3 + 2*ndim`` int64."""

    boxes: tuple
    n: int
    desc: np.ndarray
    ndim: int
    nboxes: int
    biggest: int
    uploaded: dict = field(default_factory=dict)


def _key(regions: Regions):
    try:
        hash(regions)
        return regions
    except TypeError:
        return tuple(tuple(tuple(p) for p in b) for b in regions)


class CustomPacker:
    """Base of the kernel-backed packers. Subclasses implement ``device_ok`` and ``_run``.

    Copies move raw storage words (every dtype); additions need a native add for the dtype
    (``add_dtypes``) -- otherwise, and for devices the kernels do not serve, the call goes
    to :class:`TorchPacker`, which gives the same result.
    """

    name = "custom"
    add_dtypes: frozenset = frozenset()
    cache_size = 512

    def __init__(self) -> None:
        self.fallback = TorchPacker()
        self._prep: OrderedDict = OrderedDict()

    # -- to implement -------------------------------------------------------
    def device_ok(self, device: torch.device) -> bool:
        raise NotImplementedError

    def _run(self, base: torch.Tensor, buf: torch.Tensor, prep: Prepared, mode: int) -> None:
        raise NotImplementedError

    # -- interface ----------------------------------------------------------
    def supports(self, device: torch.device, dtype: torch.dtype, add: bool = False) -> bool:
        if not self.device_ok(torch.device(device)):
            return False
        return (not add) or _REAL.get(dtype, dtype) in self.add_dtypes

    def prepare(self, t: torch.Tensor, regions: Regions) -> Prepared:
        """The cached description of ``regions`` of a tensor shaped and strided like ``t``."""
        key = (t.shape, t.stride(), t.is_complex(), _key(regions))
        p = self._prep.get(key)
        if p is not None:
            self._prep.move_to_end(key)
            return p
        boxes = normalize(t.shape, regions)
        n = total_numel(boxes)
        rt, rboxes = real_view(t, boxes)
        desc, ndim, biggest = describe(rboxes, rt.stride())
        p = Prepared(boxes, n, desc, ndim, len(rboxes), biggest)
        self._prep[key] = p
        if len(self._prep) > self.cache_size:
            self._prep.popitem(last=False)
        return p

    def _native(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 and all(s >= 0 for s in t.stride()) and self.device_ok(t.device)

    def pack(self, src: torch.Tensor, regions: Regions, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Copy the boxes of ``src`` into one contiguous buffer (C order, box after box)."""
        if not self._native(src):
            return self.fallback.pack(src, regions, out=out)
        prep = self.prepare(src, regions)
        n = prep.n
        if out is None:
            out = torch.empty(n, dtype=src.dtype, device=src.device)
        elif (out.numel() < n or out.dtype != src.dtype or not out.is_contiguous()
              or out.device != src.device):
            raise ValueError(f"pack buffer must be contiguous {src.dtype} on {src.device} "
                             f"with >= {n} elements")
        res = out if out.numel() == n else out.reshape(-1)[:n]
        if n:
            self._apply(src.detach() if src.requires_grad else src, res, prep, PACK)
        return res

    def unpack(self, buf: torch.Tensor, dst: torch.Tensor, regions: Regions, add: bool = False
               ) -> torch.Tensor:
        """Copy (``add=False``) or add (``add=True``) the buffer back into the boxes of ``dst``."""
        if (not self._native(dst) or (add and _REAL.get(dst.dtype, dst.dtype)
                                      not in self.add_dtypes)
                or buf.dtype != dst.dtype or buf.device != dst.device
                or not buf.is_contiguous()):
            return self.fallback.unpack(buf, dst, regions, add=add)
        prep = self.prepare(dst, regions)
        if buf.numel() < prep.n:
            raise ValueError(f"unpack buffer has {buf.numel()} elements, boxes need {prep.n}")
        if prep.n:
            if buf.numel() != prep.n or buf.dim() != 1:
                buf = buf.reshape(-1)[:prep.n]
            self._apply(dst.detach() if dst.requires_grad else dst, buf, prep,
                        ADD if add else UNPACK)
        return dst

    def _apply(self, t: torch.Tensor, buf: torch.Tensor, prep: Prepared, mode: int) -> None:
        if t.is_complex():
            t = torch.view_as_real(t)
            buf = torch.view_as_real(buf).reshape(-1)
        word = mode != ADD
        base = flat_base(t, word)
        if word:
            buf = buf.view(WORD[buf.element_size()])
        self._run(base, buf, prep, mode)
