"""Channel-partitioned convolutions (AllGather / ReduceScatter forms, plain and transposed,
weights ZeRO-sharded over the data axis) against torch in float64: forward, input and
parameter gradients gathered to one rank, seeded initialization, global state dict round
trips, Jacobian adjoints and errors on every rank."""

import pytest
import torch

from gpudist import DistTensor, Partition
from gpudist.nn import conv_channel as cc
from gpudist.testing import jacobian_adjoint_mismatch as jam
from tests.util import (
    assert_raised_everywhere,
    block_of,
    gather,
    global_checkpoint_roundtrip,
    global_tensor,
    maxerr,
)

TOL = 1e-10
FORMS = {"ag": "DistributedChannelAllGatherConv", "rs": "DistributedChannelReduceScatterConv",
         "agt": "DistributedChannelAllGatherConvTranspose",
         "rst": "DistributedChannelReduceScatterConvTranspose"}


def _classes(kind, n):
    t = kind.endswith("t")
    seq = getattr(torch.nn, f"Conv{'Transpose' if t else ''}{n}d")
    return getattr(cc, f"{FORMS[kind]}{n}d"), seq


def _backward(y, dy):
    if y.requires_grad:  # ranks outside the layer hold a detached zero-volume output
        y.backward(dy)


# ------------------------------------------------------------------ vs torch
def _case(kind, n, pshape, ranks, N, cin, cout, spatial, opts, steps=2):
    P = Partition(ranks, pshape)
    cls, tcls = _classes(kind, n)
    torch.manual_seed(3)
    seq = tcls(cin, cout, dtype=torch.float64, **opts)
    torch.manual_seed(3)
    layer = cls(P, cin, cout, dtype=torch.float64, **opts)
    errs = {"_numel": sum(p.numel() for p in layer.parameters())}  # this rank's chunks
    sd = layer.global_state_dict()
    if sd:  # seeded initialization: the torch layer's parameters
        errs["init"] = float(set(sd) != set(seq.state_dict())) + sum(
            maxerr(v, seq.state_dict()[k]) for k, v in sd.items())
    with torch.no_grad():  # other values, loaded from the torch layer
        for p in seq.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(9),
                              dtype=p.dtype))
    layer.load_global_state_dict(seq.state_dict())
    gshape = (N, cin) + tuple(spatial)
    for step in range(steps):  # the gradients accumulate over the steps, as in torch
        G = global_tensor(gshape, seed=step)
        x = block_of(G, P).requires_grad_(True)
        Gs = G.clone().requires_grad_(True)
        if step == 0:
            y = layer(DistTensor.from_local(x, P, gshape))
        else:  # a plain block in gives a plain block out
            y = layer(x)
            errs["plain"] = float(isinstance(y, DistTensor))
            y = DistTensor.from_local(y, P, tuple(seq(G).shape))
        Y = seq(Gs)
        dY = global_tensor(Y.shape, seed=10 + step)
        _backward(y.local, block_of(dY, P))
        Y.backward(dY)
        yg, root = gather(y.local, P, Y.shape)
        dxg, _ = gather(x.grad, P, gshape)
        grads = layer.global_grads()
        if root.active:
            errs[f"shape{step}"] = float(tuple(y.shape) != tuple(Y.shape))
            errs[f"y{step}"] = maxerr(yg, Y.detach())
            errs[f"dx{step}"] = maxerr(dxg, Gs.grad)
            for name, p in seq.named_parameters():
                errs[f"d{name}{step}"] = maxerr(grads[name], p.grad)
    return errs


