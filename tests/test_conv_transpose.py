"""Distributed transposed convolution equals ``torch.nn.ConvTranspose1d/2d/3d`` (gathered,
float64: forward, input gradient, weight and bias gradients, and the seeded initial
parameters): stride 1 and 2+, padding, output_padding, dilation, even kernels, groups;
spatial partitions (uneven, inactive ranks, batch split, workers no input reaches, workers
without outputs, halos wider than the neighbours' blocks); the general form with channels
partitioned; MPI; a DistTensor input and a second global shape through the same layer;
Jacobian adjoints; the global state dict round trip; bad configurations and inputs raising
the same error on every rank."""

import pytest
import torch
from torch.func import functional_call

from gpudist import DistTensor, Partition
from gpudist.nn.conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
)
from gpudist.primitives import zero_volume
from gpudist.testing import jacobian_adjoint_mismatch as jam
from tests.util import block_of, gather, global_tensor, maxerr

TOL = 1e-10
CLS = {1: DistributedConvTranspose1d, 2: DistributedConvTranspose2d,
       3: DistributedConvTranspose3d}
SEQ = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d, 3: torch.nn.ConvTranspose3d}


def _build(nd, w_shape, w_ranks, x_ranks, y_ranks, cin, cout, k, s, p, q, d, groups=1,
           bias=True, seed=0):
    """(distributed layer, torch layer), both initialized from ``seed``. ``w_ranks`` None:
    the spatial form, x on ``x_ranks`` shaped (P_b, 1, spatial..) from ``w_shape``."""
    pb, pco, pci, sp = w_shape[0], w_shape[1], w_shape[2], tuple(w_shape[3:])
    P_w = Partition(w_ranks, w_shape) if w_ranks is not None else None
    P_x = Partition(x_ranks, (pb, pci) + sp)
    P_y = Partition(y_ranks, (pb, pco) + sp) if y_ranks is not None else None
    torch.manual_seed(seed)
    seq = SEQ[nd](cin, cout, k, s, p, q, groups, bias, d, dtype=torch.float64)
    torch.manual_seed(seed)
    layer = CLS[nd](P_x, cin, cout, k, s, p, q, groups, bias, d, P_w=P_w, P_y=P_y,
                    dtype=torch.float64)
    return layer, seq


def _case(nd, w_shape, w_ranks, x_ranks, y_ranks, gshape, cin, cout, k, s, p, q, d,
          groups=1, bias=True, calls=1, dist=False):
    layer, seq = _build(nd, w_shape, w_ranks, x_ranks, y_ranks, cin, cout, k, s, p, q, d,
                        groups, bias)
    P_x, P_y = layer.P_x, layer.P_y
    errs = {}
    init = layer.global_state_dict()
    if init:  # on the root: the seeded parameters are torch's, bit for bit
        sd = seq.state_dict()
        errs["init"] = 0.0 if init.keys() == sd.keys() and all(
            torch.equal(v, sd[key]) for key, v in init.items()) else 1.0
    for call in range(calls):  # later calls: another global shape through the same layer
        g = tuple(gshape[:2]) + tuple(x + call for x in gshape[2:])
        G = global_tensor(g, seed=1 + call)
        x = block_of(G, P_x).requires_grad_(True)
        layer.zero_grad()
        seq.zero_grad()
        if dist:
            yd = layer(DistTensor.from_local(x, P_x, g))
            errs[f"spec{call}"] = 0.0 if (yd.spec.partition == P_y and isinstance(
                yd, DistTensor)) else 1.0
            y = yd.local
        else:
            y = layer(x)
        Gs = G.clone().requires_grad_(True)
        Y = seq(Gs)
        if not P_y.active:
            errs[f"inactive_numel{call}"] = float(y.numel())
        dY = global_tensor(Y.shape, seed=2 + call)
        y.backward(block_of(dY, P_y) if P_y.active else zero_volume(y.dim(), like=y))
        Y.backward(dY)
        yg, root = gather(y, P_y, Y.shape)
        dxg, rootx = gather(x.grad if x.grad is not None else torch.zeros_like(x), P_x, g)
        grads = layer.global_grads()
        if root.active:
            errs[f"y{call}"] = maxerr(yg, Y.detach())
        if rootx.active:
            errs[f"dx{call}"] = maxerr(dxg, Gs.grad)
        if grads:
            errs[f"dw{call}"] = maxerr(grads["weight"], seq.weight.grad)
            if bias:
                errs[f"db{call}"] = maxerr(grads["bias"], seq.bias.grad)
    return errs


