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


def _primitive_in_compiled_code():
    """A primitive called directly inside a compiled function, its input's spec changing
    from call to call: its call runs eagerly, without dynamo compiling the call's frame
    against the primitive's state (a guard on its last spec would recompile at every
    change: the recompile limit fails the test)."""
    from gpudist.primitives import AllSumReduce

    torch._dynamo.reset()  # (a pool rank: no code cached by an earlier task's compiles)
    w = gpudist.world()
    P = Partition.grid((w.size,))
    op = AllSumReduce(P, axes=(0,))
    specs = [gpudist.TensorSpec(P, (n,), torch.float64, "cpu", (gpudist.PARTIAL,))
             for n in (5, 7)]

    def f(t, i):
        return op(DistTensor(t, specs[i])).local * 2.0

    compiled = torch.compile(f, backend="eager")
    ok = True
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for k in range(8):
            i = (k // 2) % 2  # each spec twice in a row: calls alike and unlike
            t = torch.full(specs[i].local_shape, float(w.rank + 1), dtype=torch.float64)
            want = 2.0 * sum(range(1, w.size + 1))
            ok = ok and bool((compiled(t, i) == want).all())
    return ok


def test_primitive_called_in_compiled_code(cluster):
    # (gloo only: what is tested is dynamo's view of the call, the same on every backend)
    assert all(cluster.run(2, _primitive_in_compiled_code, timeout=240))
