"""Batch norm options and the loss family against torch, in float64 (issues #15, #17)."""

import pytest
import torch
import torch.nn.functional as F

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from tests.conftest import HAS_MPI
from tests.util import block_of, gather, global_tensor, maxerr

TOL = 1e-10


# ------------------------------------------------------------------ batch norm
def _bn_case(pshape, ranks, gshape, kw, steps=2, train=True):
    """Distributed vs torch batch norm: outputs, input/parameter gradients, running
    statistics after ``steps`` steps (training) and an eval step."""
    torch.manual_seed(0)
    P = Partition(ranks, pshape)
    nd = len(gshape) - 2
    seq = getattr(torch.nn, f"BatchNorm{nd}d")(gshape[1], dtype=torch.float64, **kw)
    layer = gnn.DistributedBatchNorm(P, gshape[1], dtype=torch.float64, **kw)
    with torch.no_grad():
        if seq.weight is not None:
            seq.weight.uniform_(0.5, 1.5)
            seq.bias.uniform_(-1, 1)
    layer.load_global_state_dict(seq.state_dict())
    errs = {}
    for step in range(steps):
        G = global_tensor(gshape, seed=step) * 3 + 100  # a large mean: no cancellation
        x = block_of(G, P).requires_grad_(True)
        Gs = G.clone().requires_grad_(True)
        layer.train(train)
        seq.train(train)
        y = layer(x)
        Y = seq(Gs)
        dY = global_tensor(Y.shape, seed=10 + step)
        y.backward(block_of(dY, P))
        Y.backward(dY)
        yg, root = gather(y, P, Y.shape)
        dxg, _ = gather(x.grad, P, G.shape)
        grads = layer.global_grads()
        if root.active:
            errs[f"y{step}"] = maxerr(yg, Y.detach())
            errs[f"dx{step}"] = maxerr(dxg, Gs.grad)
            if seq.weight is not None:
                errs[f"dw{step}"] = maxerr(grads["weight"], seq.weight.grad)
                errs[f"db{step}"] = maxerr(grads["bias"], seq.bias.grad)
        seq.zero_grad()
        layer.zero_grad()
    sd = layer.global_state_dict()
    if sd:
        ref = seq.state_dict()
        for k in ("running_mean", "running_var", "num_batches_tracked"):
            if k in ref:
                errs[k] = maxerr(sd[k].double(), ref[k].double())
        assert set(sd) == set(ref), (sorted(sd), sorted(ref))
    return errs


BN_CASES = [
    # partition shape, ranks, global shape, options
    ((2, 1, 2, 1), [0, 1, 2, 3], (5, 3, 7, 4), {}),
    ((1, 2, 2, 1), [0, 1, 2, 3], (4, 5, 6, 3), {}),                   # channels split
    ((2, 2, 1), [0, 1, 2, 3], (3, 5, 9), {"momentum": None}),         # cumulative average
    ((1, 1, 3, 1), [1, 2, 3], (2, 4, 7, 5), {"affine": False}),       # rank 0 inactive
    ((2, 1, 1, 2), [0, 1, 2, 3], (2, 3, 5, 6), {"track_running_stats": False}),
    ((3, 1, 1, 1, 1), [0, 1, 2], (2, 2, 3, 4, 5), {}),                 # 3-D, an empty block
]


@pytest.mark.parametrize("case", BN_CASES, ids=lambda c: f"{c[0]}-{c[3]}")
def test_batchnorm_options_equal_torch(cluster, case):
    res = cluster.run(4, _bn_case, *case)
    assert any(res), "the root reported nothing"
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_batchnorm_eval_without_running_stats(cluster):
    """track_running_stats=False: eval mode normalises with the batch's own statistics."""
    res = cluster.run(4, _bn_case, (2, 1, 2, 1), [0, 1, 2, 3], (4, 3, 6, 4),
                      {"track_running_stats": False}, 1, False)
    assert all(v < TOL for r in res for v in r.values()) and any(res)


def _bn_single_value(eval_without_stats: bool = False):
    P = Partition.grid((2, 1, 1, 1))
    layer = gnn.DistributedBatchNorm(P, 3, track_running_stats=not eval_without_stats)
    if eval_without_stats:  # batch statistics in eval mode too: torch refuses the same
        layer.eval()
    layer(DistTensor.from_local(torch.randn(1, 3, 1, 1) if P.index == 0 else
                                torch.zeros(0, 3, 1, 1), P, (1, 3, 1, 1)))


