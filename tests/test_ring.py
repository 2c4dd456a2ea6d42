"""The rings that sum large host tensors (gpudist.primitives.ring): AllSumReduce and
ReduceScatter with the ring's size threshold lowered to 0 bytes, so that small tensors take
it, over 2, 3 and 5 ranks, uneven chunks (fewer elements than ranks too), several dtypes:
exact sums, the same bits on every rank, inputs left alone, adjoint tests, nothing
allocated by a repeated call; and the same sums with the threshold as shipped."""

import pytest
import torch

import gpudist
from gpudist import Partition
from gpudist.primitives import AllSumReduce, ReduceScatter, ring
from gpudist.testing import adjoint_mismatch


def _summand(shape, rank: int, dtype) -> torch.Tensor:
    """Integer values (exact sums in every dtype) that differ between ranks and places."""
    n = 1
    for s in shape:
        n *= s
    v = (torch.arange(n, dtype=torch.int64) * 7 + 3 * rank) % 11
    if dtype == torch.bool:
        return (v > 8).reshape(shape)
    return v.to(dtype).reshape(shape)


def _expected(shape, k: int, dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.stack([_summand(shape, r, dtype) for r in range(k)]).any(0)
    return sum(_summand(shape, r, torch.int64) for r in range(k)).to(dtype)


def _ring_case(numel: int, dtype, lowered: bool):
    w = gpudist.world()
    k, old = w.size, ring.RING_MIN_BYTES
    if lowered:
        ring.RING_MIN_BYTES = 0
    try:
        P = Partition.grid((k,))
        facts = {}
        x = _summand((numel,), w.rank, dtype)
        x0 = x.clone()
        A = AllSumReduce(P, [0])
        y = A(x).clone()
        facts["allreduce"] = torch.equal(y, _expected((numel,), k, dtype))
        allocs = A.buffers.allocations
        A(x)
        facts["allreduce_no_alloc"] = A.buffers.allocations == allocs
        facts["input_kept"] = torch.equal(x, x0)
        # the reduce-scatter's two layouts: leading dim (straight), inner dim (staged)
        for name, shape, dim in (("rs_lead", (k * 3, 2), 0), ("rs_inner", (2, k * 3 + 1), 1)):
            z = _summand(shape, w.rank, dtype)
            R = ReduceScatter(P, 0, dim)
            out = R(z).clone()  # (the pooled result let go: a repeat reuses it)
            want = _expected(shape, k, dtype)
            lo = sum(((shape[dim] + k - 1 - j) // k) for j in range(w.rank))
            facts[name] = torch.equal(out, want.narrow(dim, lo, out.shape[dim]))
            allocs = R.buffers.allocations
            R(z)
            facts[name + "_no_alloc"] = R.buffers.allocations == allocs
        if dtype.is_floating_point:
            g = torch.Generator().manual_seed(5)
            full = torch.randn(k * 4, 3, generator=g, dtype=dtype)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            facts["adjoint_allreduce"] = adjoint_mismatch(AllSumReduce(P, [0]), full) < tol
            facts["adjoint_rs"] = adjoint_mismatch(ReduceScatter(P, 0, 0), full) < tol
        return facts
    finally:
        ring.RING_MIN_BYTES = old


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("numel,dtype", [(1001, torch.float64), (3, torch.float32),
                                         (257, torch.int64), (64, torch.bool),
                                         (40, torch.complex64)])
def test_ring_sums(cluster, backend, n, numel, dtype):
    for r, facts in enumerate(cluster.run(n, _ring_case, numel, dtype, True,
                                          backend=backend)):
        assert facts and all(facts.values()), (r, facts)


def _same_bits(numel: int):
    """A large random float sum over the ring (as shipped: above the threshold) is the same
    on every rank, bit for bit, and equals the backend's sum to rounding."""
    w = gpudist.world()
    g = torch.Generator().manual_seed(w.rank)
    x = torch.randn(numel, generator=g)
    y = AllSumReduce(Partition.grid((w.size,)), [0])(x)
    rings = x.nbytes >= ring.RING_MIN_BYTES
    tr = w.transport
    ref = torch.empty_like(x)
    tr.wait([tr.all_reduce(ref, tr.group(range(w.size)), src=x)])
    bits = y.view(torch.int32)
    out = torch.empty(w.size * numel, dtype=torch.int32)
    tr.wait([tr.all_gather(out, bits, tr.group(range(w.size)))])
    every = out.view(w.size, numel)
    return rings, bool((every == every[0]).all()), torch.allclose(y, ref, atol=1e-5)


def test_ring_as_shipped(cluster, backend):
    numel = ring.RING_MIN_BYTES // 4 + 5  # just above the threshold (float32)
    for rings, same, close in cluster.run(3, _same_bits, numel, backend=backend, timeout=60):
        assert rings and same and close
