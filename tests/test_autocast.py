"""``torch.autocast`` around gpudist layers: each layer gives torch's layer's dtypes under
autocast (output, input gradient, parameter gradients) and its values to autocast's
rounding, on gloo and MPI, over uneven blocks; autocast on some ranks only is a
MismatchError on every rank. (Before: a linear layer killed its receiving process, a
conv's output failed at the next operator.)"""

import pytest
import torch

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition
from tests.conftest import BACKENDS
from tests.util import assert_raised_everywhere, block_of, gather, global_tensor

BF16 = torch.bfloat16
TOL = 3e-2  # relative to the largest value: a few units of bfloat16's last place


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _compare(layer, seq, P, gshape, target=None, dtype=torch.float32):
    """Forward and backward of ``layer`` and ``seq`` under autocast (cpu, bfloat16) on the
    same input (float32, or ``dtype``: what a layer after a conv gets); on the root:
    dtypes (output, input grad, parameter grads) and relative errors."""
    out_P = getattr(layer, "P_y", P)
    G = global_tensor(gshape, seed=1, dtype=dtype)
    x = block_of(G, P).requires_grad_(True)
    Gs = G.clone().requires_grad_(True)
    xd = DistTensor.from_local(x, P, gshape)
    with torch.autocast("cpu", dtype=BF16):
        if target is None:
            y, Y = layer(xd), seq(Gs)
        else:
            T, PT = target(G)
            y, Y = layer(xd, DistTensor.from_local(block_of(T, PT), PT, T.shape)), seq(Gs, T)
    dY = global_tensor(Y.shape, seed=2, dtype=torch.float32).to(Y.dtype)
    yl = y.local if isinstance(y, DistTensor) else y  # a reduced loss: a plain scalar
    yl.backward(dY if Y.dim() == 0 else block_of(dY, out_P))
    Y.backward(dY)
    out = {"y_dtype": str(y.dtype), "local_dtype": str(yl.dtype)}
    if Y.dim() == 0:
        yg, root_active = yl, P.ranks[0] == gpudist.world().rank
    else:
        yg, root = gather(yl, out_P, Y.shape)
        root_active = root.active
    dxg, _ = gather(x.grad, P, G.shape)
    if root_active:
        out.update(Y_dtype=str(Y.dtype), dx_dtype=str(x.grad.dtype), y=_rel(yg, Y.detach()),
                   dx=_rel(dxg, Gs.grad))
    if hasattr(layer, "global_grads"):
        got = layer.global_grads()
        for k, g in got.items():
            ref = dict(seq.named_parameters())[k].grad
            out["d" + k] = _rel(g, ref)
            out["d" + k + "_dtype"] = (str(g.dtype), str(ref.dtype))
    return out