@pytest.mark.parametrize("eval_without_stats", [False, True])
def test_batchnorm_one_value_per_channel_is_an_error(cluster, eval_without_stats):
    errs = cluster.run(2, _bn_single_value, eval_without_stats, expect_error=True)
    assert all(e is not None and "Expected more than 1 value per channel" in e.message
               for e in errs), errs


def _bn_running_edited_on_one_rank(edit: bool):
    P = Partition.grid((2, 1, 2, 1))  # one channel block: four copies of its statistics
    layer = gnn.DistributedBatchNorm(P, 3, dtype=torch.float64)
    G = global_tensor((4, 3, 6, 4), seed=1)
    layer(block_of(G, P))
    if edit and P.index == 3:  # one rank's copy changed (e.g. a reset on that rank only)
        with torch.no_grad():
            layer.running_mean.zero_()
    errs = []
    for step in ("eval forward", "state dict"):
        try:
            if step == "eval forward":  # the first call normalising with them checks
                layer.eval()
                layer(block_of(G, P))
                layer(block_of(G, P))  # (once: not again while nothing trained)
            else:
                layer.global_state_dict()
        except gpudist.MismatchError as e:
            errs.append(str(e))
    # the world stays usable: a following call and state dict work
    layer.load_global_state_dict(torch.nn.BatchNorm2d(3, dtype=torch.float64).state_dict())
    layer(block_of(G, P))
    sd = layer.global_state_dict()
    return errs, sorted(sd)


@pytest.mark.parametrize("edit", [False, True])
def test_batchnorm_running_stats_changed_on_one_rank(cluster, edit):
    """The copies of a channel block's running statistics are compared at the first call
    that normalises with them and when the state dict is gathered: changed on one rank
    only, a MismatchError names the ranks on every rank."""
    res = cluster.run(4, _bn_running_edited_on_one_rank, edit)
    for errs, _keys in res:
        if edit:
            assert len(errs) == 2, errs
            for err in errs:
                assert "running statistics differ" in err \
                    and "3" in err.split("channel block 0:")[1], err
            assert "eval mode" in errs[0] and "global_state_dict" in errs[1], errs
        else:
            assert errs == [], errs
    assert res[0][1] == ["bias", "num_batches_tracked", "running_mean", "running_var",
                         "weight"]


def _bn_pair_swapped():
    """Two batch norms on disjoint ranks ([0, 1] and [2, 3]: equal layer numbers), their
    first eval calls in swapped order on ranks 2, 3: a program that differs, found in the
    copies' check as such (it read as copies that differ)."""
    A = gnn.DistributedBatchNorm(Partition([0, 1], (2, 1, 1)), 2, dtype=torch.float64)
    B = gnn.DistributedBatchNorm(Partition([2, 3], (2, 1, 1)), 2, dtype=torch.float64)
    with torch.no_grad():
        B.running_mean.fill_(5.0)
    A.eval()
    B.eval()
    xa = _dist_block(A.P_x)
    xb = _dist_block(B.P_x)
    try:
        for layer, x in ((A, xa), (B, xb)) if gpudist.world().rank < 2 else ((B, xb), (A, xa)):
            layer(x)
    except gpudist.MismatchError as e:
        return str(e)
    except gpudist.RemoteError as e:  # a peer raised it first and posted it (1 run in 8)
        return str(e)
    return "no error"


def _dist_block(P):
    G = global_tensor((4, 2, 3), seed=0)
    return DistTensor.from_local(block_of(G, P), P, tuple(G.shape))  # (no metadata
    # exchange: the copies' check is the first one the ranks meet)


def test_batchnorm_copies_check_tells_layers_apart(cluster):
    out = cluster.run(4, _bn_pair_swapped)
    assert all("different operators" in o for o in out), out


def _bn_float32_large_mean():
    P = Partition.grid((2, 1, 1, 1))
    G = (torch.randn(8, 2, 5, 5, generator=torch.Generator().manual_seed(0)) * 0.1 + 300)
    layer = gnn.DistributedBatchNorm(P, 2)
    y = layer(block_of(G, P))
    Y = torch.nn.BatchNorm2d(2)(G)
    yg, root = gather(y, P, Y.shape)
    return maxerr(yg, Y.detach()) if root.active else 0.0


def test_batchnorm_float32_large_mean(cluster):
    assert max(cluster.run(2, _bn_float32_large_mean)) < 1e-3


