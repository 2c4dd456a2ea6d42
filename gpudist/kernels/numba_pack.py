"""Numba pack/unpack kernels: ``@njit`` loops for CPU, ``numba.cuda`` kernels for GPUs.

Both walk the descriptor of :func:`gpudist.kernels.regions.describe`: all boxes of one call
in one kernel (one launch on the GPU, grid ``(gx, nboxes)``). With ``NUMBA_ENABLE_CUDASIM=1``
the CUDA kernels run in Numba's simulator on CPU tensors (for tests without a GPU).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import config as _nb_config
from numba import njit

from .base import ADD, PACK, UNPACK, CustomPacker

_NATIVE_ADD = frozenset({torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
                         torch.int8, torch.uint8})


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.detach() if t.requires_grad else t).numpy()


@njit(cache=True, nogil=True, inline="always")
def _row(base, buf, off, b, n, st, mode):  # pragma: no cover - compiled
    """One row of ``n`` elements: tensor stride ``st`` from ``off``, buffer from ``b``."""
    if st == 1 and n >= 32:  # long contiguous row: slice copies (vectorised)
        if mode == 0:
            buf[b:b + n] = base[off:off + n]
        elif mode == 1:
            base[off:off + n] = buf[b:b + n]
        else:
            base[off:off + n] += buf[b:b + n]
    elif mode == 0:
        for j in range(n):
            buf[b + j] = base[off + j * st]
    elif mode == 1:
        for j in range(n):
            base[off + j * st] = buf[b + j]
    else:
        for j in range(n):
            base[off + j * st] += buf[b + j]


@njit(cache=True, nogil=True)
def _boxes_cpu(base, buf, desc, ndim, mode):  # pragma: no cover - compiled
    """Rows of ``desc``: buf_off, count, base_off, size[ndim], stride[ndim] (see regions)."""
    D = ndim
    row = 3 + 2 * D
    idx = np.zeros(D, dtype=np.int64)
    for p in range(0, desc.shape[0], row):
        boff = desc[p]
        count = desc[p + 1]
        if count == 0:
            continue
        inner = desc[p + 2 + D]
        st_in = desc[p + 2 + 2 * D]
        off = desc[p + 2]  # offset of the current row's first element
        if D == 1:
            _row(base, buf, off, boff, inner, st_in, mode)
            continue
        if D == 2:
            st0 = desc[p + 3 + D]
            for r in range(desc[p + 3]):
                _row(base, buf, off + r * st0, boff + r * inner, inner, st_in, mode)
            continue
        for d in range(D):
            idx[d] = 0
        b = boff
        while b < boff + count:
            _row(base, buf, off, b, inner, st_in, mode)
            b += inner
            # odometer over the outer dims (no divisions)
            d = D - 2
            while d >= 0:
                idx[d] += 1
                off += desc[p + 3 + D + d]
                if idx[d] < desc[p + 3 + d]:
                    break
                off -= idx[d] * desc[p + 3 + D + d]
                idx[d] = 0
                d -= 1


class NumbaCPUPacker(CustomPacker):
    """Fused pack/unpack on CPU tensors with one ``@njit`` loop nest over all boxes."""

    name = "numba"
    add_dtypes = _NATIVE_ADD

    def device_ok(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def _run(self, base, buf, prep, mode):
        _boxes_cpu(_np(base), _np(buf), prep.desc, prep.ndim, mode)


# ---------------------------------------------------------------- numba.cuda

def _cuda():
    from numba import cuda

    return cuda


def simulator() -> bool:
    """Whether Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(_nb_config.ENABLE_CUDASIM)


def _kernel():
    from ._numba_cuda_kernel import boxes_gpu

    return boxes_gpu


class NumbaCUDAPacker(CustomPacker):
    """Fused pack/unpack on CUDA tensors: one ``numba.cuda`` launch per call.

    On torch's current stream. Under the simulator it serves CPU tensors instead.
    """

    name = "numba-cuda"
    add_dtypes = _NATIVE_ADD
    threads = 256
    max_blocks = 1024

    def __init__(self) -> None:
        super().__init__()
        self._usable: bool | None = None
        self.error: str | None = None
        if simulator():
            self.threads, self.max_blocks = 8, 2  # simulator: each thread is a Python thread

    def device_ok(self, device: torch.device) -> bool:
        if simulator():
            return device.type == "cpu"
        if device.type != "cuda":
            return False
        return self.usable()

    def usable(self) -> bool:
        """Whether numba.cuda sees a GPU and can compile and run the kernel here (checked
        once with a one-element launch; the reason for a 'no' is kept in ``self.error``)."""
        if self._usable is None:
            try:
                if not _cuda().is_available():
                    raise RuntimeError("numba.cuda sees no GPU")
                t = torch.zeros(1, device="cuda", dtype=torch.float32)
                self._usable = True
                self.pack(t, (((0, 1),),))
                torch.cuda.synchronize()
            except Exception as e:  # broken toolkit / numba-cuda / numpy combinations
                self._usable, self.error = False, f"{type(e).__name__}: {e}"
        return self._usable

    def _run(self, base, buf, prep, mode):
        kern = _kernel()
        gx = max(1, min(self.max_blocks, (prep.biggest + self.threads - 1) // self.threads))
        grid = (gx, prep.nboxes)
        if simulator():
            kern[grid, self.threads](_np(base), _np(buf), prep.desc, prep.ndim, mode)
            return
        cuda = _cuda()
        dev = base.device
        with torch.cuda.device(dev):
            stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
            desc = prep.uploaded.get(("numba", dev))
            if desc is None:
                desc = cuda.to_device(prep.desc, stream=stream)
                prep.uploaded[("numba", dev)] = desc
            kern[grid, self.threads, stream](cuda.as_cuda_array(base, sync=False),
                                             cuda.as_cuda_array(buf, sync=False),
                                             desc, prep.ndim, mode)


__all__ = ["ADD", "PACK", "UNPACK", "NumbaCPUPacker", "NumbaCUDAPacker", "simulator"]
