"""Block decomposition of a global tensor shape over a Cartesian partition shape.

Dimension ``d`` of size ``G[d]`` over ``S[d]`` workers gives worker ``i`` a block of
``G[d] // S[d] + (1 if i < G[d] % S[d] else 0)`` entries: the remainder goes to the lowest
indices, and uneven blocks are normal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .errors import ShapeError


def block_sizes(n: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` blocks of a length-``n`` dimension."""
    if parts < 1:
        raise ShapeError(f"cannot split a dimension over {parts} workers")
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def block_starts(n: int, parts: int) -> list[int]:
    """Start offsets of the ``parts`` blocks of a length-``n`` dimension."""
    starts, s = [], 0
    for b in block_sizes(n, parts):
        starts.append(s)
        s += b
    return starts


def block_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """Half-open global range ``[lo, hi)`` of block ``i``."""
    q, r = divmod(n, parts)
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


@dataclass(frozen=True)
class Overlap:
    """Intersection of a global box with one worker's block."""

    coords: tuple[int, ...]
    local: tuple[slice, ...]
    glob: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.glob)


@dataclass(frozen=True)
class Decomposition:
    """Which block of ``global_shape`` each coordinate of ``partition_shape`` holds."""

    global_shape: tuple[int, ...]
    partition_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        g, p = tuple(int(x) for x in self.global_shape), tuple(int(x) for x in self.partition_shape)
        if len(g) != len(p):
            raise ShapeError(
                f"tensor has {len(g)} dimensions but the partition has {len(p)}: "
                f"global shape {g}, partition shape {p}"
            )
        if any(x < 0 for x in g):
            raise ShapeError(f"negative global shape {g}")
        object.__setattr__(self, "global_shape", g)
        object.__setattr__(self, "partition_shape", p)

    def local_shape(self, coords: Sequence[int]) -> tuple[int, ...]:
        return tuple(
            block_sizes(n, s)[c] for n, s, c in zip(self.global_shape, self.partition_shape, coords)
        )

    def local_start(self, coords: Sequence[int]) -> tuple[int, ...]:
        return tuple(
            block_range(n, s, c)[0]
            for n, s, c in zip(self.global_shape, self.partition_shape, coords)
        )

    def global_slices(self, coords: Sequence[int]) -> tuple[slice, ...]:
        return tuple(
            slice(*block_range(n, s, c))
            for n, s, c in zip(self.global_shape, self.partition_shape, coords)
        )

    def overlaps(self, box: Sequence[slice]) -> Iterator[Overlap]:
        """Every worker block meeting the global box, with local and global slices (C order)."""
        per_dim = []
        for n, s, sl in zip(self.global_shape, self.partition_shape, box):
            lo, hi = sl.start, sl.stop
            hits = []
            for c in range(s):
                b0, b1 = block_range(n, s, c)
                a, b = max(lo, b0), min(hi, b1)
                if a < b:
                    hits.append((c, slice(a - b0, b - b0), slice(a, b)))
            per_dim.append(hits)
        for combo in itertools.product(*per_dim):
            yield Overlap(
                tuple(c for c, _, _ in combo),
                tuple(loc for _, loc, _ in combo),
                tuple(g for _, _, g in combo),
            )
