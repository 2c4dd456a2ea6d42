"""The GPU suite (``make test-gpu``, marker ``gpu``): every layer on CUDA tensors equal to
the torch layer on the GPU, at world size 1 over NCCL and with 2 and 4 ranks sharing one GPU
over gloo and MPI (host staging: NCCL refuses two ranks on one GPU, PyPI MPICH is not
CUDA-aware); LeNet-5 on CUDA equal to the sequential network step by step; a world-size-1
conv+pool+linear step captured in a CUDA graph and replayed.

Without a GPU every test skips with the reason. The same code paths run on CPU elsewhere:
test_layers.py / test_norm_loss.py (layers), test_data_path.py (forced host staging: every
tensor through the transport's staging buffers; this module's every-layer comparison runs
there staged on CPU, and test_lenet5.py's LeNet-5 too), test_kernels.py (CUDA kernels in
Numba's simulator). ``tests/test_multigpu.py`` holds what needs several GPUs.
"""

import pytest
import torch
import torch.nn.functional as F

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from gpudist.launch import Cluster
from tests.conftest import HAS_MPI
from tests.harness import COMM_TIMEOUT_S
from tests.util import block_of, gather, global_tensor, maxerr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU present (the CPU suite covers the same logic; see the docstring)")]

TOL = 1e-10
WORLDS = [("nccl-spawn", 1), ("gloo-spawn", 2), ("gloo-spawn", 4),
          pytest.param("mpi", 2, marks=pytest.mark.skipif(not HAS_MPI, reason="no MPI")),
          pytest.param("mpi", 4, marks=pytest.mark.skipif(not HAS_MPI, reason="no MPI"))]


@pytest.fixture(scope="module")
def gpu_cluster():
    c = Cluster(timeout=COMM_TIMEOUT_S, device="cuda")
    yield c
    c.close()


def _compare(layer, seq, P, gshape, dev, kind="spatial", target=None):
    G = global_tensor(gshape, seed=1).to(dev)
    x = block_of(G, P).requires_grad_(True)
    y = layer(DistTensor.from_local(x, P, gshape))
    Gs = G.clone().requires_grad_(True)
    Y = seq(Gs)
    dY = global_tensor(Y.shape, seed=2).to(dev)
    y.local.backward(block_of(dY, y.partition))
    Y.backward(dY)
    yg, root = gather(y.local, y.partition, Y.shape)
    dxg, _ = gather(x.grad, P, G.shape)
    on_device = y.local.is_cuda and x.grad.is_cuda
    if not root.active:
        return {"on_device_or_empty": float(not on_device and y.local.numel() > 0)}
    return {"y": maxerr(yg, Y.detach()), "dx": maxerr(dxg, Gs.grad),
            "on_device_or_empty": float(not on_device and y.local.numel() > 0)}