def _check(res, calls=1, bias=True, extra=()):
    keys = set()
    for errs in res:
        keys |= set(errs)
        for key, v in errs.items():
            assert v < TOL, (key, v, errs)
    want = {"init"} | {f"{a}{c}" for c in range(calls)
                       for a in ("y", "dx", "dw") + (("db",) if bias else ())}
    assert want | set(extra) <= keys, keys


SPATIAL = [
    # world, nd, w_shape (P_b, 1, 1, spatial..), x ranks, global shape, cin, cout, k, s, p,
    # output_padding, dilation, groups
    # 1-D, 3 of 4 ranks (rank 3 inactive), stride 2, padding, output_padding
    (4, 1, (1, 1, 1, 3), [0, 1, 2], (2, 2, 10), 2, 3, 3, 2, 1, 1, 1, 1),
    # 2-D, even kernel in one dim, stride (2, 1), uneven blocks
    (4, 2, (1, 1, 1, 2, 2), [0, 1, 2, 3], (2, 3, 7, 6), 3, 2, (4, 3), (2, 1), (1, 0),
     (1, 0), 1, 1),
    # 2-D, stride 1 with padding and dilation on 6 ranks
    (6, 2, (1, 1, 1, 3, 2), list(range(6)), (1, 2, 9, 5), 2, 3, 3, 1, 2, 0, 2, 1),
    # 2-D on ranks 5, 3 (4, 2, 1, 0 inactive), stride 3 and dilation 2 with output_padding
    (6, 2, (1, 1, 1, 1, 2), [5, 3], (2, 2, 4, 5), 2, 2, 3, (1, 3), (0, 1), (0, 2),
     (1, 2), 1),
    # 3-D, even kernels, strides 2 and 3, output_padding, dilation
    (4, 3, (1, 1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 5, 4, 6), 2, 2, (2, 3, 3), (2, 1, 3),
     (0, 1, 1), (1, 0, 2), (1, 2, 1), 1),
    # stride 4 > kernel: gaps, a worker no input reaches (bias only), zero-extended crops;
    # groups
    (4, 1, (1, 1, 1, 4), [0, 1, 2, 3], (2, 2, 3), 2, 4, 1, 4, 0, 3, 1, 2),
    # more workers than outputs: worker 3 has none, workers 2, 3 no input
    (4, 1, (1, 1, 1, 4), [0, 1, 2, 3], (2, 2, 2), 2, 3, 2, 1, 0, 0, 1, 1),
    # batch and space split, stride 2 even kernel
    (4, 1, (2, 1, 1, 2), [3, 2, 1, 0], (3, 2, 7), 2, 3, 4, 2, 1, 0, 1, 1),
]


@pytest.mark.parametrize("case", SPATIAL, ids=lambda c: f"{c[1]}d-P{'x'.join(map(str, c[2]))}"
                         f"-k{c[7]}s{c[8]}p{c[9]}q{c[10]}d{c[11]}g{c[12]}")
def test_spatial_equivalence(cluster, case):
    n, nd, w_shape, x_ranks, gshape, cin, cout, k, s, p, q, d, groups = case
    res = cluster.run(n, _case, nd, w_shape, None, x_ranks, None, gshape, cin, cout, k, s, p,
                      q, d, groups)
    _check(res)


def test_spatial_dist_tensor_second_shape_no_bias(cluster):
    """A DistTensor in gives a DistTensor out; two global shapes through one layer."""
    res = cluster.run(6, _case, 2, (1, 1, 1, 2, 2), None, [1, 2, 3, 4], None, (2, 2, 6, 7),
                      2, 3, 3, 2, 1, 1, 1, bias=False, calls=2, dist=True)
    _check(res, calls=2, bias=False, extra=("spec0", "spec1", "inactive_numel0"))