# ------------------------------------------------------------------ losses
LOSS_CASES = [
    # name, torch function, options, kind of input/target
    ("mse", F.mse_loss, {}, "real"),
    ("l1", F.l1_loss, {}, "real"),
    ("smooth_l1", F.smooth_l1_loss, {"beta": 0.5}, "real"),
    ("bce", F.binary_cross_entropy, {}, "prob"),
    ("bce_with_logits", F.binary_cross_entropy_with_logits, {}, "logit"),
    ("kl_div", F.kl_div, {}, "logprob"),
    ("kl_div", F.kl_div, {"log_target": True}, "logprob2"),
    ("poisson_nll", F.poisson_nll_loss, {"full": True}, "rate"),
    ("cross_entropy", F.cross_entropy, {}, "class"),
    ("cross_entropy", F.cross_entropy, {"label_smoothing": 0.1, "ignore_index": 2}, "class"),
    ("nll", F.nll_loss, {"weight": torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)},
     "classlog"),
    # an ignore_index outside the classes (e.g. 255 for unlabelled pixels) held by some
    # targets, with class weights: the mean's divisor indexed the weights with it (fuzz)
    ("cross_entropy", F.cross_entropy,
     {"weight": torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64), "ignore_index": 255},
     "class255"),
    ("nll", F.nll_loss,
     {"weight": torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64), "ignore_index": 255},
     "classlog255"),
]


def _data(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "prob":
        x, t = torch.sigmoid(x), torch.rand(shape, generator=g, dtype=torch.float64)
    elif kind == "logit":
        t = torch.rand(shape, generator=g, dtype=torch.float64)
    elif kind == "logprob":
        x, t = F.log_softmax(x, 1), F.softmax(t, 1)
    elif kind == "logprob2":
        x, t = F.log_softmax(x, 1), F.log_softmax(t, 1)
    elif kind == "rate":
        t = torch.poisson(torch.rand(shape, generator=g, dtype=torch.float64) * 3, generator=g)
    elif kind.startswith("class"):
        t = torch.randint(0, shape[1], (shape[0],) + shape[2:], generator=g)
        if kind.startswith("classlog"):
            x = F.log_softmax(x, 1)
        if kind.endswith("255"):  # every third target unlabelled
            t.view(-1)[::3] = 255
    return x, t


def _loss_case(name, fn, opts, kind, reduction, pshape, gshape, dist_target=False):
    P = Partition.grid(pshape)
    X, T = _data(kind, gshape, 5)
    x = block_of(X, P).requires_grad_(True)
    if kind.startswith("class"):  # targets: the input's blocks without the class dim
        from gpudist import Decomposition

        sl = Decomposition(gshape, P.shape).global_slices(P.coords) if P.active else None
        t = T[(sl[0],) + sl[2:]] if P.active else T[:0]
        if dist_target:  # over the input's partition without the class dim's extent
            t = DistTensor.from_local(t, Partition(P.ranks, P.shape[:1] + P.shape[2:]),
                                      tuple(T.shape))
    else:
        t = block_of(T, P)
        if dist_target:
            t = DistTensor.from_local(t, P, tuple(T.shape))
    layer = gnn.DistributedLoss(P, name, reduction, **opts)
    loss = layer(DistTensor.from_local(x, P, gshape), t)
    Xs = X.clone().requires_grad_(True)
    L = fn(Xs, T, reduction=reduction, **opts)
    if reduction == "none":
        dL = global_tensor(L.shape, seed=9)
        if P.active:
            dl = block_of(dL, Partition(P.ranks, P.shape[:1] + P.shape[2:])) \
                if kind.startswith("class") else block_of(dL, P)
        else:
            dl = torch.zeros(loss.local.shape, dtype=torch.float64)
        loss.local.backward(dl)
        L.backward(dL)
        lg, root = gather(loss.local, loss.partition, L.shape)
        value = maxerr(lg, L.detach()) if root.active else 0.0
    else:
        assert loss.dim() == 0  # a 0-dim loss on every rank: plain backward() everywhere
        loss.backward()
        L.backward()
        root = Partition([P.ranks[0]], (1,) * P.dim)
        value = abs(float(loss) - float(L)) if root.active else abs(float(loss))
    dxg, root = gather(x.grad if x.grad is not None else torch.zeros_like(x), P, gshape)
    return {"loss": value, "dx": maxerr(dxg, Xs.grad) if root.active else 0.0}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: f"{c[0]}-{c[3]}")
def test_loss_equals_torch(cluster, case, reduction):
    pshape, gshape = (2, 1, 2), (5, 4, 3)
    for errs in cluster.run(4, _loss_case, *case, reduction, pshape, gshape):
        assert all(v < TOL for v in errs.values()), errs


@pytest.mark.parametrize("case", [LOSS_CASES[0], LOSS_CASES[8], LOSS_CASES[10]],
                         ids=lambda c: f"{c[0]}-{c[3]}")
