"""Activation checkpointing of distributed regions: torch.utils.checkpoint with
use_reentrant=False (gpudist.checkpoint) and True give the plain steps' values and
gradients, with inactive ranks, broadcasts' roots, frozen weights and inputs that require
no grad, with and without torch's early stop; what a region cannot take (a call that
records nothing, a plain block) is refused on every rank; ranks that checkpoint
differently are told on every rank."""

import pytest
import torch
import torch.utils.checkpoint as cp

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition, TensorSpec
from gpudist.primitives import Repartition, distribute
from tests.conftest import BACKENDS

F64 = torch.float64


def _general_chain(how, early=True, frozen=False, input_grad=True, steps=2):
    """4 ranks: a general conv (x broadcast over c_out, y reduced over c_in) on a subset,
    a Repartition onto other ranks, a strided spatial conv there (two ranks inactive), a
    Repartition and an MSE loss, in one checkpointed region. Returns the loss and each
    gradient this rank holds."""
    w = gpudist.world()
    root = Partition.root(4)
    P_w = Partition.grid((1, 2, 2, 1, 1))
    P_x = Partition([0, 1], (1, 2, 1, 1))
    P_y = Partition([0, 2], (1, 2, 1, 1))
    P_sp = Partition([1, 3], (1, 1, 2, 1))
    P_out = Partition([1, 3], (1, 1, 1, 2))
    torch.manual_seed(0)
    conv = gnn.DistributedConv2d(P_x, 4, 4, 3, padding=1, P_w=P_w, P_y=P_y, dtype=F64)
    to_sp, to_out = Repartition(P_y, P_sp), Repartition(P_sp, P_out)
    c2 = gnn.DistributedConv2d(P_sp, 4, 2, 3, padding=1, stride=2, dtype=F64)
    mse = gnn.DistributedMSELoss(P_out)
    if frozen:  # the weight ("all": the bias too)
        (conv if frozen == "all" else conv.weight).requires_grad_(False)
    G = torch.rand(2, 4, 6, 5, dtype=F64, generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        x = distribute((G.clone() if root.active else torch.zeros(0, dtype=F64))
                       .requires_grad_(input_grad), root, P_x, global_shape=tuple(G.shape))

        def region(t, spec=x.spec):
            y = to_out(c2(to_sp(conv(DistTensor(t, spec)))))
            return mse(y, torch.zeros_like(y.local))

        if how == "plain":
            loss = region(x.local)
        else:
            with cp.set_checkpoint_early_stop(early):
                loss = cp.checkpoint(region, x.local, use_reentrant=how == "reentrant")
        loss.backward()
        losses.append(float(loss.detach()))
    grads = {n: p.grad.tolist() for n, p in  # (lists: MPI pools pickle plain values)
             [*conv.named_parameters("conv"), *c2.named_parameters("c2")] if p.grad is not None}
    return losses, grads, w.rank


def _same(ref, got):
    (lr, gr, _), (lg, gg, _) = ref, got
    assert lr == pytest.approx(lg, abs=1e-12)
    assert gr.keys() == gg.keys()
    for k in gr:
        assert torch.allclose(torch.tensor(gr[k]), torch.tensor(gg[k]), atol=1e-12), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonreentrant_checkpoint_of_a_general_chain(cluster, backend):
    ref = cluster.run(4, _general_chain, "plain", backend=backend)
    for how, early in (("nonreentrant", True), ("nonreentrant", False), ("reentrant", True)):
        for r, g in zip(ref, cluster.run(4, _general_chain, how, early, backend=backend)):
            _same(r, g)


@pytest.mark.parametrize("frozen,input_grad", [(True, True), (False, False), (True, False)])
def test_nonreentrant_checkpoint_frozen_weights_and_inputs_without_grad(cluster, frozen,
                                                                         input_grad):
    """A layer whose call records for backward through its input or a parameter (the
    frozen weight's broadcast, the data input's halo inside it record nothing, but every
    rank taking part saves and recomputes): the same values and gradients."""
    ref = cluster.run(4, _general_chain, "plain", True, frozen, input_grad)
    got = cluster.run(4, _general_chain, "nonreentrant", True, frozen, input_grad)
    for r, g in zip(ref, got):
        _same(r, g)


def _edges_chain(how, early=True, steps=2):
    """A conv, batch norm (training), max pooling and bilinear up-sampling by the edge
    split (halo exchanges inside their own autograd nodes), a conv: 3 ranks, split over
    H, uneven."""
    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    torch.manual_seed(0)
    c1 = gnn.DistributedConv2d(P, 2, 3, 3, padding=1, dtype=F64)
    bn = gnn.DistributedBatchNorm(P, 3, dtype=F64)
    pool = gnn.DistributedMaxPool2d(P, 2)
    up = gnn.DistributedUpsample(P, scale_factor=2, mode="bilinear")
    c2 = gnn.DistributedConv2d(P, 3, 2, 3, padding=1, dtype=F64)
    root = Partition.root(4)
    G = torch.rand(2, 2, 16, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):  # 16 rows over 3 ranks: uneven blocks
        x = distribute((G.clone() if root.active else torch.zeros(0, dtype=F64))
                       .requires_grad_(), root, P, global_shape=tuple(G.shape))
        x.local.retain_grad()

        def region(t, spec=x.spec):
            return c2(up(pool(bn(c1(DistTensor(t, spec))).relu()))).local

        if how == "plain":
            y = region(x.local)
        else:
            with cp.set_checkpoint_early_stop(early):
                y = cp.checkpoint(region, x.local, use_reentrant=False)
        (y * y).sum().backward()
        out.append(x.local.grad.tolist())
    return [out] + [None if p.grad is None else p.grad.tolist()
                    for p in (c1.weight, c2.weight, bn.weight)]


@pytest.mark.parametrize("early", [True, False])
def test_nonreentrant_checkpoint_of_edge_split_layers(cluster, early):
    ref = cluster.run(3, _edges_chain, "plain")
    for r, g in zip(ref, cluster.run(3, _edges_chain, "nonreentrant", early)):
        for a, b in zip(r, g):
            assert (a is None) == (b is None)
            assert a is None or torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-12)