GENERAL = [
    # world, nd, P_w shape, P_w ranks, P_x ranks, P_y ranks, global shape, cin, cout, k, s,
    # p, output_padding, dilation
    # channels only: ci split 2, co split 2; x on the co = 0 fibre, y the default
    (4, 2, (1, 2, 2, 1, 1), [0, 1, 2, 3], [0, 1], None, (2, 5, 6, 5), 5, 3, 3, 2, 1, 1, 1),
    # ranks 0, 1 hold only x; y on other ranks than P_w's order; even kernel
    (6, 1, (1, 2, 1, 2), [5, 4, 3, 2], [0, 1], [2, 3, 4, 5], (2, 3, 11), 3, 5, 4, 2, 2, 1, 1),
    # 3-D, ci split with space split, stride 2 even kernel
    (4, 3, (1, 1, 2, 1, 1, 2), [0, 1, 2, 3], [0, 1, 2, 3], None, (1, 4, 3, 4, 5), 4, 3, 2,
     2, 0, 0, 1),
    # batch x output channels x space, dilation
    (6, 1, (2, 3, 1, 1), list(range(6)), [0, 3], None, (3, 2, 8), 2, 4, 3, 1, 1, 0, 2),
]


@pytest.mark.parametrize("case", GENERAL, ids=lambda c: f"{c[1]}d-Pw{'x'.join(map(str, c[2]))}")
def test_general_equivalence(cluster, case):
    n, *args = case
    _check(cluster.run(n, _case, *args))


def test_general_mpi(cluster):
    n, *args = GENERAL[0]
    _check(cluster.run(n, _case, *args, backend="mpi"))


# --------------------------------------------------------------------------- adjoints
def _jacobians():
    res = {}
    # spatial form, ranks 4, 5 inactive, stride 2 with output_padding
    layer, _ = _build(2, (1, 1, 1, 2, 2), None, [0, 1, 2, 3], None, 3, 2, 3, 2, 1, 1, 1)
    x = block_of(global_tensor((2, 3, 5, 4), seed=1), layer.P_x)
    # general form: channels and space split
    gen, _ = _build(1, (1, 2, 2, 1), list(range(4)), [5, 4], None, 5, 3, 4, 2, 1, 1, 1)
    xg = block_of(global_tensor((2, 5, 9), seed=2), gen.P_x)
    for tag, lay, xx in (("spatial", layer, x), ("general", gen, xg)):
        res[f"{tag}.x"] = jam(lay, xx, eps=1.0, seed=1)
        for name in ("weight", "bias"):
            p = getattr(lay, name)
            res[f"{tag}.{name}"] = jam(
                lambda t, name=name, lay=lay, xx=xx: functional_call(lay, {name: t}, (xx,)),
                p.detach(), eps=1.0, seed=2)
    return res


def test_jacobian_adjoint(cluster):
    res = cluster.run(6, _jacobians)
    assert all(r == res[0] for r in res)  # collective: every rank got the same numbers
    assert set(res[0]) == {f"{t}.{n}" for t in ("spatial", "general")
                           for n in ("x", "weight", "bias")}
    for key, m in res[0].items():
        assert m < 1e-7, (key, m)


# --------------------------------------------------------------------------- state dicts
def _roundtrip(path):
    from gpudist.runtime import require_world

    world = require_world(None)
    args = (2, (1, 2, 2, 1, 1), [0, 1, 2, 3], [0, 1], None, 5, 3, (3, 2), 2, 1, 1, 1)
    a, _ = _build(*args, seed=1)
    sd = a.global_state_dict()
    if world.rank == 0:
        torch.save(sd, path)
    world.transport.barrier()
    loaded = torch.load(path)
    b, _ = _build(*args, seed=2)
    before = b.global_state_dict()
    b.load_global_state_dict(loaded)
    after = b.global_state_dict()
    x = block_of(global_tensor((2, 5, 4, 5), seed=3), a.P_x)
    ya, yb = a(x), b(x)
    out = {"same_output": bool(torch.equal(ya, yb))}
    if world.rank == 0:
        seq = torch.nn.ConvTranspose2d(5, 3, (3, 2), 2, 1, 1, dtype=torch.float64)
        seq.load_state_dict(loaded)  # strict: every key present, shapes right
        out["keys"] = sorted(loaded)
        out["differed"] = not torch.equal(before["weight"], loaded["weight"])
        out["loaded"] = all(torch.equal(v, after[k]) for k, v in seq.state_dict().items())
    return out


