"""Review probes: edge cases of the halo exchange with the global padding written into the
working buffer, and of the layers built on it (sequential equivalence, forward only where
a failing rank would otherwise leave its peers waiting)."""

import pytest
import torch

import gpudist.nn as gnn
from gpudist import Partition, TensorSpec
from gpudist.halo import HaloExchange
from tests.util import block_of, global_tensor


def _forward_only(kind, pshape, gshape, args):
    """Forward of a distributed layer vs the torch layer, per rank, errors caught locally
    (no collective follows the local op, so a failing rank does not hang its peers)."""
    torch.manual_seed(0)
    P = Partition.grid(pshape)
    nd = len(gshape) - 2
    if kind == "conv":
        seq = getattr(torch.nn, f"Conv{nd}d")(gshape[1], 2, *args, dtype=torch.float64)
        layer = getattr(gnn, f"DistributedConv{nd}d")(P, gshape[1], 2, *args,
                                                       dtype=torch.float64)
        layer.load_global_state_dict(seq.state_dict())
    else:
        seq = getattr(torch.nn, f"{kind}Pool{nd}d")(*args)
        layer = getattr(gnn, f"Distributed{kind}Pool{nd}d")(P, *args)
    G = global_tensor(gshape, seed=1)
    Y = seq(G)
    try:
        y = layer(block_of(G, P))
    except Exception as e:  # noqa: BLE001 -- reported to the test
        return f"{type(e).__name__}: {e}"
    want = block_of(Y, P)
    if tuple(y.shape) != tuple(want.shape):
        return f"shape {tuple(y.shape)} != {tuple(want.shape)}"
    return float((y - want).abs().max()) if y.numel() else 0.0


def _all_ok(res):
    bad = [r for r in res if not isinstance(r, float) or r > 1e-10]
    assert not bad, bad


def test_conv_worker_reading_only_padding(cluster):
    # n=5 over 4 workers, kernel 1, stride 2, padding 3: 6 outputs (2, 2, 1, 1); worker 2's
    # output 4 reads global index 5 (right padding) while its bulk is [3, 4)
    _all_ok(cluster.run(4, _forward_only, "conv", (1, 1, 4), (1, 1, 5), (1, 2, 3)))


def _halo_only_padding(pad_value, op_padding):
    """The halo exchange alone: worker 2 of 4 (n=5, k=1, s=2, p=3) must return one entry of
    right padding (its output reads global index 5)."""
    P = Partition.grid((4,))
    G = global_tensor((5,), seed=1)
    H = HaloExchange(P, 1, 2, 3, pad_value=pad_value, op_padding=op_padding)
    y = H(block_of(G, P))
    plan = H.local_plan(TensorSpec(P, (5,), torch.float64))
    return P.coords[0], tuple(y.shape), plan.pads[0]


def test_halo_all_padding_worker_shape(cluster):
    res = cluster.run(4, _halo_only_padding, 0.0, False)
    got = {c: (shape, pads) for c, shape, pads in res}
    assert got[2] == ((1,), (0, 0)), got


@pytest.mark.parametrize("kind,args", [("conv", (2, 2, 0)), ("Max", (2, 2)),
                                       ("Avg", (3, 2, 1))])
def test_layer_worker_without_outputs(cluster, kind, args):
    # length 4 over 3 workers: 2 outputs, worker 2 has none
    _all_ok(cluster.run(3, _forward_only, kind, (1, 1, 3), (1, 1, 4), args))


def _bn_vs_torch(pshape, gshape, dtype, offset=0.0, scale=1.0):
    """Training-mode forward + backward of DistributedBatchNorm vs torch's BatchNorm in
    float64 on the same (rounded) input; max errors on the root."""
    from tests.test_layers import _gather, _maxerr
    P = Partition.grid(pshape)
    seq = getattr(torch.nn, f"BatchNorm{len(gshape) - 2}d")(gshape[1], dtype=torch.float64)
    layer = gnn.DistributedBatchNorm(P, gshape[1], dtype=dtype)
    G = (global_tensor(gshape, seed=1) * scale + offset).to(dtype)
    x = block_of(G, P).requires_grad_(True)
    y = layer(x)
    Gs = G.double().requires_grad_(True)
    Y = seq(Gs)
    dY = global_tensor(Y.shape, seed=2)
    y.backward(block_of(dY, P).to(dtype))
    Y.backward(dY)
    yg, root = _gather(y.double(), P, Y.shape)
    dxg, _ = _gather(x.grad.double(), P, G.shape)
    if not root.active:
        return {}
    return {"y": _maxerr(yg, Y.detach()), "dx": _maxerr(dxg, Gs.grad)}


