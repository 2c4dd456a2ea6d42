"""The data path in steady state: no metadata collective, no allocation inside the
primitives, no host synchronisation inside the layers, bounded caches, and the host
staging path of backends that cannot take a tensor's memory (issues #13, #14, #15, #16)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gpudist
import gpudist.nn as gnn
from gpudist import PARTIAL, DistTensor, Partition, TensorSpec
from gpudist.halo import HaloExchange
from gpudist.primitives import (
    AllGather,
    AllSumReduce,
    Broadcast,
    ReduceScatter,
    Repartition,
    SumReduce,
)
from tests.conftest import BACKENDS
from tests.util import (
    counted_meta_exchanges,
    forced_staging,
    global_tensor,
    without_periodic_check,
)


class _Counter(TorchDispatchMode):
    """Counts aten calls that allocate (an output on storage none of the inputs own) and
    host synchronisations (``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[str] = []
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        ins = set()
        for a in list(args) + list(kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(t, torch.Tensor) and t.numel():
                    ins.add(t.untyped_storage().data_ptr())
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() and \
                    t.untyped_storage().data_ptr() not in ins:
                self.allocs.append(str(func))
        return out


class _Net(torch.nn.Module):
    """conv -> relu -> pool -> repartition to features -> linear; DistTensors between."""

    def __init__(self, n):
        super().__init__()
        self.P = Partition.grid((1, 1, n, 1))
        self.Pf = Partition([0], (1, 1, 1, 1))
        self.Pin, self.Pw = Partition([0], (1, 1)), Partition.grid((1, 1))
        torch.manual_seed(0)
        self.conv = gnn.DistributedConv2d(self.P, 2, 4, 3, padding=1, dtype=torch.float64)
        self.bn = gnn.DistributedBatchNorm(self.P, 4, dtype=torch.float64)
        self.pool = gnn.DistributedMaxPool2d(self.P, 2)
        self.to_features = Repartition(self.P, self.Pf)
        self.fc = gnn.DistributedLinear(self.Pin, self.Pin, self.Pw, 4 * 4 * 4, 3,
                                        dtype=torch.float64)
        self.loss = gnn.DistributedLoss(self.Pin, "mse")

    def forward(self, x):
        y = self.pool(F.relu(self.bn(self.conv(x))))
        y = self.to_features(y).flatten(1)
        y = self.fc(y)
        return self.loss(y, torch.zeros(y.local.shape, dtype=torch.float64))


def _count_meta(steps=3):
    w = gpudist.world()
    net = _Net(w.size)
    x = DistTensor.from_local(torch.randn(2, 2, 8 // w.size, 8, dtype=torch.float64), net.P,
                              (2, 2, 8, 8))
    with counted_meta_exchanges() as calls:
        net(x).backward()  # first call: plans made, checked across ranks
        first = len(calls)
        with _Counter() as c:
            for _ in range(steps):
                net(x).backward()
    return first, len(calls) - first, c.syncs


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_metadata_collective_in_steady_state(cluster, backend):
    for first, later, syncs in cluster.run(4, _count_meta, backend=backend):
        assert first > 0  # the counter sees the first call's checks
        assert later == 0, later
        assert syncs == 0, syncs  # no .item() inside forward/backward either


def _count_meta_mixed(how, steps=3):
    """Training steps mixed with what real loops do between them: a no-grad call of the
    same layers (monitoring), or activation checkpointing (its recomputation runs the
    forward again, under no_grad for the reentrant form). Returns the metadata exchanges
    after the first step, and the input gradient (to compare with plain steps)."""
    import torch.utils.checkpoint as cp

    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    torch.manual_seed(0)
    c1 = gnn.DistributedConv2d(P, 2, 2, 3, padding=1, dtype=torch.float64)
    c2 = gnn.DistributedConv2d(P, 2, 2, 3, padding=1, dtype=torch.float64)
    x = DistTensor.from_local(global_tensor((1, 2, 4, 6), seed=w.rank).requires_grad_(True),
                              P, (1, 2, 4 * w.size, 6))
    def step():
        if how == "plain" or how == "monitor":
            c2(c1(x)).local.sum().backward()
            if how == "monitor":
                with torch.no_grad():
                    c2(c1(x))
        else:
            y = cp.checkpoint(lambda t: c2(c1(DistTensor(t, x.spec))).local, x.local,
                              use_reentrant=how == "reentrant")
            y.sum().backward()

    with counted_meta_exchanges() as calls:
        step()
        first = len(calls)
        for _ in range(steps - 1):
            step()
    return len(calls) - first, x.local.grad.tolist(), c1.weight.grad.tolist()


@pytest.mark.parametrize("how", ["monitor", "reentrant", "nonreentrant"])
def test_steady_state_with_no_grad_calls_and_checkpointing(cluster, how):
    """Metadata exchanges per step only where a layer's grad mode changes (one check per
    layer and change: ranks must agree on what a call records for backward);
    checkpointed steps give the plain steps' gradients."""
    got = cluster.run(2, _count_meta_mixed, how)
    ref = cluster.run(2, _count_meta_mixed, "plain")
    # monitor: train, then no_grad; reentrant: forward under no_grad, recomputed with grad
    # in backward. Either way each of the 2 layers changes mode twice in each of 2 steps.
    # Non-reentrant: forward and recomputation record alike (inside the region): none.
    checks = 0 if how == "nonreentrant" else 2 * 2 * 2
    for (later, gx, gw), (_, rx, rw) in zip(got, ref):
        assert later == checks, later
        assert torch.allclose(torch.tensor(gx), torch.tensor(rx), atol=1e-12)
        assert torch.allclose(torch.tensor(gw), torch.tensor(rw), atol=1e-12)


def _inference_then_train(mode):
    """A forward under ``mode`` (inference_mode or no_grad), then training steps: the
    buffers and plans the first call cached must serve the later ones (a fuzz found
    inference tensors cached by the first call refused by autograd later)."""
    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    torch.manual_seed(0)
    conv = gnn.DistributedConv2d(P, 2, 2, 3, padding=1, dtype=torch.float64)
    pool = gnn.DistributedMaxPool2d(P, 3, 1, 1)
    loss = gnn.DistributedLoss(P, "mse")
    move = Repartition(P, Partition.grid((1, 1, 1, w.size)))
    x = DistTensor.from_local(global_tensor((1, 2, 4, 6), seed=w.rank).requires_grad_(True),
                              P, (1, 2, 4 * w.size, 6))
    ctx = torch.inference_mode if mode == "inference" else torch.no_grad
    with ctx():
        loss(pool(conv(x)), torch.zeros(1, 2, 4, 6, dtype=torch.float64))
        move(x)
    for _ in range(2):
        y = pool(conv(x))
        (loss(y, y.local.detach() * 0.5) + move(y).local.sum()).backward()
    return x.local.grad.tolist(), conv.weight.grad.tolist()


def test_inference_mode_call_before_training(cluster):
    got = cluster.run(2, _inference_then_train, "inference")
    assert got == cluster.run(2, _inference_then_train, "no_grad")


def test_world_size_one_no_meta_no_sync(cluster):
    (res,) = cluster.run(1, _count_meta)
    assert res[1:] == (0, 0), res


# ------------------------------------------------------------------ allocations
def _primitive_cases(n):
    P, root = Partition.grid((n,)), Partition.root(1)
    f64 = torch.float64
    return [
        (Broadcast(root, P), TensorSpec(root, (6,), f64)),
        (SumReduce(P, root), TensorSpec(P, (6,), f64, placements=(PARTIAL,))),
        (AllSumReduce(P, [0]), TensorSpec(P, (6,), f64, placements=(PARTIAL,))),
        (Repartition(Partition.grid((n, 1)), Partition.grid((1, n))),
         TensorSpec(Partition.grid((n, 1)), (7, 5), f64)),
        (AllGather(P, 0, 0), TensorSpec(P, (9,), f64)),
        (ReduceScatter(P, 0, 0), TensorSpec(P, (9,), f64, placements=(PARTIAL,))),
        (HaloExchange(Partition.grid((1, 1, n)), 3, padding=1, pad_value=0.0),
         TensorSpec(Partition.grid((1, 1, n)), (2, 3, 4 * n), f64)),
    ]


def _allocations():
    """Per primitive, the allocations of 3 steady-state calls (forward and adjoint). A
    window is measured 3 times and the fewest kept: gloo's worker thread drops its reference to a
    finished collective's tensors a moment after the wait returns, and a pooled buffer
    still referenced then is (rightly) not handed out again; an allocation the code makes
    on every call shows in every window."""
    w = gpudist.world()
    out = {}
    for op, spec in _primitive_cases(w.size):
        x = global_tensor(spec.local_shape, seed=w.rank)
        plan = op.plan(spec)
        y = op.apply_plan(x, plan)
        dy = torch.ones_like(y)
        for _ in range(2):  # warm: buffers made
            op.run_adjoint(dy, plan)
            op.apply_plan(x, plan)
        windows = []
        for _ in range(3):  # every rank runs all three (the calls are collective)
            with without_periodic_check(), _Counter() as c:
                for _ in range(3):
                    y = op.apply_plan(x, plan)
                    op.run_adjoint(dy, plan)
                    del y
            windows.append(c.allocs)
        out[op.name] = min(windows, key=len)
    return out


def test_counter_sees_allocations_and_syncs():
    with _Counter() as c:
        a = torch.ones(3)
        (a + 1).sum().item()
    assert len(c.allocs) >= 2 and c.syncs == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_primitives_allocate_nothing_in_steady_state(cluster, backend):
    for per_rank in cluster.run(4, _allocations, backend=backend):
        assert all(v == [] for v in per_rank.values()), per_rank


# ------------------------------------------------------------------ bounded caches
def _many_shapes(n_shapes):
    P = Partition.grid((1, 1, 2))
    conv = gnn.DistributedConv1d(P, 2, 2, 3, padding=1)
    for k in range(n_shapes):
        x = DistTensor.from_local(torch.randn(1, 2, 4 + k), P, (1, 2, 2 * (4 + k)))
        conv(x).local.sum().backward()
    w = gpudist.world()
    return (len(conv._plans), len(conv.halo._plans), len(conv.halo.buffers._bufs),
            w.cache_size, conv.halo.buffers.max_keys)


def test_caches_are_bounded(cluster):
    for plans, halo_plans, bufs, size, max_keys in cluster.run(2, _many_shapes, 20):
        assert plans <= size and halo_plans <= size and bufs <= max_keys
        assert size == 8  # the default (GPUDIST_PLAN_CACHE)


# ------------------------------------------------------------------ host staging
def _staged():
    """Every tensor through the transport's staging buffers (as for CUDA tensors on gloo
    or a host-only MPI): the same results, and the buffers are made once."""
    w = gpudist.world()
    with forced_staging() as tr:
        P = Partition.grid((1, 1, w.size))
        G = global_tensor((2, 3, 5 * w.size), seed=3)
        x = G[..., 5 * w.rank:5 * (w.rank + 1)].clone()
        H = HaloExchange(P, 3, padding=1)
        y = H(x)
        ok = torch.equal(y, G[..., max(0, 5 * w.rank - 1):5 * (w.rank + 1) + 1])
        s = AllSumReduce(Partition.grid((w.size,)), [0])(torch.full((4,), 1.0 + w.rank))
        ok = ok and bool((s == sum(range(1, w.size + 1))).all())
        before = tr.staging.allocations
        for _ in range(3):
            H(x)
        return ok, tr.staging.allocations - before, before > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_staging_path(cluster, backend):
    for ok, new, used in cluster.run(3, _staged, backend=backend):
        assert ok and used and new == 0


def _staged_inputs_untouched():
    """Staged, a broadcast's root and a reduce's senders get nothing back: their inputs
    keep their autograd version, so a backward through them works (a copy back broke
    LeNet-5 on CUDA over gloo: the root's input was a ReLU output saved for backward).
    Checked at the transport (where the primitives' own scratch copies cannot hide it)
    and through the primitives with a backward."""
    w = gpudist.world()
    with forced_staging() as tr:
        g = tr.group(list(range(w.size)))
        t = torch.full((5,), float(w.rank + 1))
        v = t._version
        tr.wait([tr.broadcast(t, 0, g)])
        bcast_ok = (t._version == v) if w.rank == 0 else bool((t == 1).all())
        t = torch.full((5,), float(w.rank + 1))
        v = t._version
        tr.wait([tr.reduce(t, 1, g)])
        reduce_ok = bool((t == sum(range(1, w.size + 1))).all()) if w.rank == 1 else \
            t._version == v and bool((t == w.rank + 1).all())
        P, root = Partition.grid((w.size,)), Partition.root(1, 0)
        a = torch.linspace(-1, 1, 6, dtype=torch.float64).requires_grad_(True)
        x = F.relu(a) if w.rank == 0 else torch.empty(0, dtype=torch.float64,
                                                       requires_grad=True)
        y = Broadcast(root, P)(DistTensor.from_local(x, root, (6,)))
        h = F.relu(y.local * (w.rank + 1))
        z = SumReduce(P, root)(DistTensor(h, y.spec))
        loss = (z.local * z.local).sum() if w.rank == 0 else z.local.sum()
        loss.backward()
        s = sum(range(1, w.size + 1))
        want = 2 * s * s * F.relu(a.detach()) * (a.detach() > 0)
        grad_ok = w.rank != 0 or torch.allclose(a.grad, want)
        return bcast_ok, reduce_ok, grad_ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_inputs_keep_their_version(cluster, backend):
    for oks in cluster.run(3, _staged_inputs_untouched, backend=backend):
        assert all(oks), oks


def _every_layer_staged():
    """The GPU suite's every-layer comparison (tests/test_gpu.py) on CPU tensors, every
    tensor through the staging buffers as CUDA tensors go over gloo and MPI."""
    from tests.test_gpu import _every_layer

    with forced_staging():
        return _every_layer()


@pytest.mark.parametrize("n", [2, 4])
def test_every_layer_staged(cluster, backend, n):
    for per_rank in cluster.run(n, _every_layer_staged, backend=backend):
        for name, errs in per_rank.items():  # (the CUDA-placement check says 1 on CPU)
            assert all(v < 1e-10 for k, v in errs.items() if k != "on_device_or_empty"), \
                (name, errs)
        assert {"conv", "batchnorm", "upsample"} <= set(per_rank)


def _kept():
    """Bytes each primitive keeps between calls after a Broadcast and a SumReduce back."""
    w = gpudist.world()
    P, root = Partition.grid((w.size,)), Partition.root(1, 0)
    x = torch.rand(1000) if w.rank == 0 else torch.empty(0)
    b, s = Broadcast(root, P), SumReduce(P, root)
    y = b(DistTensor.from_local(x, root, (1000,)))
    s(y)
    return w.rank, b.kept_nbytes(), s.kept_nbytes()


def _kept_by_direction():
    """A Repartition's kept bytes after forwards only, then after a backward too."""
    P_rows, P_cols = Partition.grid((3, 1)), Partition.grid((1, 3))
    op = Repartition(P_rows, P_cols)
    x = DistTensor.from_local(torch.rand(3, 3, requires_grad=True), P_rows, (9, 3))
    for _ in range(2):  # (the last output dropped first: its buffer is taken again)
        y = None
        y = op(x)
    fwd = op.kept_nbytes()
    y.local.sum().backward()
    return fwd, op.kept_nbytes()


def test_kept_bytes_by_direction(cluster, backend):
    """Rows to columns over 3 ranks, float32: the forward keeps its output (9 entries)
    and its packed columns (9); the adjoint's buffers (its output, its received columns
    to unpack) appear only once a backward ran (they were made with the plan before)."""
    for fwd, both in cluster.run(3, _kept_by_direction, backend=backend):
        assert (fwd, both) == (72, 144), (fwd, both)


def test_kept_bytes(cluster, backend):
    """What the bench reports as kept: the root's Broadcast returns its input (nothing
    kept), the others' receive into a pooled block; SumReduce's root keeps its sum and the
    buffer it receives its second child's sum in (a tree of 3: children 1 and 2), the
    others send their own block (nothing kept)."""
    for rank, kb, ks in cluster.run(3, _kept, backend=backend):
        assert kb == (0 if rank == 0 else 4000), (rank, kb)
        assert ks == (8000 if rank == 0 else 0), (rank, ks)
