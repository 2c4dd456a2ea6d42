"""gpudist.nn.clip_grad_norm_ and GradScaler: the sequential model's clipping (torch's
clip_grad_norm_ on the whole model) for a model split over ranks, every norm order, with a
replicated plain parameter (differing replicated gradients or arguments are a
MismatchError on every rank); loss scaling that skips a step on every rank alike."""

import math

import pytest
import torch

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from tests.conftest import BACKENDS
from tests.util import assert_raised_everywhere, block_of, global_tensor


def _model(w):
    """A conv over a 2-way spatial split and a 2-D linear layer, plus one plain torch
    parameter (replicated) -- and their sequential twins."""
    n = w.size
    P = Partition.grid((1, 1, n, 1))
    P_w = Partition.grid((n // 2, 2))
    P_in = Partition([P_w.world_rank_of((0, j)) for j in range(2)], (1, 2))
    P_out = Partition([P_w.world_rank_of((i, 0)) for i in range(n // 2)], (1, n // 2))
    torch.manual_seed(0)
    conv, sconv = gnn.DistributedConv2d(P, 2, 3, 3, padding=1, dtype=torch.float64), \
        torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)
    lin, slin = gnn.DistributedLinear(P_in, P_out, P_w, 5, 4, dtype=torch.float64), \
        torch.nn.Linear(5, 4, dtype=torch.float64)
    conv.load_global_state_dict(sconv.state_dict())
    lin.load_global_state_dict(slin.state_dict())
    dist = torch.nn.ModuleDict({"conv": conv, "lin": lin})
    seq = torch.nn.ModuleDict({"conv": sconv, "lin": slin})
    for m in (dist, seq):  # a replicated plain parameter, the same gradient everywhere
        m.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        m.scale.grad = torch.full((3,), 0.7, dtype=torch.float64)
    G = global_tensor((2, 2, 2 * n, 3), seed=1)
    X = global_tensor((6, 5), seed=2)
    conv(DistTensor.from_local(block_of(G, P), P, G.shape)).local.square().sum().backward()
    lin(DistTensor.from_local(block_of(X, P_in), P_in, X.shape)).local.sum().backward()
    sconv(G).square().sum().backward()
    slin(X).sum().backward()
    return dist, seq


def _clip(norm_type, max_norm):
    w = gpudist.world()
    dist, seq = _model(w)
    total = gnn.clip_grad_norm_(dist, max_norm, norm_type)
    ref = torch.nn.utils.clip_grad_norm_(seq.parameters(), max_norm, norm_type)
    out = {"total": abs(float(total) - float(ref)) / float(ref)}
    for name in ("conv", "lin"):
        got = dist[name].global_grads()
        for k, g in got.items():
            want = getattr(seq[name], k).grad
            out[f"{name}.{k}"] = float((g - want).abs().max())
    out["scale"] = float((dist.scale.grad - seq.scale.grad).abs().max())
    out["clipped"] = float(ref) > max_norm
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type,max_norm", [(2.0, 1.0), (1.0, 5.0), (math.inf, 0.5),
                                                (3.0, 1e6), (-math.inf, 1e-9), (-1.0, 1e-9),
                                                (0.25, 1.0)])
def test_clip_grad_norm_equals_the_sequential_models(cluster, backend, norm_type, max_norm):
    res = cluster.run(4, _clip, norm_type, max_norm, backend=backend)
    for r in res:
        assert r["total"] < 1e-12, r
        assert all(v < 1e-12 for k, v in r.items() if k not in ("total", "clipped")), r
    assert res[0]["clipped"] == (max_norm < 100)  # the cases clip, but one


def _bad(what):
    w = gpudist.world()
    dist, _ = _model(w)
    if what == "parameters":  # torch's signature: the parameters, not the model
        gnn.clip_grad_norm_(dist.parameters(), 1.0)
    if what == "order0":  # torch's order 0 counts whole tensors: no split equivalent
        gnn.clip_grad_norm_(dist, 1.0, 0)
    if what in ("replica_inf", "replica_nan") and w.rank == 1:  # non-finite on one rank
        dist.scale.grad[0] = float("inf" if what == "replica_inf" else "nan")
    if what == "nan":  # a NaN in one rank's block: torch's norm is NaN, and so is ours
        if w.rank == 1:  # (the linear layer's weight has a block on every rank)
            dist.lin.weight.grad.view(-1)[0] = float("nan")
        gnn.clip_grad_norm_(dist, 1.0, math.inf, error_if_nonfinite=True)
    if what == "replicas":
        dist.scale.grad += w.rank  # replicated gradients not synchronized
    max_norm = 1.0 + (w.rank if what == "args" else 0)
    gnn.clip_grad_norm_(dist, max_norm, 3.0 if what == "replica_nan" else 2.0)


@pytest.mark.parametrize("what,kind,text", [
    ("replicas", "MismatchError", "differ between ranks"),
    ("args", "MismatchError", "different (norm_type, max_norm)"),
    ("parameters", "TypeError", "takes the model"),
    ("order0", "ValueError", "norm_type 0 is not supported"),
    ("nan", "RuntimeError", "non-finite"),
    ("replica_inf", "MismatchError", "differ between ranks"),
    ("replica_nan", "MismatchError", "differ between ranks")])
def test_clip_grad_norm_refuses_disagreeing_ranks(cluster, what, kind, text):
    errs = cluster.run(4, _bad, what, expect_error=True, timeout=60)
    assert_raised_everywhere(errs, kind, text)


def _scaled_steps(use_gpudist):
    """fp16 autocast with a loss scaler: a DistributedLinear whose weight is split over 2
    ranks by input features; the first step's gradient overflows in rank 1's block only.
    The sequential layer's scaler skips that step and halves its scale; so must every
    rank's (torch's scaler per rank: rank 0 stepped, rank 1 skipped)."""
    P = Partition.grid((1, 2))
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    lin = gnn.DistributedLinear(P, Partition([0], (1, 1)), P, 4, 3)
    lin.load_global_state_dict(ref.state_dict())
    opt, sopt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (lin, ref))
    kind = gnn.GradScaler if use_gpudist else torch.amp.GradScaler
    sc, ssc = kind("cpu", init_scale=2.0 ** 16), torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    out = []
    for X in (torch.tensor([[1.0, 1.0, 3e4, 3e4]]), torch.tensor([[0.5, -1.0, 2.0, 1.0]])):
        with torch.autocast("cpu", dtype=torch.float16):
            y = lin(DistTensor.from_local(block_of(X, P), P, X.shape)).local.float()
            Y = ref(X).float()
        sc.scale(y.sum() * 1e-4).backward()
        ssc.scale(Y.sum() * 1e-4).backward()
        for s, o in ((sc, opt), (ssc, sopt)):
            s.step(o)
            s.update()
            o.zero_grad()
        sd = lin.global_state_dict()
        out.append((sc.get_scale(), ssc.get_scale(),
                    float((sd["weight"] - ref.weight).abs().max()) if sd else None))
    return out


def test_grad_scaler_skips_alike_on_every_rank(cluster):
    for r in cluster.run(2, _scaled_steps, True):
        assert [s for s, _, _ in r] == [t for _, t, _ in r] == [2.0 ** 15] * 2, r
    root = cluster.run(2, _scaled_steps, True)[0]
    assert all(e < 1e-6 for *_, e in root), root
    # torch's scaler per rank: the ranks' scales part (the failure it fixes)
    plain = cluster.run(2, _scaled_steps, False)
    assert plain[0][0][0] != plain[1][0][0], plain


def _scaler_copies():
    """A used GradScaler deep-copies and pickles as torch's (it held gpudist's reduce)."""
    import copy
    import io

    P = Partition.grid((1, 2))
    lin = gnn.DistributedLinear(P, Partition([0], (1, 1)), P, 4, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sc = gnn.GradScaler("cpu")
    X = torch.ones(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        y = lin(DistTensor.from_local(block_of(X, P), P, X.shape)).local.float()
    sc.scale(y.sum()).backward()
    sc.step(opt)
    sc.update()
    twin = copy.deepcopy(sc)
    torch.save(sc, io.BytesIO())
    return twin.get_scale() == sc.get_scale()


def test_grad_scaler_copies_and_pickles(cluster):
    assert cluster.run(2, _scaler_copies) == [True, True]


def _no_gradients():
    """No gradient anywhere (no backward yet): torch's clip returns 0 for every order."""
    w = gpudist.world()
    dist, _ = _model(w)
    for q in dist.parameters():
        q.grad = None
    return [float(gnn.clip_grad_norm_(dist, 1.0, p, error_if_nonfinite=True))
            for p in (2.0, math.inf, -math.inf, -1.0)]


def test_clip_grad_norm_without_gradients(cluster):
    assert cluster.run(4, _no_gradients) == [[0.0] * 4] * 4
