"""Cross-entropy and NLL with the class dimension split (a vocabulary-parallel loss)
against torch's, in float64: the loss and the input's whole gradient, gathered."""

import pytest
import torch
import torch.nn.functional as F

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from tests.conftest import HAS_MPI
from tests.util import block_of, gather, maxerr

TOL = 1e-10
W5 = [0.5, 1.0, 2.0, 1.5, 0.25]


def _data(kind, gshape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gshape, generator=g, dtype=torch.float64) * 3
    C = gshape[1]
    if kind == "probs":
        t = F.softmax(torch.randn(gshape, generator=g, dtype=torch.float64), 1)
    else:
        t = torch.randint(0, C, (gshape[0],) + tuple(gshape[2:]), generator=g)
        if kind in ("ignore", "ignore255"):
            t.view(-1)[::3] = 255 if kind == "ignore255" else 1
    if kind == "logprob":
        x = F.log_softmax(x, 1)
    return x, t


def _class_loss(name, kind, opts, reduction, pshape, gshape, ranks=None, dtype=None):
    """(|loss - torch's|, max |dx - torch's|) on this rank (0 where it holds nothing);
    ``dtype``: the input's (float64 if None), torch's loss taken in float64."""
    from gpudist import Decomposition

    w = gpudist.world()
    P = Partition(ranks, pshape) if ranks is not None else Partition.grid(pshape)
    opts = dict(opts)
    if "weight" in opts:
        opts["weight"] = torch.tensor(opts["weight"][:gshape[1]], dtype=torch.float64)
    X, T = _data(kind, gshape, 11)
    x = block_of(X, P).to(dtype or X.dtype).requires_grad_(True)
    if kind == "probs":
        t = block_of(T, P)
    elif P.active:
        sl = Decomposition(gshape, P.shape).global_slices(P.coords)
        t = T[(sl[0],) + sl[2:]].clone()
    else:
        t = T[:0]
    fn = F.cross_entropy if name == "cross_entropy" else F.nll_loss
    loss = gnn.DistributedLoss(P, name, reduction, **opts)(DistTensor.from_local(x, P, gshape), t)
    loss.backward()
    Xs = X.clone().requires_grad_(True)
    L = fn(Xs, T, reduction=reduction, **opts)
    L.backward()
    root = Partition([P.ranks[0]], (1,) * P.dim)
    value = abs(float(loss) - float(L)) if root.active else abs(float(loss))
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    dxg, root = gather(dx.to(torch.float64), P, gshape)
    return w.rank, value, maxerr(dxg, Xs.grad) if root.active else 0.0


CASES = [
    ("cross_entropy", "index", {}),
    ("cross_entropy", "index", {"weight": W5}),
    ("cross_entropy", "index", {"label_smoothing": 0.2}),
    ("cross_entropy", "index", {"label_smoothing": 0.1, "weight": W5}),
    ("cross_entropy", "ignore", {"ignore_index": 1, "label_smoothing": 0.1}),
    ("cross_entropy", "ignore255", {"ignore_index": 255, "weight": W5}),
    ("cross_entropy", "probs", {}),
    ("cross_entropy", "probs", {"label_smoothing": 0.3, "weight": W5}),
    ("nll", "logprob", {}),
    ("nll", "logprob", {"weight": W5}),
    ("nll", "ignore255", {"ignore_index": 255, "weight": W5}),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{len(c[2])}")
def test_class_split_loss_equals_torch(cluster, case, reduction):
    """Classes split 3 ways, unevenly (5 classes: 2, 2, 1), batch and a spatial dim split
    too: (1, 3, 1) over 3 ranks and (2, 2, 1) over 4."""
    for pshape, n in (((1, 3, 1), 3), ((2, 2, 1), 4)):
        for _, dl, dx in cluster.run(n, _class_loss, *case, reduction, pshape, (5, 5, 3)):
            assert dl < TOL and dx < TOL, (pshape, dl, dx)


@pytest.mark.parametrize("gshape,pshape", [
    ((4, 2), (1, 3)),        # a worker without classes (2 classes over 3)
    ((3, 7, 2, 2), (1, 2, 2, 1)),
    ((0, 4), (1, 2)),        # no samples
    ((6, 9), (3, 1)),        # classes not split: the usual path, same answers
])
def test_class_split_loss_shapes(cluster, gshape, pshape):
    n = 1
    for s in pshape:
        n *= s
    case = ("cross_entropy", "index", {"label_smoothing": 0.1, "weight": W5 + W5})
    for _, dl, dx in cluster.run(n, _class_loss, *case, "mean", pshape, gshape):
        assert dx < TOL and (dl < TOL or gshape[0] == 0), (gshape, pshape, dl, dx)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_class_split_loss_lower_precision(cluster, dtype, tol):
    """float32 and bfloat16 logits (summed in float32): close to torch's float64 loss."""
    case = ("cross_entropy", "index", {"label_smoothing": 0.1, "weight": W5})
    for _, dl, dx in cluster.run(2, _class_loss, *case, "mean", (1, 2, 1), (6, 5, 2),
                                 dtype=dtype):
        assert dl < tol and dx < tol, (dtype, dl, dx)


def test_class_split_loss_on_some_ranks_and_mpi(cluster):
    """The loss's partition on ranks 1 and 2 of 3 (rank 0 outside it), over MPI."""
    backend = "mpi" if HAS_MPI else "gloo"
    got = cluster.run(3, _class_loss, "cross_entropy", "ignore", {"ignore_index": 1},
                      "mean", (1, 2), (6, 5), [1, 2], backend=backend)
    for _, dl, dx in got:
        assert dl < TOL and dx < TOL, got


def _targets_differ():
    w = gpudist.world()
    P = Partition.grid((1, 2))
    x = torch.randn(4, 3, dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 3]) if w.rank == 0 else torch.tensor([0, 1, 2, 0])
    gnn.DistributedLoss(P, "cross_entropy")(DistTensor.from_local(x, P, (4, 6)), t)