def test_batchnorm_empty_local_block(cluster):
    res = cluster.run(3, _bn_vs_torch, (3, 1, 1, 1), (2, 3, 4, 4), torch.float64)
    assert all(v < 1e-10 for r in res for v in r.values()), res


def test_batchnorm_float32_large_mean(cluster):
    res = cluster.run(2, _bn_vs_torch, (1, 1, 2), (4, 3, 10), torch.float32, 300.0, 0.1)
    assert all(v < 1e-2 for r in res for v in r.values()), res


def _general_conv_bad_kernel(comm_timeout):
    """General-form conv, P_x on ranks 0, 1 and P_w on ranks 0-3: the kernel (5) is longer
    than the global input (2), which the halo plan rejects with HaloError on P_x's ranks."""
    from gpudist.runtime import require_world
    tr = require_world(None).transport
    old, tr.timeout = tr.timeout, comm_timeout
    try:
        P_w = Partition.grid((1, 2, 1, 2))
        layer = gnn.DistributedConv1d(Partition([0, 1], (1, 1, 2)), 2, 2, 5, P_w=P_w)
        x = torch.zeros(1, 2, 1) if layer.P_x.active else torch.zeros(0, 0, 0)
        layer(x)
    finally:
        tr.timeout = old


def test_general_conv_halo_error_on_every_rank(cluster):
    try:
        errs = cluster.run(4, _general_conv_bad_kernel, 3.0, expect_error=True)
    finally:
        cluster.discard(4)  # a timed-out collective leaves the gloo groups unusable
    assert all(e is not None and e.type in ("HaloError", "ShapeError") for e in errs), \
        [(e.type if e else None) for e in errs]


# -- passing extra equivalence cases ---------------------------------------------------------

def _general_cases(cases):
    from tests.test_layers import _conv_general_case
    return [_conv_general_case(*c) for c in cases]


def test_general_conv_extra_cases(cluster):
    """General form: per-dim stride/dilation/padding with co and space split; 'same' with an
    even dilated kernel on reordered P_w/P_y ranks."""
    cases = [
        (2, (1, 2, 1, 2, 1), [0, 1, 2, 3], [0, 1], None, (2, 3, 9, 7), 3, 4, (3, 2),
         (2, 1), (2, 1), (1, 2)),
        (1, (1, 1, 2, 2), [3, 2, 1, 0], [0, 1, 2, 3], [1, 0], (1, 4, 13), 4, 3, 4, 1,
         "same", 2),
    ]
    res = cluster.run(4, _general_cases, cases)
    for i in range(len(cases)):
        keys = set().union(*(r[i] for r in res))
        assert keys == {"y0", "dx0", "dw0", "db0"}, keys
        assert all(v < 1e-10 for r in res for v in r[i].values()), [r[i] for r in res]


def _upsample_cases(cases):
    from tests.test_sampling import _equivalence
    out = []
    for pshape, g, opts in cases:
        P = Partition.grid(pshape)
        layer = gnn.DistributedUpsample(P, **opts)
        errs = _equivalence(pshape, list(range(P.size)), g, opts, layer=layer)
        errs["fast"] = layer.plan(TensorSpec(P, g, torch.float64)).fast is not None
        out.append(errs)
    return out


def test_upsample_fast_path_extra_cases(cluster):
    """The cropped-torch-kernel path: ratio 5, size, recompute_scale_factor with a
    non-integer factor that lands on an integer ratio, ratio 1 in one dim, 3-D by size."""
    from tests.test_sampling import _up
    cases = [
        ((1, 1, 4), (1, 2, 9), _up("linear", False, scale_factor=5)),
        ((1, 1, 4), (1, 2, 7), _up("linear", False, size=21)),
        ((1, 1, 4), (1, 2, 10), _up("linear", False, scale_factor=2.05,
                                    recompute_scale_factor=True)),
        ((1, 1, 2, 2), (1, 1, 5, 7), _up("bilinear", False, scale_factor=(3, 1))),
        ((1, 1, 1, 2, 2), (1, 1, 3, 5, 6), _up("trilinear", False, size=(3, 10, 18))),
    ]
    res = cluster.run(4, _upsample_cases, cases)
    for i in range(len(cases)):
        assert all(r[i]["fast"] for r in res), i
        assert res[0][i]["y"] < 1e-10 and res[0][i]["dx"] < 1e-10, (i, res[0][i])
