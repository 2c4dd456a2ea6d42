// Halo pack / unpack / unpack-add kernels: copy several strided boxes of one N-D tensor to
// and from one contiguous buffer in a single launch (all faces of a dimension fused).
//
// Layout of `desc` (int64, device memory), one row of 3 + 2*ndim entries per box r:
//   buf_offset, count, base_offset, size[ndim], stride[ndim]
// (boxes already collapsed to few dims and left-padded with unit dims by the host code).
// Box r occupies buf[buf_offset, buf_offset + count) in C order; its element (i_0..i_{D-1})
// is tensor[base_offset + sum_d i_d * stride_d]. `tensor` points at the tensor's first
// element (storage offset applied); launch grid = (gx, nboxes), any block size.
//
// pack:       buf[j]       = tensor[off(j)]      (operator P)
// unpack:     tensor[off]  = buf[j]              (operator U = P^T, overwrite)
// unpack_add: tensor[off] += buf[j]              (adjoint of pack followed by a send)
//
// Copies move raw storage words (u8/u16/u32/u64), so every dtype of that width packs with
// one kernel. Additions for half / bfloat16 go through float like PyTorch's own kernels
// (opmath float, round to nearest even), so results equal torch's add_ bit for bit.
// No headers are needed: NVRTC (CuPy RawModule) and nvcc both compile this file as is.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct f16 { u16 bits; };   // IEEE half, stored as bits
struct bf16 { u16 bits; };  // bfloat16, stored as bits

__device__ __forceinline__ void add_into(float& d, float s) { d += s; }
__device__ __forceinline__ void add_into(double& d, double s) { d += s; }
__device__ __forceinline__ void add_into(int& d, int s) { d += s; }
__device__ __forceinline__ void add_into(long long& d, long long s) { d += s; }
__device__ __forceinline__ void add_into(short& d, short s) { d = (short)(d + s); }
__device__ __forceinline__ void add_into(signed char& d, signed char s) {
    d = (signed char)(d + s);
}
__device__ __forceinline__ void add_into(u8& d, u8 s) { d = (u8)(d + s); }

__device__ __forceinline__ void add_into(f16& d, f16 s) {
    float a, b;
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(d.bits));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(s.bits));
    a += b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(d.bits) : "f"(a));
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;  // NaN, as c10::BFloat16
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (u16)(u >> 16);
}

__device__ __forceinline__ void add_into(bf16& d, bf16 s) {
    d.bits = float_to_bf16(bf16_to_float(d.bits) + bf16_to_float(s.bits));
}

// Offset (in elements) of the j-th element, C order, of box row `reg` (see layout above).
__device__ __forceinline__ long long box_offset(const long long* __restrict__ reg, int ndim,
                                                long long j) {
    const long long* size = reg + 3;
    const long long* stride = reg + 3 + ndim;
    long long off = reg[2];
    if (j < 0x7fffffffLL) {  // 32-bit index arithmetic (64-bit division is slow)
        unsigned int rem = (unsigned int)j;
        for (int d = ndim - 1; d > 0; --d) {
            unsigned int sz = (unsigned int)size[d];
            unsigned int q = rem / sz;
            off += (long long)(rem - q * sz) * stride[d];
            rem = q;
        }
        return off + (long long)rem * stride[0];
    }
    long long rem = j;
    for (int d = ndim - 1; d > 0; --d) {
        long long q = rem / size[d];
        off += (rem - q * size[d]) * stride[d];
        rem = q;
    }
    return off + rem * stride[0];
}

template <typename T>
__global__ void halo_pack(const T* __restrict__ tensor, T* __restrict__ buf,
                          const long long* __restrict__ desc, int ndim) {
    const long long* reg = desc + (long long)blockIdx.y * (3 + 2 * ndim);
    const long long boff = reg[0], count = reg[1];
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
         j += (long long)gridDim.x * blockDim.x) {
        buf[boff + j] = tensor[box_offset(reg, ndim, j)];
    }
}

template <typename T>
__global__ void halo_unpack(T* __restrict__ tensor, const T* __restrict__ buf,
                            const long long* __restrict__ desc, int ndim) {
    const long long* reg = desc + (long long)blockIdx.y * (3 + 2 * ndim);
    const long long boff = reg[0], count = reg[1];
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
         j += (long long)gridDim.x * blockDim.x) {
        tensor[box_offset(reg, ndim, j)] = buf[boff + j];
    }
}

template <typename T>
__global__ void halo_unpack_add(T* __restrict__ tensor, const T* __restrict__ buf,
                                const long long* __restrict__ desc, int ndim) {
    const long long* reg = desc + (long long)blockIdx.y * (3 + 2 * ndim);
    const long long boff = reg[0], count = reg[1];
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
         j += (long long)gridDim.x * blockDim.x) {
        const long long o = box_offset(reg, ndim, j);
        T v = tensor[o];
        add_into(v, buf[boff + j]);
        tensor[o] = v;
    }
}

// Explicit instantiations: nvcc -ptx emits every entry point; NVRTC (CuPy) finds the same
// names through name expressions such as "halo_pack<u32>".
#define GPUDIST_COPY(T) \
    template __global__ void halo_pack<T>(const T*, T*, const long long*, int); \
    template __global__ void halo_unpack<T>(T*, const T*, const long long*, int);
#define GPUDIST_ADD(T) \
    template __global__ void halo_unpack_add<T>(T*, const T*, const long long*, int);

GPUDIST_COPY(u8)
GPUDIST_COPY(u16)
GPUDIST_COPY(u32)
GPUDIST_COPY(u64)
GPUDIST_ADD(float)
GPUDIST_ADD(double)
GPUDIST_ADD(f16)
GPUDIST_ADD(bf16)
GPUDIST_ADD(int)
GPUDIST_ADD(long long)
GPUDIST_ADD(short)
GPUDIST_ADD(signed char)
GPUDIST_ADD(u8)
