"""Portable pack/unpack with torch indexing (any device, any dtype), one copy per box."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .regions import Regions, as_slices, box_numel, box_shape, normalize


class TorchPacker:
    """``pack``: boxes -> contiguous buffer (P). ``unpack``: buffer -> boxes (P^T, overwrite).

    ``unpack(add=True)`` adds instead of overwriting: the adjoint of pack when the boxes do
    not overlap, which is what a halo exchange's backward needs.
    """

    name = "torch"
    cache_size = 512

    def __init__(self) -> None:
        self._plans: OrderedDict = OrderedDict()

    def device_ok(self, device: torch.device) -> bool:
        return True

    def supports(self, device: torch.device, dtype: torch.dtype, add: bool = False) -> bool:
        return True

    def _plan(self, shape: torch.Size, regions: Regions) -> tuple[int, list]:
        """(total elements, [(slices, buffer offset, count, box shape)]) for the boxes."""
        try:
            key = (tuple(shape), regions)
            hash(key)
        except TypeError:
            key = (tuple(shape), tuple(tuple(tuple(p) for p in b) for b in regions))
        plan = self._plans.get(key)
        if plan is None:
            parts, off = [], 0
            for b in normalize(shape, regions):
                k = box_numel(b)
                if k:
                    parts.append((as_slices(b), off, k, box_shape(b)))
                off += k
            plan = (off, parts)
            self._plans[key] = plan
            if len(self._plans) > self.cache_size:
                self._plans.popitem(last=False)
        return plan

    def pack(self, src: torch.Tensor, regions: Regions, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        n, parts = self._plan(src.shape, regions)
        if out is None:
            out = torch.empty(n, dtype=src.dtype, device=src.device)
        elif out.numel() < n or out.dtype != src.dtype or not out.is_contiguous():
            raise ValueError(f"pack buffer must be contiguous {src.dtype} with >= {n} elements")
        flat = out.view(-1)
        for sl, off, k, shp in parts:
            flat[off:off + k].view(shp).copy_(src[sl])
        return flat[:n] if flat.numel() != n else out

    def unpack(self, buf: torch.Tensor, dst: torch.Tensor, regions: Regions, add: bool = False
               ) -> torch.Tensor:
        n, parts = self._plan(dst.shape, regions)
        if buf.numel() < n:
            raise ValueError(f"unpack buffer has {buf.numel()} elements, boxes need {n}")
        flat = buf.reshape(-1)
        for sl, off, k, shp in parts:
            part = flat[off:off + k].view(shp)
            if add:
                dst[sl].add_(part)
            else:
                dst[sl].copy_(part)
        return dst
