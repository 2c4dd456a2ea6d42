"""Boxes of a tensor and the flat views the custom kernels work on.

A *box* is one ``(start, stop)`` pair per tensor dimension; a list of boxes ("regions") maps
to one contiguous buffer holding each box in C order, one after the other. Custom kernels see
the tensor as a flat run of storage words (``base``) plus element strides, and the boxes as
an int64 descriptor ``[R, 2 + 2*D]`` of rows ``(buf_offset, count, start[D], size[D])``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

Box = tuple[tuple[int, int], ...]
Regions = Sequence[Sequence[tuple[int, int]]]

# raw storage word of each width: copies move words, so one kernel serves every dtype
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def normalize(shape: Sequence[int], regions: Regions) -> tuple[Box, ...]:
    """Validate boxes against ``shape``; return them as tuples of int pairs."""
    out = []
    for r, box in enumerate(regions):
        if len(box) != len(shape):
            raise ValueError(f"box {r} has {len(box)} dims but the tensor has {len(shape)}")
        b = []
        for d, (lo, hi) in enumerate(box):
            lo, hi = int(lo), int(hi)
            if not 0 <= lo <= hi <= shape[d]:
                raise ValueError(
                    f"box {r} range [{lo}, {hi}) in dim {d} is outside [0, {shape[d]}]"
                )
            b.append((lo, hi))
        out.append(tuple(b))
    return tuple(out)


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def box_views(buf: torch.Tensor, boxes: Sequence[Box], strides: Sequence[int]) -> tuple:
    """Per box, back to back in ``buf``: (its view of ``buf``, its shape, ``strides``, its
    offset in a contiguous tensor of those strides). A copy between the view and
    ``t.as_strided(shape, strides, t.storage_offset() + offset)`` packs or unpacks the box
    with no per-call planning (the torch packer's work, prepared once)."""
    out, at = [], 0
    for box in boxes:
        shape, n = box_shape(box), box_numel(box)
        out.append((buf[at:at + n].view(shape), shape, tuple(strides),
                    sum(lo * st for (lo, _), st in zip(box, strides))))
        at += n
    return tuple(out)


def total_numel(regions: Sequence[Box]) -> int:
    return sum(box_numel(b) for b in regions)


def as_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def real_view(t: torch.Tensor, regions: tuple[Box, ...]) -> tuple[torch.Tensor, tuple[Box, ...]]:
    """Complex tensors as real ones with a trailing dim of 2 (boxes extended to cover it)."""
    if t.is_complex():
        return torch.view_as_real(t), tuple(b + ((0, 2),) for b in regions)
    return t, regions


def flat_base(t: torch.Tensor, word: bool) -> torch.Tensor:
    """1-D view of ``t``'s storage from its first element to its last (non-negative strides).

    ``word=True`` reinterprets the elements as unsigned storage words of the same width.
    """
    if t.is_contiguous():
        base = t.view(-1)
    else:
        if any(s < 0 for s in t.stride()):
            raise ValueError("negative strides are not supported")
        span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        base = t.as_strided((span,), (1,), t.storage_offset())
    if word:
        base = base.view(WORD[t.element_size()])
    return base


def collapse(box: Box, strides: Sequence[int]) -> tuple[int, list[int], list[int]]:
    """A box as ``(base_offset, sizes, strides)`` with as few dims as possible.

    Drops unit dims and merges a dim into the next inner one when its stride equals the inner
    stride times the inner size (then ``i*st_out + j*st_in == (i*size_in + j)*st_in``), so
    most halo faces become 1-D or 2-D walks.
    """
    base = sum(lo * st for (lo, _), st in zip(box, strides))
    out_sz: list[int] = []
    out_st: list[int] = []
    for (lo, hi), st in zip(box, strides):
        sz = hi - lo
        if sz == 1:
            continue
        if out_sz and out_st[-1] == st * sz:
            out_sz[-1] *= sz
            out_st[-1] = st
            continue
        out_sz.append(sz)
        out_st.append(st)
    if not out_sz:
        out_sz, out_st = [1], [1]
    return base, out_sz, out_st


def describe(regions: tuple[Box, ...], strides: Sequence[int]) -> tuple[np.ndarray, int, int]:
    """Flat int64 descriptor of ``regions`` plus its common ``ndim`` and the largest box.

    One row of ``3 + 2*ndim`` entries per box: ``buf_offset, count, base_offset,
    size[ndim], stride[ndim]`` (collapsed boxes, left-padded with unit dims).
    """
    cols = [collapse(b, strides) for b in regions]
    D = max(len(c[1]) for c in cols) if cols else 1
    row = 3 + 2 * D
    out = np.zeros(len(regions) * row, dtype=np.int64)
    off, p, biggest = 0, 0, 0
    for box, (base, sz, st) in zip(regions, cols):
        n = box_numel(box)
        pad = D - len(sz)
        out[p:p + 3] = (off, n, base)
        out[p + 3:p + 3 + D] = [1] * pad + sz
        out[p + 3 + D:p + 3 + 2 * D] = [0] * pad + st
        off += n
        p += row
        biggest = max(biggest, n)
    return out, D, biggest