def _target_out_of_range():
    P = Partition.grid((1, 2))
    x = torch.randn(4, 3, dtype=torch.float64)
    gnn.DistributedLoss(P, "cross_entropy")(DistTensor.from_local(x, P, (4, 6)),
                                             torch.tensor([0, 1, 6, 3]))


def _empty_block_wrong_target(samples: bool):
    """P (1, 3): with 2 classes rank 2's block holds none (or, with 0 samples, every block
    is empty); its target has the wrong length (fuzz-found: a raw torch error on that rank
    alone, the others aborted)."""
    w = gpudist.world()
    P = Partition.grid((1, 3))
    if samples:
        g, x = (0, 3), torch.randn(0, 1, dtype=torch.float64)
        t = torch.tensor([0]) if w.rank == 2 else torch.zeros(0, dtype=torch.int64)
    else:
        g, x = (4, 2), torch.randn(4, 1 if w.rank < 2 else 0, dtype=torch.float64)
        t = torch.tensor([0, 1, 1, 0] if w.rank < 2 else [0, 1, 1, 0, 1])
    gnn.DistributedLoss(P, "cross_entropy")(DistTensor.from_local(x, P, g), t)


@pytest.mark.parametrize("samples", [False, True], ids=["no-classes", "no-samples"])
def test_class_split_loss_empty_block_checks_its_target(cluster, samples):
    errs = cluster.run(3, _empty_block_wrong_target, samples, expect_error=True)
    assert all(e is not None and e.type == "ShapeError" and "rank(s) [2]" in e.message
               for e in errs), errs


def _none_reduction():
    gnn.DistributedLoss(Partition.grid((1, 2)), "cross_entropy", "none")


@pytest.mark.parametrize("fn,text", [
    (_targets_differ, "different targets"), (_target_out_of_range, "out of bounds"),
    (_none_reduction, "reduction='none'")])
