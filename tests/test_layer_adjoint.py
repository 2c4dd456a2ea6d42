"""Adjoint tests of every layer's Jacobian w.r.t. input, weight and bias.

<J v, y> (central differences of the forward) against <v, J* y> (autograd through the
hand-written adjoints), summed over all workers in float64. For maps that are affine in the
argument (conv/linear in x, w, b; average pooling; batch norm in w, b) the difference with
eps = 1 is exact, so the mismatch is round-off; for nonlinear ones (batch norm in x, max
pooling, losses) a small eps limits it to about eps**2.
"""

import pytest
import torch
from torch.func import functional_call

import gpudist.nn as gnn
from gpudist import Partition
from gpudist.testing import jacobian_adjoint_mismatch as jam
from tests.util import block_of, global_tensor

AFFINE = 1e-12   # round-off
SMOOTH = 1e-7    # central differences, eps 1e-5


def _param_maps(layer, x):
    """w -> layer(x; w) and b -> layer(x; b), the other parameters fixed."""
    out = {}
    for name in ("weight", "bias"):
        p = getattr(layer, name, None)
        if p is not None:
            out[name] = (lambda t, name=name: functional_call(layer, {name: t}, (x,)), p)
    return out


def _check_params(layer, x, tag, res):
    for name, (op, p) in _param_maps(layer, x).items():
        res[f"{tag}.{name}"] = jam(op, p.detach(), eps=1.0, seed=2)


def _conv_cases():
    torch.manual_seed(0)
    res = {}
    # spatial form on a 2x2 grid of 4 workers in a world of 8 (ranks 4..7 inactive)
    P = Partition([0, 1, 2, 3], (1, 1, 2, 2))
    conv = gnn.DistributedConv2d(P, 3, 4, 3, stride=2, padding=1, dilation=1,
                                 dtype=torch.float64)
    x = block_of(global_tensor((2, 3, 11, 9), seed=1), P)
    res["spatial.x"] = jam(conv, x, eps=1.0, seed=1)
    _check_params(conv, x, "spatial", res)
    # general form: channels and space split, x and y on other ranks than the weights
    P_w = Partition(list(range(8)), (1, 2, 2, 2, 1))
    P_x = Partition([7, 6, 5, 4], (1, 2, 2, 1))
    P_y = Partition([0, 1, 2, 3], (1, 2, 2, 1))
    conv = gnn.DistributedConv2d(P_x, 5, 3, 3, 1, 2, 2, P_w=P_w, P_y=P_y, dtype=torch.float64)
    x = block_of(global_tensor((2, 5, 10, 7), seed=3), P_x)
    res["general.x"] = jam(conv, x, eps=1.0, seed=3)
    _check_params(conv, x, "general", res)
    return res


def _linear_cases():
    torch.manual_seed(0)
    P_w = Partition([5, 4, 3, 2, 1, 0], (2, 3))
    P_x = Partition([P_w.world_rank_of((0, j)) for j in range(3)], (1, 3))
    P_y = Partition([P_w.world_rank_of((i, 0)) for i in range(2)], (1, 2))
    lin = gnn.DistributedLinear(P_x, P_y, P_w, 11, 7, dtype=torch.float64)
    x = block_of(global_tensor((4, 11), seed=1), P_x)
    res = {"linear.x": jam(lin, x, eps=1.0, seed=1)}
    _check_params(lin, x, "linear", res)
    return res


def _norm_pool_loss_cases():
    torch.manual_seed(0)
    P = Partition([1, 2, 3, 4], (2, 1, 2, 1))  # rank 0 and 5 inactive
    G = global_tensor((5, 3, 8, 6), seed=1)
    x = block_of(G, P)
    bn = gnn.DistributedBatchNorm(P, 3, dtype=torch.float64)
    res = {"batchnorm.x": jam(bn, x, eps=1e-5, seed=1)}
    _check_params(bn, x, "batchnorm", res)
    Ps = Partition([1, 2, 3, 4], (1, 1, 2, 2))
    xs = block_of(G, Ps)
    res["avgpool.x"] = jam(gnn.DistributedAvgPool2d(Ps, 3, 2, 1), xs, eps=1.0, seed=2)
    res["maxpool.x"] = jam(gnn.DistributedMaxPool2d(Ps, 3, 2, 1), xs, eps=1e-7, seed=3)
    P2 = Partition([1, 2, 3], (3, 1))
    t = block_of(global_tensor((7, 4), seed=4), P2)
    x2 = block_of(global_tensor((7, 4), seed=5), P2)
    mse = gnn.DistributedLoss(P2, "mse")
    res["mse.x"] = jam(lambda z: mse(z, t), x2, eps=1e-5, seed=4)
    return res


def _tol(key: str) -> float:
    return SMOOTH if key in ("batchnorm.x", "maxpool.x", "mse.x") else AFFINE


@pytest.mark.parametrize("world,fn", [(8, _conv_cases), (6, _linear_cases),
                                      (6, _norm_pool_loss_cases)],
                         ids=["conv", "linear", "norm-pool-loss"])
def test_layer_jacobian_adjoints(cluster, world, fn):
    res = cluster.run(world, fn)
    assert all(r == res[0] for r in res)  # collective: every rank computed the same numbers
    assert res[0], "no cases ran"
    for key, m in res[0].items():
        assert m < _tol(key), (key, m)