CASES = [
    # world, form, spatial dims, P_x, ranks, N, C_in, C_out, spatial extents, options
    (4, "ag", 2, (2, 2, 1, 1), [0, 1, 2, 3], 3, 5, 7, (6, 5),
     {"kernel_size": 3, "stride": 2, "padding": 1}),
    (4, "rs", 2, (1, 3, 1, 1), [1, 2, 3], 2, 7, 5, (7, 6),            # rank 0 inactive
     {"kernel_size": (2, 3), "dilation": 2, "bias": False}),
    (6, "ag", 1, (3, 2, 1), [5, 4, 3, 2, 1, 0], 4, 4, 5, (9,),        # data axis 3
     {"kernel_size": 4, "padding": "same", "padding_mode": "reflect"}),
    (6, "rs", 3, (2, 2, 1, 1, 1), [4, 3, 2, 1], 3, 3, 5, (4, 5, 3),   # ranks 0, 5 out
     {"kernel_size": 2, "stride": (1, 2, 1), "padding": 1}),
    (6, "rs", 1, (2, 3, 1), [0, 1, 2, 3, 4, 5], 2, 8, 4, (10,),
     {"kernel_size": 3, "padding": 2, "padding_mode": "circular"}),
    (4, "ag", 3, (1, 2, 1, 1, 1), [3, 1], 2, 3, 3, (3, 4, 5), {"kernel_size": (1, 2, 3)}),
    (4, "agt", 2, (2, 2, 1, 1), [0, 1, 2, 3], 3, 5, 3, (4, 5),
     {"kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1}),
    (4, "rst", 1, (1, 2, 1), [2, 3], 2, 5, 4, (6,),                  # ranks 0, 1 out
     {"kernel_size": 4, "stride": 3, "dilation": 2, "output_padding": 2}),
    (6, "rst", 2, (3, 2, 1, 1), [0, 1, 2, 3, 4, 5], 4, 3, 5, (3, 4),
     {"kernel_size": 2, "bias": False}),
    (4, "agt", 3, (2, 2, 1, 1, 1), [3, 2, 1, 0], 2, 2, 5, (2, 3, 2),
     {"kernel_size": 2, "stride": (2, 1, 1)}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}{c[2]}d-{'x'.join(map(str, c[3]))}")
def test_channel_conv_equals_torch(cluster, case):
    n, *args = case
    res = cluster.run(n, _case, *args)
    # ZeRO storage: every parameter entry is kept by exactly one worker
    seq = _classes(args[0], args[1])[1](*args[5:7], **args[-1])
    assert sum(r.pop("_numel") for r in res) == sum(p.numel() for p in seq.parameters())
    keys = set().union(*res)
    want = {"init", "y0", "dx0", "dweight0", "y1", "dx1", "dweight1", "plain"}
    assert want <= keys, keys
    assert ("dbias1" in keys) == args[-1].get("bias", True), keys
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_channel_conv_mpi(cluster, backend):
    res = cluster.run(4, _case, "rs", 2, (2, 2, 1, 1), [0, 1, 2, 3], 3, 6, 5, (5, 4),
                      {"kernel_size": 3, "padding": 1}, backend=backend)
    assert sum(r.pop("_numel") for r in res) == 5 * 6 * 9 + 5
    assert {"y1", "dx1", "dweight1", "dbias1"} <= set().union(*res)
    assert all(v < TOL for r in res for v in r.values()), res


# ------------------------------------------------------------------ Jacobian adjoints
def _adjoints():
    from torch.func import functional_call

    res = {}
    P = Partition([1, 2, 3, 4], (2, 2, 1, 1))  # ranks 0 and 5 inactive
    G = global_tensor((3, 5, 6, 5), seed=1)
    x = DistTensor.from_local(block_of(G, P), P, G.shape)
    for kind in FORMS:
        cls, _ = _classes(kind, 2)
        torch.manual_seed(0)
        layer = cls(P, 5, 4, 3, stride=2, padding=1, dtype=torch.float64)
        res[f"{kind}.x"] = jam(layer, x, eps=1.0, seed=1)
        for name, p in layer.named_parameters():  # linear in each parameter: eps = 1
            res[f"{kind}.{name}"] = jam(lambda t, n=name, m=layer: functional_call(
                m, {n: t}, (x,)).local, p.detach(), eps=1.0, seed=2)
    return res


def test_jacobian_adjoints(cluster):
    res = cluster.run(6, _adjoints)
    assert all(r == res[0] for r in res)
    assert len(res[0]) == 12, sorted(res[0])
    for key, m in res[0].items():
        assert m < 1e-7, (key, m)


# ------------------------------------------------------------------ checkpoints
def _roundtrip(path):
    """Distributed layers -> global state dicts -> torch.save -> fresh layers (another seed)
    load them -> same global state; the dicts load strictly into the torch layers."""
    from gpudist.runtime import require_world

    world = require_world(None)
    P = Partition.grid((2, 2, 1, 1))

    def build(seed):
        out = {}
        for kind in FORMS:
            torch.manual_seed(seed)
            out[kind] = _classes(kind, 2)[0](P, 5, 3, (2, 3), dtype=torch.float64)
        return out

    a, b, loaded, sd2, same = global_checkpoint_roundtrip(build, path)
    out = {"same_local": same}
    # per-rank state dicts carry the layout: they load back into the same rank's layer
    b["ag"].load_state_dict(a["ag"].state_dict())
    if world.rank == 0:
        for k in FORMS:
            m = _classes(k, 2)[1](5, 3, (2, 3), dtype=torch.float64)
            init = m.weight.detach().clone()
            m.load_state_dict(loaded[k])  # strict: every key, every shape
            out[k] = all(torch.equal(v, sd2[k][n]) for n, v in m.state_dict().items())
            out[k + ".changed"] = not torch.equal(m.weight, init)
    return out


def test_global_state_dict_roundtrip(cluster, tmp_path):
    res = cluster.run(4, _roundtrip, str(tmp_path / "ckpt.pt"))
    assert all(r["same_local"] for r in res)
    root = res[0]
    for k in FORMS:
        assert root[k] and root[k + ".changed"], (k, root)


# ------------------------------------------------------------------ errors
def _bad(which):
    if which == "spatial_split":
        cc.DistributedChannelAllGatherConv2d(Partition.grid((1, 2, 2, 1)), 4, 4, 3)
    elif which == "dims":
        cc.DistributedChannelReduceScatterConv1d(Partition.grid((2, 2)), 4, 4, 3)
    elif which == "few_channels":
        cc.DistributedChannelReduceScatterConv2d(Partition.grid((1, 4, 1, 1)), 3, 8, 3)
    elif which == "groups":
        cc.DistributedChannelAllGatherConv2d(Partition.grid((2, 2, 1, 1)), 4, 4, 3, groups=2)
    elif which == "output_padding":
        cc.DistributedChannelAllGatherConvTranspose1d(Partition.grid((2, 2, 1)), 4, 4, 3,
                                                      output_padding=1)
    elif which == "channels_input":
        P = Partition.grid((2, 2, 1, 1))
        layer = cc.DistributedChannelReduceScatterConv2d(P, 4, 4, 3, dtype=torch.float64)
        layer(DistTensor.from_local(block_of(global_tensor((2, 5, 6, 6)), P), P, (2, 5, 6, 6)))
    elif which == "dtype":
        P = Partition.grid((2, 2, 1))
        layer = cc.DistributedChannelAllGatherConvTranspose1d(P, 4, 4, 3)
        layer(DistTensor.from_local(block_of(global_tensor((2, 4, 5)), P), P, (2, 4, 5)))
    elif which == "small_input":
        P = Partition.grid((2, 2, 1))
        layer = cc.DistributedChannelAllGatherConv1d(P, 4, 4, 5, dtype=torch.float64)
        layer(DistTensor.from_local(block_of(global_tensor((2, 4, 3)), P), P, (2, 4, 3)))


@pytest.mark.parametrize("which,err,text", [
    ("spatial_split", "PartitionError", "splits spatial dimensions"),
    ("dims", "PartitionError", "must have 3 dimensions"),
    ("few_channels", "PartitionError", "in_channels=3 cannot be split"),
    ("groups", "ValueError", "groups=2 is not supported"),
    ("output_padding", "ValueError", "output_padding (1,)"),
    ("channels_input", "ShapeError", "has 5 channels"),
    ("dtype", "DeviceError", "the layer's parameters float32"),
    ("small_input", "ShapeError", "kernel is larger"),
])
def test_errors_on_every_rank(cluster, which, err, text):
    errs = cluster.run(4, _bad, which, expect_error=True)
    assert_raised_everywhere(errs, err, text)
