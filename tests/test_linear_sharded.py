"""Sharded-weight linear layers (AllGather / ReduceScatter forms, + ZeRO) and expert linear
layers against torch in float64: forward, input and parameter gradients gathered to one
rank, seeded initialization, an AG -> RS chain, global state dict round trips, Jacobian
adjoints and errors on every rank."""

import pytest
import torch
import torch.nn.functional as F

from gpudist import DistTensor, Partition
from gpudist.nn.experts import (
    DistributedExpertAllGather,
    DistributedExpertAllGatherZero,
    DistributedExpertReduceScatter,
    DistributedExpertReduceScatterZero,
)
from gpudist.nn.linear_sharded import (
    DistributedLinearAllGather,
    DistributedLinearAllGatherZero,
    DistributedLinearReduceScatter,
    DistributedLinearReduceScatterZero,
)
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
LAYERS = {"ag": DistributedLinearAllGather, "rs": DistributedLinearReduceScatter,
          "agz": DistributedLinearAllGatherZero, "rsz": DistributedLinearReduceScatterZero}
EXPERTS = {"eag": DistributedExpertAllGather, "ers": DistributedExpertReduceScatter,
           "eagz": DistributedExpertAllGatherZero, "ersz": DistributedExpertReduceScatterZero}


def _backward(y, dy):
    if y.requires_grad:  # ranks outside the layer hold a detached zero-volume output
        y.backward(dy)


class _ExpertsRef(torch.nn.Module):
    """The sequential expert layer: expert e's parameters from torch.nn.Linear, in order."""

    def __init__(self, E, fi, fo, bias):
        super().__init__()
        lins = [torch.nn.Linear(fi, fo, bias=bias, dtype=torch.float64) for _ in range(E)]
        self.weight = torch.nn.Parameter(torch.stack([m.weight.detach() for m in lins]))
        self.bias = torch.nn.Parameter(torch.stack([m.bias.detach() for m in lins])) \
            if bias else None

    def forward(self, x):
        y = torch.einsum("e...f,eof->e...o", x, self.weight)
        if self.bias is not None:
            y = y + self.bias.reshape((self.bias.shape[0],) + (1,) * (x.dim() - 2) + (-1,))
        return y


def _make(kind, P, fi, fo, bias, dim, E=None):
    if kind in LAYERS:
        return LAYERS[kind](P, fi, fo, bias, dim=dim, dtype=torch.float64)
    return EXPERTS[kind](P, E, fi, fo, bias, dim=dim, dtype=torch.float64)


def _ref(kind, fi, fo, bias, E=None):
    if kind in LAYERS:
        return torch.nn.Linear(fi, fo, bias=bias, dtype=torch.float64)
    return _ExpertsRef(E, fi, fo, bias)


# ------------------------------------------------------------------ layers vs torch
def _case(kind, pshape, ranks, gshape, fi, fo, dim, bias, E=None, steps=2):
    P = Partition(ranks, pshape)
    torch.manual_seed(3)
    seq = _ref(kind, fi, fo, bias, E)
    torch.manual_seed(3)
    layer = _make(kind, P, fi, fo, bias, dim, E)
    errs = {}
    sd = layer.global_state_dict()
    if sd:  # seeded initialization: the torch layer's parameters
        errs["init"] = float(set(sd) != set(seq.state_dict())) + sum(
            maxerr(v, seq.state_dict()[k]) for k, v in sd.items())
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.rand(p.shape, dtype=p.dtype))
    layer.load_global_state_dict(seq.state_dict())
    P_y = layer.P_y
    for step in range(steps):  # the gradients accumulate over the steps, as in torch
        G = global_tensor(gshape, seed=step)
        x = block_of(G, P).requires_grad_(True)
        Gs = G.clone().requires_grad_(True)
        y = layer(DistTensor.from_local(x, P, gshape))
        Y = seq(Gs)
        dY = global_tensor(Y.shape, seed=10 + step)
        errs[f"where{step}"] = float(y.partition != P_y or tuple(y.shape) != tuple(Y.shape))
        _backward(y.local, block_of(dY, P_y))
        Y.backward(dY)
        yg, root = gather(y.local, P_y, Y.shape)
        dxg, _ = gather(x.grad if x.grad is not None else torch.zeros_like(x), P, gshape)
        grads = layer.global_grads()
        if root.active:
            errs[f"y{step}"] = maxerr(yg, Y.detach())
            errs[f"dx{step}"] = maxerr(dxg, Gs.grad)
        if grads:
            errs[f"keys{step}"] = float(set(grads) != set(dict(seq.named_parameters())))
            for name, p in seq.named_parameters():
                errs[f"d{name}{step}"] = maxerr(grads[name], p.grad)
    return errs