def test_class_split_loss_errors(cluster, fn, text):
    """Targets that differ along the class axis, a class out of range, and the
    unsupported reduction: an error naming it on every rank, never a wrong loss."""
    errs = cluster.run(2, fn, expect_error=True)
    assert all(e is not None and text in e.message for e in errs), errs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to 1e-12, NaN where the other is NaN, inf where it is inf."""
    return bool(torch.allclose(a, b, rtol=0, atol=1e-12, equal_nan=True))


def _edge_values():
    """Non-finite logits and an all-ignored batch (review-found: a clamped index's -inf
    read x 0, an ignored padding row x 0 and the all-ignored mean's inf gradient x 0 gave
    NaN where torch's loss and gradients are finite)."""
    from gpudist import Decomposition

    inf = float("inf")
    P = Partition.grid((1, 2))
    cases = [  # (input, target, fn, options)
        ([[1.0, 0.5, -inf, 0.3]], [0], F.cross_entropy, {}),
        (torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]])).tolist(), [1], F.nll_loss, {}),
        ([[0.3, -1.2, 0.8, 2.0], [1.0, 0.0, 0.5, 0.1]], [-100, -100], F.cross_entropy, {}),
        ([[1.0, 2.0, 0.0, 0.5], [-inf, -inf, -inf, -inf]], [3, -100], F.cross_entropy, {}),
        ([[1.0, 0.5, -inf, 0.3]], [0], F.cross_entropy, {"label_smoothing": 0.1}),
    ]
    out = []
    for X, T, fn, opts in cases:
        X, T = torch.tensor(X, dtype=torch.float64), torch.tensor(T)
        sl = Decomposition(tuple(X.shape), P.shape).global_slices(P.coords)
        x = X[sl].clone().requires_grad_(True)
        name = "cross_entropy" if fn is F.cross_entropy else "nll"
        loss = gnn.DistributedLoss(P, name, "mean", **opts)(
            DistTensor.from_local(x, P, tuple(X.shape)), T)
        loss.backward()
        Xs = X.clone().requires_grad_(True)
        L = fn(Xs, T, reduction="mean", **opts)
        L.backward()
        value = _same(loss.detach(), L.detach()) if P.coords[1] == 0 else float(loss) == 0
        out.append((value, _same(x.grad, Xs.grad[sl])))
    return out


def _zero_total_weight(pshape):
    """Every counted target's class weight is 0 (fuzz-found: with label smoothing the mean
    was inf, torch's is NaN, 0/0): the loss and the gradient as torch's, NaN included."""
    from gpudist import Decomposition

    P = Partition.grid(pshape)
    X = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    T = torch.tensor([1, 0, 1, 0])
    out = []
    for ls in (0.0, 0.1):
        opts = dict(weight=torch.tensor([0.85, 0.0, 1.0, 1.0], dtype=torch.float64),
                    ignore_index=0, label_smoothing=ls)
        sl = Decomposition(tuple(X.shape), P.shape).global_slices(P.coords)
        x = X[sl].clone().requires_grad_(True)
        loss = gnn.DistributedLoss(P, "cross_entropy", **opts)(
            DistTensor.from_local(x, P, tuple(X.shape)), T[sl[0]])
        loss.backward()
        Xs = X.clone().requires_grad_(True)
        L = F.cross_entropy(Xs, T, **opts)
        L.backward()
        root = P.coords == (0, 0)
        out.append((bool(L.isnan()), _same(loss.detach(), L.detach()) if root else True,
                    _same(x.grad, Xs.grad[sl])))
    return out


@pytest.mark.parametrize("pshape", [(1, 2), (2, 1)], ids=["classes-split", "samples-split"])
def test_loss_mean_of_zero_total_weight_is_nan(cluster, pshape):
    for got in cluster.run(2, _zero_total_weight, pshape):
        assert all(all(case) for case in got), got


def test_class_split_loss_edge_values(cluster):
    for got in cluster.run(2, _edge_values):
        assert all(v and g for v, g in got), got


def _bad_option(opts, name):
    P = Partition.grid((1, 2))
    loss = gnn.DistributedLoss(P, name, **opts)
    loss(DistTensor.from_local(torch.randn(3, 2, dtype=torch.float64), P, (3, 4)),
         torch.tensor([0, 1, 3]))


@pytest.mark.parametrize("opts,name,text", [
    ({"label_smoothing": 0.1}, "nll", "unexpected option"),
    ({"ignore_idx": 3}, "cross_entropy", "unexpected option"),
    ({"label_smoothing": 1.5}, "cross_entropy", "between 0.0 and 1.0"),
    ({"weight": torch.ones(5, dtype=torch.float64)}, "cross_entropy", "5 entries for 4"),
])
def test_class_split_loss_bad_options(cluster, opts, name, text):
    """Options torch would refuse (this path does not call torch's loss): an error
    naming them on every rank."""
    errs = cluster.run(2, _bad_option, opts, name, expect_error=True)
    assert all(e is not None and text in e.message for e in errs), errs