def _conv_and_input():
    """A conv split over H on 2 ranks and an input block that requires grad."""
    P = Partition.grid((1, 1, 2, 1))
    torch.manual_seed(0)
    conv = gnn.DistributedConv2d(P, 2, 2, 3, padding=1, dtype=F64)
    x = DistTensor.from_local(torch.rand(1, 2, 3, 4, dtype=F64, requires_grad=True), P,
                              (1, 2, 6, 4))
    return conv, x


def _one_rank_checkpoints():
    """Rank 0 wraps the layer in a non-reentrant checkpoint, rank 1 does not."""
    w = gpudist.world()
    conv, x = _conv_and_input()

    def region(t):
        return conv(DistTensor(t, x.spec)).local

    y = cp.checkpoint(region, x.local, use_reentrant=False) if w.rank == 0 else \
        region(x.local)
    y.sum().backward()


def test_checkpointing_on_some_ranks_only_is_a_mismatch_everywhere(cluster):
    errs = cluster.run(2, _one_rank_checkpoints, expect_error=True)
    assert all(e is not None and e.type == "MismatchError"
               and "checkpoint(use_reentrant=False)" in e.message for e in errs), errs


def _refused(case):
    """A region holding a call that communicates but records nothing, or a plain block
    (a review and a fuzz found such ranks never recomputing while their peers did: wrong
    labels in a recomputed broadcast, a shape exchange left over)."""
    from gpudist.primitives import Broadcast

    if case == "frozen_layer":
        return _general_chain("nonreentrant", True, "all", False, steps=1)
    w = gpudist.world()
    conv, x = _conv_and_input()
    labels = Broadcast(Partition([0], (1,)), Partition.grid((2,)))
    spec = TensorSpec(Partition([0], (1,)), (4,), torch.int64, "cpu")
    lab = DistTensor(torch.arange(4) if w.rank == 0 else torch.zeros(0, dtype=torch.int64),
                     spec)

    def region(t):
        y = conv(DistTensor(t, x.spec))
        if case == "no_grad":
            with torch.no_grad():
                conv(y)
        elif case == "plain":
            return conv(y.local)
        elif case == "integer":
            return y.local * labels(lab).local.sum()
        return y.local

    cp.checkpoint(region, x.local, use_reentrant=False).sum().backward()


@pytest.mark.parametrize("case", ["frozen_layer", "no_grad", "plain", "integer"])
def test_nonreentrant_checkpoint_refuses_calls_that_record_nothing(cluster, case):
    n = 4 if case == "frozen_layer" else 2
    errs = cluster.run(n, _refused, case, expect_error=True)
    assert all(e is not None and "use_reentrant=False" in e.message
               and e.type in ("RuntimeError", "RemoteError") for e in errs), errs
