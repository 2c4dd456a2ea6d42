"""The ``numba.cuda`` box kernel (own module: the CUDA simulator swaps the global ``cuda``)."""

from numba import cuda


@cuda.jit
def boxes_gpu(base, buf, desc, ndim, mode):  # pragma: no cover - compiled
    """Grid (gx, nboxes): block row y walks box y; mode 0 pack, 1 unpack, 2 unpack-add.

    Rows of ``desc``: buf_off, count, base_off, size[ndim], stride[ndim].
    """
    D = ndim
    p = cuda.blockIdx.y * (3 + 2 * D)
    boff = desc[p]
    count = desc[p + 1]
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while j < count:
        rem = j
        off = desc[p + 2]
        for d in range(D - 1, 0, -1):
            sz = desc[p + 3 + d]
            q = rem // sz
            off += (rem - q * sz) * desc[p + 3 + D + d]
            rem = q
        off += rem * desc[p + 3 + D]
        if mode == 0:
            buf[boff + j] = base[off]
        elif mode == 1:
            base[off] = buf[boff + j]
        else:
            base[off] += buf[boff + j]
        j += step
