"""CUDA C++ pack/unpack kernels (``csrc/halo_pack.cu``) loaded with ``cupy.RawModule``.

One launch per call covers every box (grid ``(gx, nboxes)``), on torch's current stream;
the kernels get raw device pointers (no copy, no per-call CuPy arrays), and each call's box
descriptor is uploaded once and cached. Copies use storage
words (u8/u16/u32/u64, any dtype); adds exist for float, double, half, bfloat16 and the
integer types.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .base import _REAL, ADD, PACK, CustomPacker

_WORD_T = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
_ADD_T = {torch.float32: "float", torch.float64: "double", torch.float16: "f16",
          torch.bfloat16: "bf16", torch.int32: "int", torch.int64: "long long",
          torch.int16: "short", torch.int8: "signed char", torch.uint8: "u8"}


def source_path() -> Path:
    """Where ``halo_pack.cu`` lives: ``GPUDIST_CSRC`` if set, else ``gpudist/kernels/csrc``
    (in a checkout a symlink to the top-level ``csrc/``, in a wheel a copy)."""
    env = os.environ.get("GPUDIST_CSRC")
    if env:
        return Path(env) / "halo_pack.cu"
    here = Path(__file__).resolve().parent / "csrc" / "halo_pack.cu"
    return here if here.is_file() else Path(__file__).resolve().parents[2] / "csrc" / \
        "halo_pack.cu"


def name_expressions() -> list[str]:
    names = []
    for w in _WORD_T.values():
        names += [f"halo_pack<{w}>", f"halo_unpack<{w}>"]
    names += [f"halo_unpack_add<{t}>" for t in _ADD_T.values()]
    return names


def cupy_available() -> bool:
    """CuPy importable and a CUDA device visible to it."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class _TorchStream:
    """A raw CUDA stream handle exposing the CUDA stream protocol."""

    def __init__(self, ptr: int, dev: int) -> None:
        self.ptr, self.dev = ptr, dev

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


class CupyPacker(CustomPacker):
    """Fused pack/unpack with the CUDA C++ kernels (compiled once per device by NVRTC)."""

    name = "cupy"
    add_dtypes = frozenset(_ADD_T)
    threads = 256
    max_blocks = 4096

    def __init__(self) -> None:
        super().__init__()
        import cupy

        self.cp = cupy
        self._modules: dict[int, object] = {}
        self._kernels: dict[tuple[int, str], object] = {}
        self._by_mode: dict[tuple[int, int, torch.dtype], object] = {}
        self._streams: dict[int, object] = {}

    def device_ok(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def _module(self, dev: int):
        m = self._modules.get(dev)
        if m is None:
            code = source_path().read_text()
            with self.cp.cuda.Device(dev):
                m = self.cp.RawModule(code=code, options=("--std=c++14",),
                                      name_expressions=name_expressions())
                m.compile()
            self._modules[dev] = m
        return m

    def _kernel(self, dev: int, name: str):
        k = self._kernels.get((dev, name))
        if k is None:
            k = self._module(dev).get_function(name)
            self._kernels[(dev, name)] = k
        return k

    def _apply(self, t: torch.Tensor, buf: torch.Tensor, prep, mode: int) -> None:
        # only pointers are needed: no flat views, no CuPy arrays per call
        real = _REAL.get(t.dtype, t.dtype)
        dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
        kern = self._by_mode.get((dev, mode, real))
        if kern is None:
            if mode == ADD:
                name = f"halo_unpack_add<{_ADD_T[real]}>"
            else:
                w = _WORD_T[torch.empty(0, dtype=real).element_size()]
                name = f"halo_pack<{w}>" if mode == PACK else f"halo_unpack<{w}>"
            kern = self._kernel(dev, name)
            self._by_mode[(dev, mode, real)] = kern
        up = prep.uploaded.get(("cupy", dev))
        if up is None:
            with self.cp.cuda.Device(dev):
                arr = self.cp.asarray(prep.desc)
            gx = max(1, min(self.max_blocks, (prep.biggest + self.threads - 1) // self.threads))
            up = (arr, np.uint64(arr.data.ptr), (gx, prep.nboxes), np.int32(prep.ndim))
            prep.uploaded[("cupy", dev)] = up
        _, desc_ptr, grid, ndim = up
        sptr = torch.cuda.current_stream(t.device).cuda_stream
        args = (np.uint64(t.data_ptr()), np.uint64(buf.data_ptr()), desc_ptr, ndim)
        if dev == torch.cuda.current_device() and sptr == 0 \
                and self.cp.cuda.get_current_stream().ptr == 0:
            kern(grid, (self.threads,), args)  # fast path: default stream, current device
            return
        with self.cp.cuda.Device(dev), self._stream(sptr, dev):
            kern(grid, (self.threads,), args)

    def _stream(self, ptr: int, dev: int):
        """CuPy's handle on torch's current stream (cached per stream)."""
        s = self._streams.get(ptr)
        if s is None:
            try:  # CuPy >= 14: the CUDA stream protocol
                s = self.cp.cuda.Stream.from_external(_TorchStream(ptr, dev))
            except Exception:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    s = self.cp.cuda.ExternalStream(ptr, dev)
            self._streams[ptr] = s
        return s


__all__ = ["CupyPacker", "cupy_available", "name_expressions", "source_path"]
