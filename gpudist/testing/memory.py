"""The seed's memory model: tiny explicit linear operators on a set of named buffers.

A *memory* is a dict ``name -> tensor``; each operator maps memories to memories and has an
exact adjoint. They are the reference model the fast primitives are checked against:

* ``Allocate(b, shape)``: add a zero buffer ``b``; adjoint ``Deallocate(b)`` drops it.
* ``Clear(b[, sl])``: zero (part of) ``b``; self-adjoint.
* ``Add(a, b[, sa, sb])``: ``b[sb] += a[sa]``; adjoint ``Add(b, a, sb, sa)``.
* ``copy`` = Add after Clear of the target (in place) or after Allocate (out of place);
  ``move`` = Clear of the source after a copy (or Deallocate after an out-of-place copy).

Compose with ``@`` (``(A @ B)(m) == A(B(m))``); ``.adjoint()`` reverses the order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Memory = dict[str, torch.Tensor]
Slices = tuple[slice, ...]
_ALL: Slices = (slice(None),)


class MemoryOp:
    """A linear operator on memories."""

    def __call__(self, m: Memory) -> Memory:
        raise NotImplementedError

    def adjoint(self) -> MemoryOp:
        raise NotImplementedError

    def __matmul__(self, other: MemoryOp) -> MemoryOp:
        return Compose((self, other))


@dataclass(frozen=True)
class Compose(MemoryOp):
    ops: tuple[MemoryOp, ...]  # applied right to left

    def __call__(self, m: Memory) -> Memory:
        for op in reversed(self.ops):
            m = op(m)
        return m

    def adjoint(self) -> MemoryOp:
        return Compose(tuple(op.adjoint() for op in reversed(self.ops)))


@dataclass(frozen=True)
class Allocate(MemoryOp):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float64

    def __call__(self, m: Memory) -> Memory:
        if self.name in m:
            raise KeyError(f"buffer {self.name!r} already allocated")
        return {**m, self.name: torch.zeros(self.shape, dtype=self.dtype)}

    def adjoint(self) -> MemoryOp:
        return Deallocate(self.name, self.shape, self.dtype)


@dataclass(frozen=True)
class Deallocate(MemoryOp):
    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float64

    def __call__(self, m: Memory) -> Memory:
        return {k: v for k, v in m.items() if k != self.name}

    def adjoint(self) -> MemoryOp:
        return Allocate(self.name, self.shape, self.dtype)


@dataclass(frozen=True)
class Clear(MemoryOp):
    name: str
    sl: Slices = _ALL

    def __call__(self, m: Memory) -> Memory:
        b = m[self.name].clone()
        b[self.sl] = 0
        return {**m, self.name: b}

    def adjoint(self) -> MemoryOp:
        return self


@dataclass(frozen=True)
class Add(MemoryOp):
    src: str
    dst: str
    src_sl: Slices = _ALL
    dst_sl: Slices = _ALL

    def __call__(self, m: Memory) -> Memory:
        b = m[self.dst].clone()
        b[self.dst_sl] += m[self.src][self.src_sl]
        return {**m, self.dst: b}

    def adjoint(self) -> MemoryOp:
        return Add(self.dst, self.src, self.dst_sl, self.src_sl)


def copy(src: str, dst: str, src_sl: Slices = _ALL, dst_sl: Slices = _ALL) -> MemoryOp:
    """In-place copy: ``dst[dst_sl] = src[src_sl]`` (Add after Clear)."""
    return Add(src, dst, src_sl, dst_sl) @ Clear(dst, dst_sl)


def copy_new(src: str, dst: str, shape: Sequence[int], src_sl: Slices = _ALL) -> MemoryOp:
    """Out-of-place copy into a new buffer (Add after Allocate)."""
    return Add(src, dst, src_sl, _ALL) @ Allocate(dst, tuple(shape))


def move(src: str, dst: str, src_sl: Slices = _ALL, dst_sl: Slices = _ALL) -> MemoryOp:
    """In-place move: copy, then clear the source."""
    return Clear(src, src_sl) @ copy(src, dst, src_sl, dst_sl)


def inner(a: Memory, b: Memory) -> float:
    """<a, b> over the buffers both memories hold (float64)."""
    return float(sum((a[k].double() * b[k].double()).sum() for k in a if k in b))


def random_memory(shapes: dict[str, Sequence[int]], seed: int = 0) -> Memory:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(tuple(s), generator=g, dtype=torch.float64) for k, s in shapes.items()}


@dataclass
class Layout:
    """Buffer shapes before and after an operator (for adjoint tests)."""

    before: dict[str, tuple[int, ...]] = field(default_factory=dict)
    after: dict[str, tuple[int, ...]] = field(default_factory=dict)