CASES = [
    # world, kind, partition, ranks, global shape, in, out, dim, bias, experts
    (4, "ag", (2, 2, 1), [0, 1, 2, 3], (3, 7, 5), 5, 7, -2, True, None),   # batch x seq
    (6, "ag", (1, 3, 1), [5, 3, 1], (2, 8, 4), 4, 5, -2, False, None),     # 3 ranks out
    (4, "ag", (2, 1, 2, 1), [3, 2, 1, 0], (3, 4, 5, 6), 6, 3, 2, True, None),  # dim=2
    (4, "ag", (1, 3, 1), [0, 1, 2], (2, 2, 4), 4, 5, -2, True, None),     # empty seq blocks
    (4, "rs", (2, 1, 2), [0, 1, 2, 3], (3, 7, 5), 5, 6, -2, True, None),
    (4, "rs", (1, 1, 3), [1, 2, 3], (2, 2, 5), 5, 4, -2, True, None),     # empty seq blocks
    (6, "rs", (1, 1, 3), [4, 2, 0], (2, 5, 7), 7, 4, -2, True, None),      # 3 ranks out
    (6, "agz", (3, 2, 1), [0, 1, 2, 3, 4, 5], (5, 7, 6), 6, 5, -2, True, None),
    (4, "agz", (1, 3, 1), [1, 2, 3], (2, 7, 3), 3, 4, -2, True, None),     # fibres of 1
    (6, "rsz", (3, 1, 2), [5, 4, 3, 2, 1, 0], (4, 5, 7), 7, 3, -2, True, None),
    (4, "rsz", (1, 1, 3), [1, 2, 3], (2, 4, 5), 5, 6, -2, False, None),
    (4, "eag", (2, 2, 1), [0, 1, 2, 3], (3, 7, 5), 5, 6, -2, True, 3),     # 3 experts / 2
    (6, "eag", (2, 1, 3, 1), [5, 4, 3, 2, 1, 0], (5, 2, 7, 4), 4, 5, -2, True, 5),
    (6, "ers", (2, 1, 2), [0, 1, 2, 4], (3, 5, 7), 7, 4, -2, True, 3),     # ranks 3, 5 out
    (4, "eagz", (1, 2, 2, 1), [0, 1, 2, 3], (2, 3, 5, 4), 4, 5, -2, True, 2),  # replica ax
    (6, "ersz", (1, 2, 1, 3), [0, 1, 2, 3, 4, 5], (3, 5, 4, 6), 6, 5, 2, True, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[2]))}")
def test_equals_torch(cluster, case):
    n, *args = case
    res = cluster.run(n, _case, *args)
    keys = set().union(*res)
    want = {"init", "y0", "dx0", "y1", "dx1", "dweight1", "where1"}
    if args[7]:
        want.add("dbias1")
    assert want <= keys, keys
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_mpi(cluster, backend):
    res = cluster.run(4, _case, "agz", (2, 2, 1), [0, 1, 2, 3], (3, 5, 4), 4, 5, -2, True,
                      backend=backend)
    assert "dbias1" in set().union(*res)
    assert all(v < TOL for r in res for v in r.values()), res


