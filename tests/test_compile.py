"""``torch.compile`` of a model holding gpudist layers: the layers run eagerly (dynamo
cannot trace their checks and transports; before, it traced into the MPI transport and
failed), the torch code around them is compiled, and training steps equal the
sequential model's, on gloo and MPI."""

import pytest
import torch

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from tests.conftest import BACKENDS
from tests.util import block_of, gather


class _Net(torch.nn.Module):
    def __init__(self, conv, pool):
        super().__init__()
        self.conv, self.pool = conv, pool

    def forward(self, x):
        return self.pool(torch.nn.functional.relu(self.conv(x)) * 2.0)


def _compiled_steps():
    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    torch.manual_seed(0)
    seq = _Net(torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64),
               torch.nn.MaxPool2d(2))
    net = _Net(gnn.DistributedConv2d(P, 2, 3, 3, padding=1, dtype=torch.float64),
               gnn.DistributedMaxPool2d(P, 2))
    net.conv.load_global_state_dict(seq.conv.state_dict())
    compiled = torch.compile(net, backend="eager")  # dynamo's tracing, no code generation
    errs = []
    for step in range(2):
        G = torch.randn(2, 2, 4 * w.size, 6, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(step))
        x = DistTensor.from_local(block_of(G, P), P, G.shape)
        y = compiled(x)
        y.local.square().sum().backward()
        Gs = G.clone().requires_grad_(True)
        Y = seq(Gs)
        Y.square().sum().backward()
        yg, root = gather(y.local, P, Y.shape)
        grads = net.conv.global_grads()
        if root.active:
            errs.append(max(float((yg - Y).abs().max()),
                            float((grads["weight"] - seq.conv.weight.grad).abs().max())))
    return errs


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_with_gpudist_layers(cluster, backend):
    res = cluster.run(2, _compiled_steps, backend=backend, timeout=240)
    assert len(res[0]) == 2 and max(res[0]) < 1e-12, res
