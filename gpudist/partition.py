"""Partitions: ordered subsets of world ranks arranged as Cartesian grids.

A rank is *active* in a partition or not: ``index`` is its position in the partition's
C-ordered grid (-1 when inactive), ``coords`` its grid coordinates, ``ranks`` the members'
world ranks. An inactive rank still holds a Partition object (``active == False``) so
every rank runs the same program. Construction is
collective over the world (every rank constructs the same partitions in the same order),
deterministic, and creates the partition's communicator group once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import PartitionError, not_picklable
from .runtime import World, require_world
from .transport.base import Group


class Partition:
    """World ranks ``ranks`` (C order) arranged as a grid of ``shape``."""

    def __init__(self, ranks: Sequence[int], shape: Sequence[int], world: World | None = None):
        self.world = require_world(world)
        self.ranks = tuple(int(r) for r in ranks)
        self.shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in self.shape):
            raise PartitionError(f"partition shape {self.shape} has a non-positive extent")
        if math.prod(self.shape) != len(self.ranks):
            raise PartitionError(
                f"partition shape {self.shape} holds {math.prod(self.shape)} workers "
                f"but {len(self.ranks)} ranks were given"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise PartitionError(f"partition ranks {self.ranks} repeat a rank")
        bad = [r for r in self.ranks if not 0 <= r < self.world.size]
        if bad:
            raise PartitionError(
                f"partition of shape {self.shape} needs world ranks {sorted(self.ranks)} "
                f"but the world has only {self.world.size} rank(s)"
            )
        me = self.world.rank
        self.active = me in self.ranks
        self.index = self.ranks.index(me) if self.active else -1
        self.coords = self.coords_of(self.index) if self.active else None
        self._group: Group | None = None
        if len(self.ranks) > 1:  # world-collective: inactive ranks take part in creation
            g = self.world.transport.group(self.ranks)
            self._group = g if self.active else None

    @classmethod
    def empty(cls, shape: Sequence[int], world: World | None = None) -> Partition:
        """A partition of ``shape`` this rank is not part of and that names no ranks: what
        :meth:`sub` gives a rank outside the partition (no communication)."""
        p = cls.__new__(cls)
        p.world, p.ranks, p.shape = require_world(world), (), tuple(int(s) for s in shape)
        p.active, p.index, p.coords, p._group = False, -1, None, None
        return p

    # -- constructors -------------------------------------------------------
    @classmethod
    def grid(
        cls, shape: Sequence[int], ranks: Iterable[int] | None = None, world: World | None = None
    ) -> Partition:
        """A grid of ``shape`` over ``ranks`` (default: the first prod(shape) world ranks)."""
        w = require_world(world)
        n = math.prod(int(s) for s in shape)
        if ranks is None:
            if n > w.size:
                raise PartitionError(
                    f"partition of shape {tuple(shape)} needs {n} ranks "
                    f"but the world has only {w.size}"
                )
            ranks = range(n)
        return cls(list(ranks), shape, w)

    @classmethod
    def root(cls, dim: int, rank: int = 0, world: World | None = None) -> Partition:
        """A one-worker partition with ``dim`` unit extents on world ``rank``."""
        return cls([rank], (1,) * dim, world)

    def sub(self, axes: Sequence[int]) -> Partition:
        """The ranks sharing this rank's coordinates on all axes *not* in ``axes``.

        Keeps every dimension (extent 1 off ``axes``); inactive ranks get an inactive one.
        Collective over the world: creates the groups of every such fiber, in order.
        """
        axes = sorted({a % self.dim for a in axes})
        shape = tuple(s if d in axes else 1 for d, s in enumerate(self.shape))
        mine: Partition | None = None
        fixed = [d for d in range(self.dim) if d not in axes]
        for base in np.ndindex(*[self.shape[d] for d in fixed]):  # every fiber, same order
            members = []
            for idx in np.ndindex(*shape):
                c = list(idx)
                for d, v in zip(fixed, base):
                    c[d] = v
                members.append(self.world_rank_of(c))
            p = Partition(members, shape, self.world)
            if p.active:
                mine = p
        return mine if mine is not None else Partition.empty(shape, self.world)

    def transpose(self) -> Partition:
        """Same ranks, grid axes reversed: the worker at coords c goes to reversed(c)."""
        order = np.arange(self.size).reshape(self.shape).transpose().ravel()
        return Partition([self.ranks[i] for i in order], self.shape[::-1], self.world)

    def reshape(self, shape: Sequence[int]) -> Partition:
        """Same ranks in the same C order, another grid shape of the same size."""
        return Partition(self.ranks, shape, self.world)

    def union(self, other: Partition) -> Partition:
        """1-D partition of this partition's ranks followed by ``other``'s new ones."""
        ranks = list(self.ranks) + [r for r in other.ranks if r not in self.ranks]
        return Partition(ranks, (len(ranks),), self.world)

    # -- queries ------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def dim(self) -> int:
        return len(self.shape)

    @property
    def group(self) -> Group | None:
        """The communicator group of all members (None for one worker or when inactive)."""
        return self._group

    def coords_of(self, index: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(index, self.shape))

    def world_rank_of(self, coords: Sequence[int]) -> int:
        return self.ranks[int(np.ravel_multi_index(tuple(coords), self.shape))]

    def neighbors(self, axis: int) -> tuple[int | None, int | None]:
        """World ranks of the left and right neighbours along ``axis`` (non-periodic)."""
        if not self.active:
            return None, None
        c = list(self.coords)
        out: list[int | None] = []
        for step in (-1, 1):
            c2 = c.copy()
            c2[axis] += step
            out.append(self.world_rank_of(c2) if 0 <= c2[axis] < self.shape[axis] else None)
        return out[0], out[1]

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(world ranks, shape): what makes two partition objects the same partition."""
        return self.ranks, self.shape

    def same_as(self, other: Partition) -> bool:
        return self.key == other.key

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, Partition) and self.ranks == other.ranks
                                 and self.shape == other.shape)

    def __hash__(self) -> int:  # (the key's, without the property: plans hash per call)
        return hash((self.ranks, self.shape))

    def __copy__(self) -> Partition:  # an immutable value bound to the world: itself
        return self

    def __deepcopy__(self, memo) -> Partition:  # (so a DistTensor or TensorSpec copies)
        return self

    def __reduce_ex__(self, protocol):
        raise not_picklable(repr(self))

    def __repr__(self) -> str:
        state = f"coords={self.coords}" if self.active else "inactive"
        return f"Partition(shape={self.shape}, ranks={self.ranks}, {state})"
