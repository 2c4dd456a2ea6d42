"""Memory-model operators: adjoint tests, and the fast primitives agree with halo exchange
and broadcast composed from them."""

import pytest
import torch

import gpudist
from gpudist import DistTensor, Partition
from gpudist.halo import HaloExchange
from gpudist.primitives import Broadcast
from gpudist.testing.memory import (
    Add,
    Allocate,
    Clear,
    Deallocate,
    copy,
    copy_new,
    inner,
    move,
    random_memory,
)
from tests.util import block_of, global_tensor


def _mismatch(op, x_shapes, y_shapes, seed=0):
    x, y = random_memory(x_shapes, seed), random_memory(y_shapes, seed + 1)
    fx, aty = op(x), op.adjoint()(y)
    lhs, rhs = inner(fx, y), inner(x, aty)
    scale = max(inner(fx, fx) ** 0.5 * inner(y, y) ** 0.5, inner(x, x) ** 0.5 *
                inner(aty, aty) ** 0.5)
    return abs(lhs - rhs) / scale


S = (slice(1, 3),)
CASES = [
    (Allocate("b", (4,)), {"a": (4,)}, {"a": (4,), "b": (4,)}),
    (Deallocate("b", (4,)), {"a": (4,), "b": (4,)}, {"a": (4,)}),
    (Clear("a", S), {"a": (5,)}, {"a": (5,)}),
    (Add("a", "b", S, (slice(0, 2),)), {"a": (5,), "b": (3,)}, {"a": (5,), "b": (3,)}),
    (copy("a", "b", S, (slice(0, 2),)), {"a": (5,), "b": (3,)}, {"a": (5,), "b": (3,)}),
    (copy_new("a", "c", (2,), S), {"a": (5,)}, {"a": (5,), "c": (2,)}),
    (move("a", "b"), {"a": (4,), "b": (4,)}, {"a": (4,), "b": (4,)}),
    (Clear("a") @ copy("a", "b") @ Allocate("b", (4,)), {"a": (4,)}, {"a": (4,), "b": (4,)}),
]


@pytest.mark.parametrize("op,xs,ys", CASES, ids=lambda c: type(c).__name__ if not
                         isinstance(c, dict) else "")
def test_memory_op_adjoint(op, xs, ys):
    assert _mismatch(op, xs, ys) < 1e-14


def test_adjoint_of_copy_is_add_and_clear():
    m = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0, 7.0])}
    out = copy("a", "b").adjoint()(m)
    assert out["a"].tolist() == [6.0, 9.0] and out["b"].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- fast vs model


def _halo_blocks(n, workers):
    P = Partition.grid((workers,))
    G = global_tensor((n,), seed=3)
    return HaloExchange(P, 3, 1, 1, 1, pad_value=0.0)(block_of(G, P)).tolist()


def test_halo_exchange_matches_memory_model(cluster):
    n, P = 10, 3
    got = cluster.run(P, _halo_blocks, n, P)
    G = global_tensor((n,), seed=3)
    sizes = [4, 3, 3]
    starts = [0, 4, 7]
    mem = {f"x{i}": G[starts[i]:starts[i] + sizes[i]].clone() for i in range(P)}
    ops = []
    for i in range(P):  # buffer h_i = [left | bulk | right], each one wide
        ops.append(copy(f"x{i}", f"h{i}", (slice(None),), (slice(1, 1 + sizes[i]),)))
        ops.append(Allocate(f"h{i}", (sizes[i] + 2,)))
        if i > 0:
            ops.append(copy(f"x{i - 1}", f"h{i}", (slice(-1, None),), (slice(0, 1),)))
        if i < P - 1:
            ops.append(copy(f"x{i + 1}", f"h{i}", (slice(0, 1),), (slice(-1, None),)))
    for op in [o for o in ops if isinstance(o, Allocate)]:
        mem = op(mem)
    for op in [o for o in ops if not isinstance(o, Allocate)]:
        mem = op(mem)
    for i in range(P):
        assert got[i] == mem[f"h{i}"].tolist()


def _bcast_blocks():
    Ps, Pd = Partition.root(1), Partition.grid((3,))
    x = torch.arange(4.0, dtype=torch.float64) if Ps.active else torch.zeros(0,
                                                                             dtype=torch.float64)
    return Broadcast(Ps, Pd)(x).tolist()


def test_broadcast_matches_memory_model(cluster):
    got = cluster.run(3, _bcast_blocks)
    mem = {"x0": torch.arange(4.0, dtype=torch.float64)}
    op = copy_new("x0", "y2", (4,)) @ copy_new("x0", "y1", (4,)) @ copy_new("x0", "y0", (4,))
    out = op(mem)
    assert [out[f"y{i}"].tolist() for i in range(3)] == got


def _freed_without_the_collector():
    """A primitive whose plans have no steady form (a halo exchange; on a GPU, every one)
    goes, with its buffers, when the program drops it: its plans' closures hold it and
    themselves weakly (no reference cycle left for the garbage collector)."""
    import gc
    import weakref

    w = gpudist.world()
    P = Partition.grid((1, 1, w.size))
    x = DistTensor.from_local(torch.randn(1, 2, 6, dtype=torch.float64), P, (1, 2, 6 * w.size))
    gc.collect()
    gc.disable()
    try:
        op = HaloExchange(P, kernel_size=3, padding=1)
        for _ in range(3):  # the checked call, then the repeated one
            y = op(x)
        float(getattr(y, "local", y).sum())
        gone = weakref.ref(op)
        del op, y
        return gone() is None
    finally:
        gc.enable()


def test_primitive_freed_without_the_garbage_collector(cluster):
    assert all(cluster.run(2, _freed_without_the_collector))
