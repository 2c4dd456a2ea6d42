"""Halo pack/unpack kernels and the dispatcher that picks one.

A packer copies several boxes of an N-D tensor into one contiguous buffer and back:

* ``pack(src, regions, out=None) -> buffer``: ``buffer = P src`` (boxes in order, C order);
* ``unpack(buf, dst, regions, add=False)``: ``dst[boxes] = buf`` (the transpose of P);
* ``unpack(buf, dst, regions, add=True)``: ``dst[boxes] += buf``: the adjoint of "pack then
  send", used by the backward pass of a halo exchange.

``regions`` is a list of boxes, each a ``(start, stop)`` pair per tensor dimension. Boxes
may overlap for ``pack``; for ``unpack`` they must be disjoint (the kernels write them in
parallel, in no particular order) -- halo boxes always are.
Implementations: ``torch`` (portable, any device/dtype), ``numba`` (``@njit`` on CPU,
``numba.cuda`` on GPUs) and ``cupy`` (CUDA C++ from ``csrc/halo_pack.cu``). The custom
kernels fuse all boxes of one call in one loop nest / launch; where one cannot serve a dtype
(e.g. a bfloat16 add in Numba) it hands that call to the torch path.

:func:`get_packer` chooses: ``prefer`` argument, else ``GPUDIST_PACKER=torch|numba|cupy``,
else the measured winner of :func:`autotune` for that device type and dtype (run on first
use when ``GPUDIST_PACKER_AUTOTUNE=1``), else torch on CPU and cupy > torch on CUDA. Measured
on an H200 (``python -m bench kernels --device cuda``, halo faces of (4,16,256,256) and
(1,16,1024,1024), 128-384 KiB): cupy 16-27 us a call, torch 24-40 us, numba.cuda 178-330
us (its per-launch dispatch in Python), a plain copy of the same bytes 7-10 us; numba.cuda
serves by preference only. A preference that cannot serve the device falls back to that
default.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from ..envvars import setting
from .regions import Box, Regions, normalize, total_numel
from .torch_pack import TorchPacker

IMPLS = ("torch", "numba", "cupy")


class Packer(Protocol):
    name: str

    def device_ok(self, device: torch.device) -> bool: ...

    def supports(self, device: torch.device, dtype: torch.dtype, add: bool = False) -> bool: ...

    def pack(self, src: torch.Tensor, regions: Regions, out: torch.Tensor | None = None
             ) -> torch.Tensor: ...

    def unpack(self, buf: torch.Tensor, dst: torch.Tensor, regions: Regions, add: bool = False
               ) -> torch.Tensor: ...


_INSTANCES: dict[str, Packer | None] = {}
_TUNED: dict[tuple[str, torch.dtype], str] = {}


def _make(key: str) -> Packer | None:
    """The packer ``key`` ('torch', 'numba', 'numba-cuda', 'cupy') or None if unusable."""
    if key in _INSTANCES:
        return _INSTANCES[key]
    p: Packer | None = None
    try:
        if key == "torch":
            p = TorchPacker()
        elif key == "numba":
            from .numba_pack import NumbaCPUPacker

            p = NumbaCPUPacker()
        elif key == "numba-cuda":
            from .numba_pack import NumbaCUDAPacker

            p = NumbaCUDAPacker()
        elif key == "cupy":
            from .cupy_pack import CupyPacker, cupy_available

            p = CupyPacker() if cupy_available() else None
        else:
            raise ValueError(f"unknown packer {key!r}; choose from {IMPLS}")
    except ImportError:
        p = None
    _INSTANCES[key] = p
    return p


def _resolve(name: str, device: torch.device) -> Packer | None:
    if name not in IMPLS:
        raise ValueError(f"unknown packer {name!r}; choose from {', '.join(IMPLS)}")
    if name == "numba":
        p = _make("numba-cuda" if device.type == "cuda" else "numba")
    else:
        p = _make(name)
    if p is None or not p.device_ok(device):
        return None
    return p


def available(device: str | torch.device = "cpu") -> list[str]:
    """Names of the packers that can run on ``device`` here."""
    dev = torch.device(device)
    return [n for n in IMPLS if _resolve(n, dev) is not None]


def get_packer(device: str | torch.device, dtype: torch.dtype = torch.float32,
               prefer: str | None = None) -> Packer:
    """The packer to use for tensors of ``dtype`` on ``device`` (see module docs)."""
    dev = torch.device(device)
    for name in (prefer, setting("GPUDIST_PACKER", None)):
        if name:
            p = _resolve(name, dev)
            if p is not None:
                return p
    key = (dev.type, dtype)
    if key not in _TUNED and setting("GPUDIST_PACKER_AUTOTUNE", False):
        autotune(dev, dtype)
    if key in _TUNED:
        p = _resolve(_TUNED[key], dev)
        if p is not None:
            return p
    if dev.type == "cuda":
        p = _resolve("cupy", dev)
        if p is not None:
            return p
    return _make("torch")  # type: ignore[return-value]


class Packers:
    """The packer of each (device, dtype) a plan meets, chosen once by :func:`get_packer`
    (plans pack on every call; the choice reads the environment)."""

    def __init__(self, prefer: str | None = None) -> None:
        self.prefer = prefer
        self._chosen: dict[tuple, Packer] = {}

    def of(self, t: torch.Tensor) -> Packer:
        key = (t.device, t.dtype)
        p = self._chosen.get(key)
        if p is None:
            p = self._chosen[key] = get_packer(t.device, t.dtype, prefer=self.prefer)
        return p


def halo_faces(shape: Sequence[int], width: int, dim: int) -> list[Box]:
    """The two boxes of ``width`` at both ends of ``dim`` (what one halo exchange packs)."""
    lo = tuple((0, n) for n in shape)
    left = list(lo)
    right = list(lo)
    left[dim] = (0, width)
    right[dim] = (shape[dim] - width, shape[dim])
    return [tuple(left), tuple(right)]


def _time(fn, repeats: int, sync) -> float:
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def autotune(device: str | torch.device, dtype: torch.dtype = torch.float32,
             shape: Sequence[int] = (4, 64, 64, 64), width: int = 1, repeats: int = 7) -> str:
    """Time pack + unpack-add of the halo faces of every dim with each available packer.

    Records and returns the fastest packer's name for (device type, dtype).
    """
    dev = torch.device(device)
    x = torch.randn(tuple(shape), device=dev).to(dtype)
    jobs = [halo_faces(x.shape, width, d) for d in range(1, x.dim())]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    best, best_t = "torch", float("inf")
    for name in available(dev):
        p = _resolve(name, dev)
        assert p is not None
        bufs = [torch.empty(total_numel(normalize(x.shape, j)), dtype=dtype, device=dev)
                for j in jobs]

        def run(p=p, bufs=bufs) -> None:
            for j, b in zip(jobs, bufs):
                p.pack(x, j, out=b)
                p.unpack(b, x, j, add=True)

        run()  # compile / warm up
        t = _time(run, repeats, sync)
        if t < best_t:
            best, best_t = name, t
    _TUNED[(dev.type, dtype)] = best
    return best


__all__ = ["IMPLS", "Box", "Packer", "Packers", "TorchPacker", "autotune", "available",
           "get_packer", "halo_faces"]
