"""Memory a plan keeps between calls.

:class:`BufferPool` hands out tensors that are reused across calls, allocated once per
(name, shape, dtype, device). A pooled buffer is handed out again only when nobody else
holds its storage any more (autograd's saved tensors, a user's reference, a gradient that
became ``.grad``): then a repeated forward/backward allocates nothing, and a forward whose
output is still alive (two forwards before one backward, a layer used twice) gets a second
buffer instead of overwriting the first. What is handed out is a fresh tensor object on
the pooled storage (not a view), so callers may modify it in place.

:class:`LRU` bounds the plans (and with them the buffers) a layer keeps per input shape.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

try:  # the number of tensors sharing a storage; without it nothing is reused
    from torch._C import _storage_Use_Count as _use_count
except ImportError:  # pragma: no cover
    _use_count = None


def _refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


def nbytes(tensors) -> int:
    """The bytes the given tensors hold (what the bench reports as kept)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class Slot:
    """The kept tensors of one (name, shape, dtype, device): :meth:`take` hands out one
    nobody else holds, or allocates. A plan that calls for the same buffer on every call
    keeps its slot (a third of :meth:`BufferPool.get`'s cost: no key to hash)."""

    __slots__ = ("pool", "shape", "dtype", "device", "index", "kept")

    def __init__(self, pool: BufferPool, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pool, self.shape, self.dtype, self.device = pool, shape, dtype, device
        self.index = device.index if device.type == "cuda" else -1  # (get_device()'s)
        self.kept: list[tuple[torch.Tensor, int, int]] = []

    def fits(self, like: torch.Tensor) -> bool:
        """Whether ``like``'s dtype and device are this slot's."""
        return like.dtype is self.dtype and like.get_device() == self.index

    def take(self, init: Callable[[torch.Tensor], None] | None = None,
             pin: bool = False) -> torch.Tensor:
        """A tensor of the slot's shape; ``init`` runs once on a newly allocated buffer;
        ``pin``: allocate it in page-locked host memory."""
        kept = self.kept
        if _use_count is not None:
            for base, refs, storage in kept:  # (_refs inlined: this runs per call)
                if _use_count(storage) == refs:  # only the pool holds it: a new tensor
                    return base.detach()  # object on its storage (not a view for
                    # autograd; ten times cheaper than set_)
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device, pin_memory=pin)
        self.pool.allocations += 1
        if init is not None:
            init(t)
        if _use_count is not None and len(kept) < self.pool.per_key:
            # (its storage's address, for the count: the pool's tensor keeps it alive)
            kept.append((t, _refs(t), t.untyped_storage()._cdata))
            return t.detach()
        return t


class BufferPool:
    """Reusable tensors, at most ``per_key`` alive per key (more are allocated fresh), for
    the ``max_keys`` most recently used keys (older shapes are dropped)."""

    def __init__(self, per_key: int = 2, max_keys: int = 32) -> None:
        self.per_key, self.max_keys = per_key, max_keys
        self._bufs: OrderedDict[tuple, Slot] = OrderedDict()
        self.allocations = 0

    def slot(self, name: object, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> Slot:
        """The slot of (``name``, ``shape``, ``dtype``, ``device``), made on first use."""
        if type(shape) is not tuple:
            shape = tuple(int(s) for s in shape)
        key = (name, shape, dtype, device)
        s = self._bufs.get(key)
        if s is None:
            s = self._bufs[key] = Slot(self, shape, dtype, torch.device(device))
            while len(self._bufs) > self.max_keys:
                self._bufs.popitem(last=False)
        else:
            self._bufs.move_to_end(key)
        return s

    def get(self, name: object, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device, init: Callable[[torch.Tensor], None] | None = None,
            pin: bool = False) -> torch.Tensor:
        """A tensor of ``shape`` (:meth:`Slot.take` of its slot)."""
        return self.slot(name, shape, dtype, device).take(init, pin)

    def clear(self) -> None:
        self._bufs.clear()

    def nbytes(self) -> int:
        return nbytes(b for s in self._bufs.values() for b, _, _ in s.kept)


def alias(base: torch.Tensor, offset: int, shape: Sequence[int], stride: Sequence[int]
          ) -> torch.Tensor:
    """A new tensor object on ``base``'s storage with the given geometry (not a view)."""
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(
        base.untyped_storage(), base.storage_offset() + offset, tuple(shape), tuple(stride))


class LRU(OrderedDict):
    """A dict that keeps its ``size`` most recently used entries."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = max(1, int(size))

    def get_or_make(self, key, make: Callable[[], object]):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        while len(self) > self.size:
            self.popitem(last=False)
        return value
