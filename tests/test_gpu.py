"""CUDA paths: layers and primitives on device-resident tensors.

Skipped (with the reason) where no GPU is present; the same logic runs on CPU in
test_layers.py / test_primitives.py, and the CUDA kernels run in Numba's simulator in
test_kernels.py.
"""

import pytest
import torch

import gpudist.nn as gnn
from gpudist import Partition
from gpudist.primitives import zero_volume
from tests.util import block_of, gather, global_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU present")


def _conv_cuda(pshape, gshape, k, s, p, d):
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    P = Partition.grid(pshape)
    seq = torch.nn.Conv2d(gshape[1], 4, k, s, p, d, dtype=torch.float64, device=dev)
    layer = gnn.DistributedConv2d(P, gshape[1], 4, k, s, p, d, dtype=torch.float64, device=dev)
    layer.load_global_state_dict(seq.state_dict())
    pool = gnn.DistributedMaxPool2d(P, 2)
    G = global_tensor(gshape, seed=1).to(dev)
    x = block_of(G, P).requires_grad_(True)
    y = pool(layer(x))
    Gs = G.clone().requires_grad_(True)
    Y = torch.nn.functional.max_pool2d(seq(Gs), 2)
    dY = global_tensor(Y.shape, seed=2).to(dev)
    y.backward(block_of(dY, P) if P.active else zero_volume(4, like=y))
    Y.backward(dY)
    root = Partition.root(4)
    yg = gather(y.detach(), P, Y.shape, root)[0]
    dx = gather(x.grad, P, G.shape, root)[0]
    out = {"on_device": y.is_cuda and layer.weight.is_cuda and x.grad.is_cuda}
    if root.active:
        out["y"] = float((yg - Y).abs().max())
        out["dx"] = float((dx - Gs.grad).abs().max())
        out["dw"] = float((layer.weight.grad - seq.weight.grad).abs().max())
    return out


@pytest.mark.parametrize("n,pshape", [(1, (1, 1, 1, 1)), (2, (1, 1, 2, 1)), (4, (1, 1, 2, 2))])
def test_conv_pool_on_cuda(cluster, n, pshape):
    # spawned ranks: a forked child cannot use CUDA once the parent has touched it
    for r in cluster.run(n, _conv_cuda, pshape, (2, 3, 12, 10), 3, 1, 1, 1,
                         backend="gloo-spawn"):
        assert r.pop("on_device")
        assert all(v < 1e-10 for v in r.values()), r
