"""Portable pack/unpack with torch indexing (any device, any dtype), one copy per box."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .regions import Regions, as_slices, box_numel, box_shape, dense_strides, normalize


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
        """(total elements, [(slices, buffer offset, box shape, its dense strides, box
        strides, box offset)]) for the boxes; the last two are those of the box in a
        contiguous tensor of ``shape`` (one ``as_strided`` instead of indexing: cheaper
        per call)."""
        try:
            key = (tuple(shape), regions)
            hash(key)
        except TypeError:
            key = (tuple(shape), tuple(tuple(tuple(p) for p in b) for b in regions))
        plan = self._plans.get(key)
        if plan is None:
            strides = dense_strides(shape)
            parts, off = [], 0
            for b in normalize(shape, regions):
                k = box_numel(b)
                if k:
                    at = sum(lo * st for (lo, _), st in zip(b, strides))
                    shp = box_shape(b)
                    parts.append((as_slices(b), off, shp, dense_strides(shp), strides, at))
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
        o0 = out.storage_offset()
        if src.is_contiguous():
            s0 = src.storage_offset()
            for _, off, shp, dense, st, at in parts:
                out.as_strided(shp, dense, o0 + off).copy_(src.as_strided(shp, st, s0 + at))
        else:
            for sl, off, shp, dense, _, _ in parts:
                out.as_strided(shp, dense, o0 + off).copy_(src[sl])
        return out.view(-1)[:n] if out.numel() != n else out

    def unpack(self, buf: torch.Tensor, dst: torch.Tensor, regions: Regions, add: bool = False
               ) -> torch.Tensor:
        n, parts = self._plan(dst.shape, regions)
        if buf.numel() < n:
            raise ValueError(f"unpack buffer has {buf.numel()} elements, boxes need {n}")
        if not buf.is_contiguous():
            buf = buf.contiguous()
        b0 = buf.storage_offset()
        dense = dst.is_contiguous()
        d0 = dst.storage_offset()
        for sl, off, shp, dense_b, st, at in parts:
            part = buf.as_strided(shp, dense_b, b0 + off)
            view = dst.as_strided(shp, st, d0 + at) if dense else dst[sl]
            if add:
                view.add_(part)
            else:
                view.copy_(part)
        return dst