# ------------------------------------------------------------------ the transformer MLP
def _chain(ag_kind, rs_kind, pshape, ranks, gshape, hidden):
    """AllGather linear -> gelu -> ReduceScatter linear: back on the input partition."""
    P = Partition(ranks, pshape)
    D = gshape[-1]
    torch.manual_seed(1)
    l1 = torch.nn.Linear(D, hidden, dtype=torch.float64)
    l2 = torch.nn.Linear(hidden, D, dtype=torch.float64)
    torch.manual_seed(1)
    a = LAYERS[ag_kind](P, D, hidden, dtype=torch.float64)
    b = LAYERS[rs_kind](a.P_y, hidden, D, dtype=torch.float64)
    G = global_tensor(gshape, seed=4)
    x = block_of(G, P).requires_grad_(True)
    y = b(F.gelu(a(DistTensor.from_local(x, P, gshape))))
    Gs = G.clone().requires_grad_(True)
    Y = l2(F.gelu(l1(Gs)))
    dY = global_tensor(gshape, seed=5)
    _backward(y.local, block_of(dY, P))
    Y.backward(dY)
    errs = {"back": float(y.partition != P)}
    with torch.no_grad():  # a plain local block in gives the same plain block out
        h = a(x.detach())
        errs["plain"] = float(isinstance(h, DistTensor)) + maxerr(
            b(F.gelu(h)), y.local.detach())
    yg, root = gather(y.local, P, gshape)
    dxg, _ = gather(x.grad if x.grad is not None else torch.zeros_like(x), P, gshape)
    ga, gb = a.global_grads(), b.global_grads()
    if root.active:
        errs["y"] = maxerr(yg, Y.detach())
        errs["dx"] = maxerr(dxg, Gs.grad)
    if ga:
        errs["dw1"] = maxerr(ga["weight"], l1.weight.grad)
        errs["db1"] = maxerr(ga["bias"], l1.bias.grad)
    if gb:
        errs["dw2"] = maxerr(gb["weight"], l2.weight.grad)
        errs["db2"] = maxerr(gb["bias"], l2.bias.grad)
    return errs


@pytest.mark.parametrize("case", [
    (6, "ag", "rsz", (2, 3, 1), [0, 1, 2, 3, 4, 5], (3, 8, 5), 7),
    (4, "agz", "rs", (1, 3, 1), [3, 1, 2], (2, 5, 4), 6),
], ids=["ag-rsz", "agz-rs"])
def test_ag_rs_chain(cluster, case):
    n, *args = case
    res = cluster.run(n, _chain, *args)
    assert {"back", "plain", "y", "dx", "dw1", "db1", "dw2", "db2"} <= set().union(*res)
    assert all(v < TOL for r in res for v in r.values()), res


# ------------------------------------------------------------------ Jacobian adjoints
def _adjoints():
    from torch.func import functional_call

    torch.manual_seed(0)
    res = {}
    Pa = Partition([1, 2, 3, 4], (2, 2, 1))  # ranks 0 and 5 inactive
    Pr = Partition([1, 2, 3, 4], (2, 1, 2))
    Pe = Partition([0, 1, 2, 3, 4, 5], (2, 3, 1))
    for kind, P, g in (("ag", Pa, (3, 5, 4)), ("agz", Pa, (3, 5, 4)), ("rs", Pr, (3, 5, 4)),
                       ("rsz", Pr, (3, 5, 4)), ("eag", Pe, (3, 5, 4)),
                       ("ersz", Pr, (3, 5, 4))):
        layer = _make(kind, P, 4, 3, True, -2, E=3)
        x = DistTensor.from_local(block_of(global_tensor(g, seed=1), P), P, g)
        res[f"{kind}.x"] = jam(layer, x, eps=1.0, seed=1)  # linear in x: eps = 1
        for name, p in layer.named_parameters():
            res[f"{kind}.{name}"] = jam(lambda t, n=name, m=layer, x=x: functional_call(
                m, {n: t}, (x,)).local, p.detach(), eps=1.0, seed=2)
    return res


def test_jacobian_adjoints(cluster):
    res = cluster.run(6, _adjoints)
    assert all(r == res[0] for r in res)
    assert len(res[0]) == 18, sorted(res[0])
    for key, m in res[0].items():
        assert m < 1e-12, (key, m)


