"""Portable pack/unpack with torch indexing (any device, any dtype), one copy per box."""

from __future__ import annotations

import torch

from .regions import Regions, as_slices, box_numel, box_shape, normalize, total_numel


class TorchPacker:
    """``pack``: boxes -> contiguous buffer (P). ``unpack``: buffer -> boxes (P^T, overwrite).

    ``unpack(add=True)`` adds instead of overwriting: the adjoint of pack when the boxes do
    not overlap, which is what a halo exchange's backward needs.
    """

    name = "torch"

    def device_ok(self, device: torch.device) -> bool:
        return True

    def supports(self, device: torch.device, dtype: torch.dtype, add: bool = False) -> bool:
        return True

    def pack(self, src: torch.Tensor, regions: Regions, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        boxes = normalize(src.shape, regions)
        n = total_numel(boxes)
        if out is None:
            out = torch.empty(n, dtype=src.dtype, device=src.device)
        elif out.numel() < n or out.dtype != src.dtype or not out.is_contiguous():
            raise ValueError(f"pack buffer must be contiguous {src.dtype} with >= {n} elements")
        off = 0
        for b in boxes:
            k = box_numel(b)
            if k:
                out[off:off + k].view(box_shape(b)).copy_(src[as_slices(b)])
            off += k
        return out[:n] if out.numel() != n else out

    def unpack(self, buf: torch.Tensor, dst: torch.Tensor, regions: Regions, add: bool = False
               ) -> torch.Tensor:
        boxes = normalize(dst.shape, regions)
        n = total_numel(boxes)
        if buf.numel() < n:
            raise ValueError(f"unpack buffer has {buf.numel()} elements, boxes need {n}")
        flat = buf.reshape(-1)
        off = 0
        for b in boxes:
            k = box_numel(b)
            if k:
                view = dst[as_slices(b)]
                part = flat[off:off + k].view(box_shape(b))
                if add:
                    view.add_(part)
                else:
                    view.copy_(part)
            off += k
        return dst