def _every_layer():
    """Each layer on cuda:0, float64, against the torch layer on the GPU."""
    w = gpudist.world()
    n, dev = w.size, w.device  # cuda:0 for ranks sharing one GPU, cuda:rank otherwise
    f64 = torch.float64
    P = Partition.grid((1, 1, n, 1))
    out = {}
    torch.manual_seed(0)
    cases = {
        "conv": (gnn.DistributedConv2d(P, 3, 4, 3, 1, 1, dtype=f64, device=dev),
                 torch.nn.Conv2d(3, 4, 3, 1, 1, dtype=f64, device=dev)),
        "conv_t": (gnn.DistributedConvTranspose2d(P, 3, 2, 3, 2, 1, dtype=f64, device=dev),
                   torch.nn.ConvTranspose2d(3, 2, 3, 2, 1, dtype=f64, device=dev)),
        "maxpool": (gnn.DistributedMaxPool2d(P, 3, 2, 1), torch.nn.MaxPool2d(3, 2, 1)),
        "avgpool": (gnn.DistributedAvgPool2d(P, 2, 2, ceil_mode=True),
                    torch.nn.AvgPool2d(2, 2, ceil_mode=True)),
        "upsample": (gnn.DistributedUpsample(P, scale_factor=2, mode="bilinear"),
                     torch.nn.Upsample(scale_factor=2, mode="bilinear")),
        "batchnorm": (gnn.DistributedBatchNorm(P, 3, dtype=f64, device=dev),
                      torch.nn.BatchNorm2d(3, dtype=f64, device=dev)),
    }
    for name, (layer, seq) in cases.items():
        if hasattr(layer, "load_global_state_dict"):
            layer.load_global_state_dict(seq.state_dict())
        out[name] = _compare(layer, seq, P, (2, 3, 4 * n + 1, 7), dev)
    # the general (channel-split) conv and the 2-D linear layer, where n allows
    if n in (2, 4):
        pco = 2 if n == 4 else 1
        P_w = Partition.grid((1, pco, 2, 1, 1))
        P_x = Partition([P_w.world_rank_of((0, 0, j, 0, 0)) for j in range(2)], (1, 2, 1, 1))
        conv = gnn.DistributedConv2d(P_x, 4, 6, 3, padding=1, P_w=P_w, dtype=f64, device=dev)
        seq = torch.nn.Conv2d(4, 6, 3, padding=1, dtype=f64, device=dev)
        conv.load_global_state_dict(seq.state_dict())
        out["conv_general"] = _compare(conv, seq, P_x, (2, 4, 6, 5), dev)
        P_w2 = Partition.grid((n // 2, 2))
        P_in = Partition([P_w2.world_rank_of((0, j)) for j in range(2)], (1, 2))
        P_out = Partition([P_w2.world_rank_of((i, 0)) for i in range(n // 2)], (1, n // 2))
        lin = gnn.DistributedLinear(P_in, P_out, P_w2, 9, 5, dtype=f64, device=dev)
        seq = torch.nn.Linear(9, 5, dtype=f64, device=dev)
        lin.load_global_state_dict(seq.state_dict())
        out["linear"] = _compare(lin, seq, P_in, (6, 9), dev)
    return out


@pytest.mark.parametrize("backend,n", WORLDS)
def test_every_layer_on_cuda(gpu_cluster, backend, n):
    for per_rank in gpu_cluster.run(n, _every_layer, backend=backend):
        for name, errs in per_rank.items():
            assert all(v < TOL for v in errs.values()), (name, errs)


def _lenet_cuda(steps=3):
    from gpudist.examples import lenet5

    w = gpudist.world()
    dev = w.device
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(steps, 32, 1, 28, 28, generator=g, dtype=torch.float64).to(dev)
    t = torch.randint(0, 10, (steps, 32), generator=g).to(dev)
    seq_losses = []
    if w.rank == 0:
        seq = lenet5.make_sequential(7, torch.float64, dev)
        opt = torch.optim.Adam(seq.parameters(), lr=1e-3)
        seq_losses = [lenet5.sequential_step(seq, opt, x[k], t[k]) for k in range(steps)]
    net = lenet5.make_distributed(lenet5.make_sequential(7, torch.float64, dev),
                                  torch.float64, dev)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    blank = torch.zeros(0, 0, 0, 0, dtype=torch.float64, device=dev)
    dist_losses = [lenet5.distributed_step(net, opt, x[k] if w.rank == 0 else blank,
                                           t[k] if w.rank == 0 else None, 32)
                   for k in range(steps)]
    return [abs(a - b) for a, b in zip(seq_losses, dist_losses)] if w.rank == 0 else None


@pytest.mark.parametrize("backend,n", [("nccl-spawn", 1), ("gloo-spawn", 2), ("gloo-spawn", 4)])
def test_lenet5_on_cuda_equals_sequential(gpu_cluster, backend, n):
    diffs = gpu_cluster.run(n, _lenet_cuda, backend=backend)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-10, diffs


def _cuda_graph(steps=4):
    """A world-size-1 step of conv -> max pool -> linear captured once, replayed with new
    data; equal to the same steps run eagerly on an identical copy."""
    dev = torch.device("cuda", 0)
    P, P2 = Partition.grid((1, 1, 1, 1)), Partition.grid((1, 1))

    def build():
        torch.manual_seed(0)
        return (gnn.DistributedConv2d(P, 2, 4, 3, padding=1, device=dev),
                gnn.DistributedMaxPool2d(P, 2),
                gnn.DistributedLinear(P2, P2, P2, 4 * 4 * 4, 3, device=dev))

    def step(layers, x, t):
        conv, pool, lin = layers
        y = pool(F.relu(conv(DistTensor.from_local(x, P, (2, 2, 8, 8)))))
        return F.mse_loss(lin(y.flatten(1)).local, t)

    data = [(torch.randn(2, 2, 8, 8, device=dev), torch.randn(2, 3, device=dev))
            for _ in range(steps)]
    eager = build()
    opt_e = torch.optim.SGD([p for m in eager for p in m.parameters()], lr=0.1)
    ref = []
    for x, t in data:
        opt_e.zero_grad(set_to_none=True)
        loss = step(eager, x, t)
        loss.backward()
        opt_e.step()
        ref.append(float(loss))
    graphed = build()
    opt = torch.optim.SGD([p for m in graphed for p in m.parameters()], lr=0.1)
    sx, st = data[0][0].clone(), data[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (plans, buffers, .grad) outside the capture
        for _ in range(2):
            step(graphed, sx, st).backward()
        for m in graphed:
            m.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step(graphed, sx, st)
        static_loss.backward()
        opt.step()
    got = []
    for x, t in data:
        sx.copy_(x)
        st.copy_(t)
        for m in graphed:
            for p in m.parameters():
                p.grad.zero_()
        g.replay()
        got.append(float(static_loss))
    return max(abs(a - b) for a, b in zip(got, ref))


def test_world_size_one_step_in_a_cuda_graph(gpu_cluster):
    (err,) = gpu_cluster.run(1, _cuda_graph, backend="nccl-spawn")
    assert err < 1e-5, err