def _layers():
    w = gpudist.world()
    n = w.size
    P = Partition.grid((1, 1, 2, n // 2))
    torch.manual_seed(0)
    res = {}

    def load(layer, seq):
        layer.load_global_state_dict(seq.state_dict())
        return layer, seq

    cases = {
        "conv": (*load(gnn.DistributedConv2d(P, 3, 4, 3, 1, 1),
                       torch.nn.Conv2d(3, 4, 3, 1, 1)), (2, 3, 9, 7)),
        "conv_strided": (*load(gnn.DistributedConv2d(P, 3, 2, 3, 2, 2, 2),
                               torch.nn.Conv2d(3, 2, 3, 2, 2, 2)), (2, 3, 11, 10)),
        "conv_t": (*load(gnn.DistributedConvTranspose2d(P, 3, 2, 3, 2, 1),
                         torch.nn.ConvTranspose2d(3, 2, 3, 2, 1)), (2, 3, 5, 7)),
        "maxpool": (gnn.DistributedMaxPool2d(P, 3, 2, 1), torch.nn.MaxPool2d(3, 2, 1),
                    (2, 3, 9, 7)),
        "upsample": (gnn.DistributedUpsample(P, scale_factor=2, mode="bilinear"),
                     torch.nn.Upsample(scale_factor=2, mode="bilinear"), (2, 3, 5, 7)),
        "batchnorm": (*load(gnn.DistributedBatchNorm(P, 3), torch.nn.BatchNorm2d(3)),
                      (2, 3, 9, 7)),
    }
    for name, (layer, seq, g) in cases.items():
        res[name] = _compare(layer, seq, P, g)
    # what follows a conv under autocast: bfloat16 input
    for name, layer, seq in (
            ("maxpool_bf16", gnn.DistributedMaxPool2d(P, 2), torch.nn.MaxPool2d(2)),
            ("upsample_bf16", gnn.DistributedUpsample(P, scale_factor=2, mode="nearest"),
             torch.nn.Upsample(scale_factor=2, mode="nearest")),
            ("batchnorm_bf16", *load(gnn.DistributedBatchNorm(P, 3),
                                     torch.nn.BatchNorm2d(3)))):
        res[name] = _compare(layer, seq, P, (2, 3, 9, 7), dtype=BF16)
    # 3-D pooling and area sampling: torch's CPU autocast runs them in float32
    P3 = Partition.grid((1, 1, 2, n // 2, 1))
    for name, layer, seq in (
            ("maxpool3d_bf16", gnn.DistributedMaxPool3d(P3, 2), torch.nn.MaxPool3d(2)),
            ("avgpool3d_bf16", gnn.DistributedAvgPool3d(P3, 2), torch.nn.AvgPool3d(2)),
            ("area3d_bf16", gnn.DistributedUpsample(P3, scale_factor=0.5, mode="area"),
             torch.nn.Upsample(scale_factor=0.5, mode="area"))):
        res[name] = _compare(layer, seq, P3, (2, 2, 6, 6, 3), dtype=BF16)
    # RMS norm with eps=None on bfloat16: torch takes float32's eps (its compute dtype)
    Pr = Partition.grid((2, 1, n // 2))
    res["rms_bf16"] = _compare(*load(gnn.DistributedRMSNormZero(Pr, (3, 5)),
                                     torch.nn.RMSNorm((3, 5))), Pr, (4, 3, 5), dtype=BF16)
    # the 2-D linear layer (weight 2 x n/2), bias on one column only
    P_w = Partition.grid((2, n // 2))
    P_in = Partition([P_w.world_rank_of((0, j)) for j in range(n // 2)], (1, n // 2))
    P_out = Partition([P_w.world_rank_of((i, 0)) for i in range(2)], (1, 2))
    res["linear"] = _compare(*load(gnn.DistributedLinear(P_in, P_out, P_w, 9, 5),
                                   torch.nn.Linear(9, 5)), P_in, (6, 9))
    # the channel-split conv (input channels over 2 workers)
    P_w = Partition.grid((1, n // 2, 2, 1, 1))
    P_x = Partition([P_w.world_rank_of((0, 0, j, 0, 0)) for j in range(2)], (1, 2, 1, 1))
    res["conv_general"] = _compare(*load(gnn.DistributedConv2d(P_x, 4, 6, 3, padding=1,
                                                               P_w=P_w),
                                         torch.nn.Conv2d(4, 6, 3, padding=1)),
                                   P_x, (2, 4, 6, 5))
    # channel-split convs and sharded linear layers (gpudist.nn's other lower-precision ops)
    Pc = Partition.grid((1, n, 1, 1))
    for name, cls in (("channel_allgather", gnn.DistributedChannelAllGatherConv2d),
                      ("channel_reducescatter", gnn.DistributedChannelReduceScatterConv2d)):
        res[name] = _compare(*load(cls(Pc, 4, 6, 3, padding=1),
                                   torch.nn.Conv2d(4, 6, 3, padding=1)), Pc, (2, 4, 6, 5))
    for name, cls, Ps in (
            ("linear_allgather", gnn.DistributedLinearAllGather, Partition.grid((n, 1))),
            ("linear_reducescatter", gnn.DistributedLinearReduceScatter,
             Partition.grid((1, n)))):
        res[name] = _compare(*load(cls(Ps, 6, 8), torch.nn.Linear(6, 8)), Ps, (5, 6))
    # losses: torch's autocast runs them in float32
    Pl = Partition.grid((2, 1, n // 2))
    Pt = Partition(Pl.ranks, (2, n // 2))  # class indices: the class dim left out
    res["mse"] = _compare(gnn.DistributedLoss(Pl, "mse"), torch.nn.MSELoss(), Pl,
                          (5, 3, 7), target=lambda G: ((G * 0.5).to(BF16), Pl))
    res["mse_bf16"] = _compare(gnn.DistributedLoss(Pl, "mse"), torch.nn.MSELoss(), Pl,
                               (5, 3, 7), target=lambda G: (G * 0.5, Pl), dtype=BF16)
    res["cross_entropy"] = _compare(
        gnn.DistributedLoss(Pl, "cross_entropy", "sum"),
        torch.nn.CrossEntropyLoss(reduction="sum"), Pl, (5, 3, 7),
        target=lambda G: ((G[:, 0].abs() * 7).long().remainder(3), Pt))
    return res


@pytest.mark.parametrize("backend", BACKENDS)
def test_layers_under_autocast_match_torch(cluster, backend):
    per_rank = cluster.run(4, _layers, backend=backend)
    for r, res in enumerate(per_rank):
        for name, m in res.items():
            if "Y_dtype" in m:  # the root: torch's dtypes and values
                assert m["y_dtype"] == m["Y_dtype"] == m["local_dtype"], (name, m)
                want = "torch.bfloat16" if name.endswith("_bf16") else "torch.float32"
                assert m["dx_dtype"] == want, (name, m)  # the input's, as torch
                assert m["y"] < TOL and m["dx"] < TOL, (name, m)
            for k, v in m.items():
                if k.startswith("d") and k.endswith("_dtype") and k != "dx_dtype":
                    assert v[0] == v[1], (name, k, v)
                elif k.startswith("d") and k not in ("dx",) and isinstance(v, float):
                    assert v < TOL, (name, k, v)
            # every rank's output carries the same dtype as the root's
            assert m["y_dtype"] == per_rank[0][name]["y_dtype"], (r, name, m)
    assert per_rank[0]["conv"]["Y_dtype"] == "torch.bfloat16"
    assert per_rank[0]["linear"]["Y_dtype"] == "torch.bfloat16"
    assert per_rank[0]["mse"]["Y_dtype"] == per_rank[0]["mse_bf16"]["Y_dtype"] == \
        "torch.float32"
    assert per_rank[0]["batchnorm_bf16"]["Y_dtype"] == "torch.bfloat16"
    assert per_rank[0]["maxpool3d_bf16"]["Y_dtype"] == "torch.float32"


def _autocast_on_rank0():
    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    layer = gnn.DistributedConv2d(P, 2, 2, 3, padding=1)
    x = DistTensor.from_local(block_of(global_tensor((1, 2, 8, 4), dtype=torch.float32), P),
                              P, (1, 2, 8, 4))
    with torch.autocast("cpu", dtype=BF16, enabled=w.rank == 0):
        layer(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_on_some_ranks_is_a_mismatch(cluster, backend):
    errs = cluster.run(3, _autocast_on_rank0, backend=backend, expect_error=True,
                       timeout=120)
    assert_raised_everywhere(errs, "MismatchError", "bfloat16")


def _float64_under_autocast(kind):
    """float64 input to a float32 layer under autocast: autocast does not cast float64,
    torch refuses the mix; so does gpudist, on every rank (it let it through: a raw torch
    error on some ranks for the linear layer, a silent float64 result for the conv)."""
    w = gpudist.world()
    P = Partition.grid((1, 1, w.size, 1))
    layer = gnn.DistributedConv2d(P, 2, 2, 3, padding=1) if kind == "conv" else \
        gnn.DistributedLinear(Partition.grid((1, w.size)), Partition.grid((1, 1)),
                              Partition.grid((1, w.size)), 2 * w.size, 3)
    g = (1, 2, 4 * w.size, 3) if kind == "conv" else (2, 2 * w.size)
    Pin = P if kind == "conv" else Partition.grid((1, w.size))
    x = DistTensor.from_local(block_of(global_tensor(g), Pin), Pin, g)  # float64
    with torch.autocast("cpu", dtype=BF16):
        layer(x)


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_float64_input_under_autocast_is_refused_everywhere(cluster, kind):
    errs = cluster.run(3, _float64_under_autocast, kind, expect_error=True, timeout=60)
    assert_raised_everywhere(errs, "DeviceError", "the input is float64")
