"""CUDA C++ pack/unpack kernels (``csrc/halo_pack.cu``) loaded with ``cupy.RawModule``.

One launch per call covers every box (grid ``(gx, nboxes)``), on torch's current stream;
tensors are handed over zero-copy through ``__cuda_array_interface__``. Copies use storage
words (u8/u16/u32/u64, any dtype); adds exist for float, double, half, bfloat16 and the
integer types.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .base import ADD, PACK, UNPACK, CustomPacker

_WORD_T = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
_ADD_T = {torch.float32: "float", torch.float64: "double", torch.float16: "f16",
          torch.bfloat16: "bf16", torch.int32: "int", torch.int64: "long long",
          torch.int16: "short", torch.int8: "signed char", torch.uint8: "u8"}


def source_path() -> Path:
    """Where ``halo_pack.cu`` lives (``GPUDIST_CSRC`` overrides the folder)."""
    env = os.environ.get("GPUDIST_CSRC")
    if env:
        return Path(env) / "halo_pack.cu"
    return Path(__file__).resolve().parents[2] / "csrc" / "halo_pack.cu"


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

    def _run(self, base, buf, prep, mode):
        cp = self.cp
        dev = base.device.index if base.device.index is not None else torch.cuda.current_device()
        if mode == ADD:
            name = f"halo_unpack_add<{_ADD_T[base.dtype]}>"
        else:
            w = _WORD_T[base.element_size()]
            name = f"halo_pack<{w}>" if mode == PACK else f"halo_unpack<{w}>"
        gx = max(1, min(self.max_blocks, (prep.biggest + self.threads - 1) // self.threads))
        with cp.cuda.Device(dev):
            kern = self._kernel(dev, name)
            stream = cp.cuda.ExternalStream(torch.cuda.current_stream(base.device).cuda_stream)
            with stream:
                desc = prep.uploaded.get(("cupy", dev))
                if desc is None:
                    desc = cp.asarray(prep.desc)
                    prep.uploaded[("cupy", dev)] = desc
                kern((gx, prep.nboxes), (self.threads,),
                     (self._raw(base), self._raw(buf), desc, np.int32(prep.ndim)))

    def _raw(self, t: torch.Tensor):
        """A byte array over ``t``'s memory (no copy, no stream sync): the kernel's pointer."""
        cp = self.cp
        nbytes = max(1, t.numel() * t.element_size())
        mem = cp.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index or 0)
        return cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))


__all__ = ["ADD", "PACK", "UNPACK", "CupyPacker", "cupy_available", "name_expressions",
           "source_path"]