# ------------------------------------------------------------------ checkpoints
def _roundtrip(path):
    """Layers -> global state dicts -> torch.save -> fresh layers (another seed) load them
    -> same parameters; the dicts load strictly into torch.nn.Linear / the expert ref."""
    from gpudist.runtime import require_world

    world = require_world(None)
    Pa = Partition.grid((2, 2, 1))
    Pr = Partition.grid((2, 1, 2))

    def build(seed):
        torch.manual_seed(seed)
        return {"ag": _make("ag", Pa, 5, 7, True, -2), "agz": _make("agz", Pa, 5, 7, True, -2),
                "rs": _make("rs", Pr, 5, 3, True, -2), "rsz": _make("rsz", Pr, 5, 3, False, -2),
                "eag": _make("eag", Pa, 3, 4, True, -2, E=3),
                "ersz": _make("ersz", Pr, 3, 4, True, -2, E=2)}

    a, b, loaded, sd2, same = global_checkpoint_roundtrip(build, path)
    out = {"same_local": same}
    for k, layer in b.items():  # per-rank state dicts (with their layout) load back
        layer.load_state_dict(a[k].state_dict())
    out["per_rank"] = all(torch.equal(p, q) for k in a for p, q in
                          zip(a[k].parameters(), b[k].parameters()))
    if world.rank == 0:
        seq = {"ag": _ref("ag", 5, 7, True), "agz": _ref("agz", 5, 7, True),
               "rs": _ref("rs", 5, 3, True), "rsz": _ref("rsz", 5, 3, False),
               "eag": _ref("eag", 3, 4, True, 3), "ersz": _ref("ersz", 3, 4, True, 2)}
        for k, m in seq.items():
            before = m.weight.detach().clone()
            m.load_state_dict(loaded[k])  # strict: every key, every shape
            out[k] = all(torch.equal(v, sd2[k][n]) for n, v in m.state_dict().items())
            out[k + ".changed"] = not torch.equal(m.weight, before)
    return out


def test_global_state_dict_roundtrip(cluster, tmp_path):
    res = cluster.run(4, _roundtrip, str(tmp_path / "ckpt.pt"))
    assert all(r["same_local"] and r["per_rank"] for r in res)
    root = res[0]
    for k in ("ag", "agz", "rs", "rsz", "eag", "ersz"):
        assert root[k] and root[k + ".changed"], (k, root)


# ------------------------------------------------------------------ errors
def _bad(which):
    if which == "ag_features_split":
        DistributedLinearAllGather(Partition.grid((2, 2)), 4, 4)
    elif which == "rs_dim_split":
        DistributedLinearReduceScatterZero(Partition.grid((1, 2, 2)), 4, 4)
    elif which == "dim_last":
        DistributedLinearAllGather(Partition.grid((4, 1)), 4, 4, dim=-1)
    elif which == "too_few_out":
        DistributedLinearAllGatherZero(Partition.grid((1, 4, 1)), 4, 3)
    elif which == "expert_dim0":
        DistributedExpertAllGather(Partition.grid((2, 2, 1)), 4, 3, 3, dim=0)
    elif which == "input_features":
        P = Partition.grid((2, 2, 1))
        layer = DistributedLinearAllGather(P, 6, 4)
        layer(DistTensor.from_local(block_of(global_tensor((2, 4, 5)).float(), P), P,
                                    (2, 4, 5)))
    elif which == "input_dtype":
        P = Partition.grid((1, 1, 4))
        layer = DistributedLinearReduceScatter(P, 5, 4)  # float32 parameters
        layer(DistTensor.from_local(block_of(global_tensor((2, 4, 5)), P), P, (2, 4, 5)))
    elif which == "input_experts":
        P = Partition.grid((2, 2, 1))
        layer = DistributedExpertAllGather(P, 3, 5, 4, dtype=torch.float64)
        layer(DistTensor.from_local(block_of(global_tensor((4, 4, 5)), P), P, (4, 4, 5)))


@pytest.mark.parametrize("which,err,text", [
    ("ag_features_split", "PartitionError", "P_x.shape[-1] == 1"),
    ("rs_dim_split", "PartitionError", "P_x.shape[1] == 1"),
    ("dim_last", "ValueError", "other than the features"),
    ("too_few_out", "PartitionError", "out_features=3 is fewer than the 4"),
    ("expert_dim0", "ValueError", "and the experts"),
    ("input_features", "ShapeError", "expected an input of shape [*, *, 6]"),
    ("input_dtype", "DeviceError", "the layer's parameters float32"),
    ("input_experts", "ShapeError", "[3, *, 5]"),
])
def test_errors_on_every_rank(cluster, which, err, text):
    errs = cluster.run(4, _bad, which, expect_error=True)
    assert_raised_everywhere(errs, err, text)
