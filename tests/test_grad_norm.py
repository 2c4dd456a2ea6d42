"""gpudist.nn.clip_grad_norm_: the sequential model's clipping (torch's
clip_grad_norm_ on the whole model) for a model split over ranks, every norm order, with a
replicated plain parameter; differing replicated gradients or arguments are a
MismatchError on every rank."""

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
                                                (3.0, 1e6)])
def test_clip_grad_norm_equals_the_sequential_models(cluster, backend, norm_type, max_norm):
    res = cluster.run(4, _clip, norm_type, max_norm, backend=backend)
    for r in res:
        assert r["total"] < 1e-12, r
        assert all(v < 1e-12 for k, v in r.items() if k not in ("total", "clipped")), r
    assert res[0]["clipped"] == (max_norm < 100)  # the cases clip, but the last


def _bad(what):
    w = gpudist.world()
    dist, _ = _model(w)
    if what == "replicas":
        dist.scale.grad += w.rank  # replicated gradients not synchronized
    max_norm = 1.0 + (w.rank if what == "args" else 0)
    gnn.clip_grad_norm_(dist, max_norm)


@pytest.mark.parametrize("what,text", [("replicas", "differ between ranks"),
                                       ("args", "different (norm_type, max_norm)")])
def test_clip_grad_norm_refuses_disagreeing_ranks(cluster, what, text):
    errs = cluster.run(4, _bad, what, expect_error=True, timeout=60)
    assert_raised_everywhere(errs, "MismatchError", text)