def test_global_state_dict_roundtrip(cluster, tmp_path):
    res = cluster.run(4, _roundtrip, str(tmp_path / "convt.pt"))
    assert all(r["same_output"] for r in res), res
    assert res[0]["keys"] == ["bias", "weight"]
    assert res[0]["differed"] and res[0]["loaded"], res[0]


# --------------------------------------------------------------------------- errors
def _bad(which):
    P1 = Partition.grid((1, 1, 4))
    if which == "groups":  # groups with channels split
        P_w = Partition.grid((1, 1, 2, 2))
        DistributedConvTranspose1d(Partition.grid((1, 2, 2)), 4, 4, 3, groups=2, P_w=P_w)
    elif which == "channels":  # P_x splits channels without a P_w
        DistributedConvTranspose2d(Partition.grid((1, 2, 1, 2)), 4, 4, 3)
    elif which == "padding_mode":
        DistributedConvTranspose1d(P1, 2, 2, 3, padding_mode="reflect")
    elif which == "output_padding":  # must be < max(stride, dilation)
        DistributedConvTranspose1d(P1, 2, 2, 3, stride=2, output_padding=2)
    elif which == "in_channels":  # the input has 3 channels, the layer takes 2
        layer = DistributedConvTranspose1d(P1, 2, 2, 3, dtype=torch.float64)
        layer(block_of(global_tensor((1, 3, 8)), P1))
    elif which == "too_small":  # output length (4-1)*1 - 2*3 + 0 + 1 = -2
        layer = DistributedConvTranspose1d(P1, 1, 1, 1, padding=3, dtype=torch.float64)
        layer(block_of(global_tensor((1, 1, 4)), P1))
    elif which == "empty_output":  # (4-1)*2 - 2*4 + 1*(2-1) + 0 + 1 = 0, refused by torch
        # too here (its float32 path with a batch of 2 or more returns an empty tensor:
        # README)
        layer = DistributedConvTranspose1d(P1, 1, 1, 2, stride=2, padding=4,
                                           dtype=torch.float64)
        layer(block_of(global_tensor((1, 1, 4)), P1))
    elif which == "output_size":  # torch's forward argument: refused, naming the fix
        layer = DistributedConvTranspose1d(P1, 2, 2, 3, stride=2, dtype=torch.float64)
        layer(block_of(global_tensor((1, 2, 8)), P1), output_size=[16])


@pytest.mark.parametrize("which,err", [
    ("groups", "PartitionError"), ("channels", "PartitionError"),
    ("padding_mode", "ValueError"), ("output_padding", "ValueError"),
    ("in_channels", "ShapeError"), ("too_small", "ShapeError"),
    ("output_size", "ValueError"), ("empty_output", "ShapeError")])
def test_bad_input_errors_on_every_rank(cluster, which, err):
    errs = cluster.run(4, _bad, which, expect_error=True)
    assert all(e is not None and e.type == err for e in errs), errs
    assert all(e.message == errs[0].message for e in errs), errs
    assert "ConvTranspose" in errs[0].message, errs[0]
    if which == "empty_output":
        with pytest.raises(RuntimeError, match="too small"):
            torch.nn.ConvTranspose1d(1, 1, 2, stride=2, padding=4)(torch.zeros(1, 1, 4))


def test_halo_wider_than_the_neighbours(cluster):
    """Kernel 7 at stride 1 over 4 workers of 2 inputs: worker 1 needs inputs two workers
    away, served by the workers that own them."""
    from gpudist.halo import HaloGeometry
    from gpudist.nn.conv_transpose import needed_inputs

    outs = [(0, 4), (4, 8), (8, 11), (11, 14)]  # 14 outputs over 4 workers
    geo = HaloGeometry.from_intervals(8, outs, [needed_inputs(*o, 8, 7, 1, 0, 1) for o in outs])
    assert geo.worker(1).hops == 2  # the case does reach beyond the direct neighbours
    case = (1, (1, 1, 1, 4), None, [0, 1, 2, 3], None, (2, 1, 8), 1, 2, 7, 1, 0, 0, 1)
    _check(cluster.run(4, _case, *case))