def test_loss_with_a_distributed_target_equals_torch(cluster, case):
    """A DistTensor target over the input's partition (class indices: without the class
    dim's extent; a fuzz found them refused)."""
    for errs in cluster.run(4, _loss_case, *case, "mean", (2, 1, 2), (5, 4, 3), True):
        assert all(v < TOL for v in errs.values()), errs


def test_kl_batchmean_and_mpi(cluster):
    case = ("kl_div", F.kl_div, {}, "logprob")
    for errs in cluster.run(4, _loss_case, *case, "batchmean", (2, 1, 2), (5, 4, 3),
                            backend="mpi" if HAS_MPI else "gloo"):
        assert all(v < TOL for v in errs.values()), errs


def _class_split_none_is_an_error():
    gnn.DistributedLoss(Partition.grid((1, 2)), "cross_entropy", "none")


def test_classes_split_without_reduction_is_an_error(cluster):
    """The class dim may be split (tests/test_loss_classes.py), but not with 'none'."""
    errs = cluster.run(2, _class_split_none_is_an_error, expect_error=True)
    assert all(e is not None and "class dimension" in e.message for e in errs), errs


def _unbatched_class_loss(name, n):
    """A class-wise loss over a 1-D partition (torch's unbatched (C,) input, class dim
    0): computed, it divided a probability target's mean by C and took a log-softmax per
    block of a split class dim (silently wrong); refused now."""
    gnn.DistributedLoss(Partition.grid((n,)), name)


@pytest.mark.parametrize("name", ["cross_entropy", "nll"])
def test_unbatched_class_loss_is_an_error(cluster, name):
    for n in (1, 2):
        errs = cluster.run(2, _unbatched_class_loss, name, n, expect_error=True)
        assert all(e is not None and "unbatched" in e.message for e in errs), errs


def _none_on_an_inactive_rank():
    """reduction='none' on a rank outside the loss's partition: its (empty) output is in
    the graph like everyone's, so the same backward call works on every rank."""
    w = gpudist.world()
    P = Partition([0, 1], (2, 1))
    X = global_tensor((4, 3), seed=2)
    x = (block_of(X, P) if P.active else torch.zeros(0, 0, dtype=torch.float64))
    x.requires_grad_(True)
    loss = gnn.DistributedLoss(P, "mse", "none")(DistTensor.from_local(x, P, (4, 3)),
                                                 block_of(X, P) * 0)
    loss.local.backward(torch.ones_like(loss.local))
    return w.rank, tuple(loss.local.shape), x.grad is not None and torch.equal(
        x.grad, 2 * x.detach())


def test_loss_none_on_an_inactive_rank(cluster):
    out = cluster.run(3, _none_on_an_inactive_rank)
    assert [o[2] for o in out] == [True, True, True], out
    assert out[2][1] == (0, 0), out


def _bn_dtype_matrix():
    """Which (parameter dtype, input dtype) pairs batch norm takes: torch's answer, and
    whether gpudist's layer gives an output of torch's dtype or a DeviceError."""
    P = Partition.grid((1, 1, gpudist.world().size, 1))
    dts = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    out = []
    for pd in (torch.float32, torch.float64):
        layer = gnn.DistributedBatchNorm(P, 3, dtype=pd)
        for xd in dts:
            G = global_tensor((2, 3, 4, 3), seed=1).to(xd)
            try:
                want = str(torch.nn.BatchNorm2d(3, dtype=pd)(G).dtype)
            except RuntimeError:
                want = "refused"
            try:
                got = str(layer(DistTensor.from_local(block_of(G, P), P, G.shape)).dtype)
            except gpudist.DeviceError:
                got = "refused"
            out.append((str(pd), str(xd), want, got))
    return out


def test_batch_norm_takes_the_dtypes_torch_takes(cluster):
    res = cluster.run(2, _bn_dtype_matrix)
    assert res[0] == res[1]
    for pd, xd, want, got in res[0]:
        assert want == got, (pd, xd, want, got)
    assert sum(w == "refused" for *_, w, _ in res[0]) == 4  # f64 params: 3; f32 params: f64


def _bn_load_not_strict():
    P = Partition.grid((1, 1, gpudist.world().size, 1))
    layer = gnn.DistributedBatchNorm(P, 3)
    sd = dict(torch.nn.BatchNorm2d(3).state_dict(), extra=torch.zeros(1))
    layer.load_global_state_dict(sd, strict=False)  # an unknown key allowed, as torch's
    try:
        layer.load_global_state_dict(sd)
    except gpudist.ShapeError as e:
        return "unknown" in str(e)
    return False


def test_batch_norm_load_takes_strict(cluster):
    assert cluster.run(2, _bn_load_not_strict) == [True, True]
