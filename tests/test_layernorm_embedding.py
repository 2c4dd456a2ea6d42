"""Layer norm (+ ZeRO), RMS norm (ZeRO), embedding (+ ZeRO) and the transpose (2-D FFT)
against torch in float64: forward, input and parameter gradients gathered to one rank,
seeded initialization, global state dict round trips, Jacobian adjoints and errors."""

import pytest
import torch

from gpudist import DistTensor, Partition
from gpudist.nn.embedding import DistributedEmbedding, DistributedEmbeddingZero
from gpudist.nn.layernorm import (
    DistributedLayerNorm,
    DistributedLayerNormZero,
    DistributedRMSNormZero,
)
from gpudist.nn.transpose import DistributedTranspose, transposed_partition
from gpudist.primitives import AllSumReduce
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
NORMS = {"ln": DistributedLayerNorm, "lnz": DistributedLayerNormZero,
         "rmsz": DistributedRMSNormZero}
EMBS = {"emb": DistributedEmbedding, "embz": DistributedEmbeddingZero}


def _backward(y, dy):
    if y.requires_grad:  # ranks outside the layer hold a detached zero-volume output
        y.backward(dy)


def _torch_norm(kind, shape, opts):
    if kind == "rmsz":
        return torch.nn.RMSNorm(shape, dtype=torch.float64, **opts)
    return torch.nn.LayerNorm(shape, dtype=torch.float64, **opts)


# ------------------------------------------------------------------ norms vs torch
def _norm_case(kind, pshape, ranks, gshape, k, opts, steps=2):
    P = Partition(ranks, pshape)
    shape = tuple(gshape[-k:])
    torch.manual_seed(3)
    seq = _torch_norm(kind, shape, opts)
    torch.manual_seed(3)
    layer = NORMS[kind](P, shape, dtype=torch.float64, **opts)
    errs = {}
    sd = layer.global_state_dict()
    if sd:  # seeded initialization: the torch layer's parameters
        errs["init"] = float(set(sd) != set(seq.state_dict())) + sum(
            maxerr(v, seq.state_dict()[k]) for k, v in sd.items())
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(0.5, 1.5)
    layer.load_global_state_dict(seq.state_dict())
    for step in range(steps):  # the gradients accumulate over the steps, as in torch
        G = global_tensor(gshape, seed=step) * 3 + 100
        x = block_of(G, P).requires_grad_(True)
        Gs = G.clone().requires_grad_(True)
        y = layer(DistTensor.from_local(x, P, gshape))
        Y = seq(Gs)
        dY = global_tensor(gshape, seed=10 + step)
        _backward(y.local, block_of(dY, P))
        Y.backward(dY)
        yg, root = gather(y.local, P, gshape)
        dxg, _ = gather(x.grad, P, gshape)
        grads = layer.global_grads()
        if root.active:
            errs[f"y{step}"] = maxerr(yg, Y.detach())
            errs[f"dx{step}"] = maxerr(dxg, Gs.grad)
            for name, p in seq.named_parameters():
                errs[f"d{name}{step}"] = maxerr(grads[name], p.grad)
    return errs


NORM_CASES = [
    # world, kind, partition, ranks, global shape, normalized dims, options
    (4, "ln", (2, 1, 2), [0, 1, 2, 3], (5, 3, 7), 2, {}),              # 2 normalized dims
    (4, "ln", (1, 3), [1, 2, 3], (4, 10), 1, {"bias": False}),          # rank 0 inactive
    (6, "ln", (3, 2), [5, 4, 3, 2, 1, 0], (7, 9), 1, {"elementwise_affine": False}),
    (6, "lnz", (3, 1, 2), [0, 1, 2, 3, 4, 5], (7, 2, 9), 1, {}),        # 3 shards per block
    (4, "lnz", (2, 2), [3, 2, 1, 0], (6, 11), 1, {"eps": 1e-3}),
    (4, "lnz", (3, 1), [1, 2, 3], (5, 4), 1, {}),                       # one fibre, rank 0 out
    (4, "rmsz", (2, 1, 2), [0, 1, 2, 3], (3, 4, 6), 2, {}),
    (6, "rmsz", (1, 2, 2), [2, 3, 4, 5], (2, 5, 7), 1, {"eps": 1e-6}),  # ranks 0, 1 out
]


@pytest.mark.parametrize("case", NORM_CASES,
                         ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[2]))}")
def test_norm_equals_torch(cluster, case):
    n, *args = case
    res = cluster.run(n, _norm_case, *args)
    keys = set().union(*res)
    assert {"y0", "dx0", "y1", "dx1"} <= keys, keys
    assert ("dweight1" in keys) == (args[-1].get("elementwise_affine", True)), keys
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_norm_mpi(cluster, backend):
    res = cluster.run(4, _norm_case, "lnz", (2, 2), [0, 1, 2, 3], (5, 9), 1, {},
                      backend=backend)
    assert "dbias1" in set().union(*res)
    assert all(v < TOL for r in res for v in r.values()), res


def _norm_float32_large_mean():
    P = Partition.grid((2, 2))
    G = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.1 + 1000
    layer = DistributedLayerNorm(P, 64)
    y = layer(DistTensor.from_local(block_of(G, P), P, G.shape))
    yg, root = gather(y.local, P, G.shape)
    return maxerr(yg, torch.nn.LayerNorm(64)(G).detach()) if root.active else 0.0


def test_layernorm_float32_large_mean(cluster):
    assert max(cluster.run(4, _norm_float32_large_mean)) < 2e-3


# ------------------------------------------------------------------ embeddings vs torch
def _emb_case(kind, pshape, ranks, idx_shape, V, D, opts, px_ranks=None, py_ranks=None):
    P = Partition(ranks, pshape)
    n = len(idx_shape)
    PI, pd = P.shape[:n], P.shape[-1]
    P_x = Partition(px_ranks, PI) if px_ranks else None
    P_y = Partition(py_ranks, PI + (pd,)) if py_ranks else None
    torch.manual_seed(5)
    seq = torch.nn.Embedding(V, D, dtype=torch.float64, **opts)
    torch.manual_seed(5)
    layer = EMBS[kind](P, V, D, P_x=P_x, P_y=P_y, dtype=torch.float64, **opts)
    P_x, P_y = layer.P_x, layer.P_y
    errs = {}
    sd = layer.global_state_dict()
    if sd:
        errs["init"] = float(set(sd) != {"weight"}) + maxerr(sd["weight"], seq.weight.detach())
    with torch.no_grad():  # larger rows, so max_norm has something to do
        seq.weight.mul_(1.5)
    layer.load_global_state_dict(seq.state_dict())
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        T = torch.randint(0, V, idx_shape, generator=g)
        T.view(-1)[:3] = T.view(-1)[3]  # repeated rows (scale_grad_by_freq)
        if opts.get("padding_idx") is not None:
            T.view(-1)[4] = opts["padding_idx"] % V
        y = layer(DistTensor.from_local(block_of(T, P_x), P_x, idx_shape))
        Y = seq(T)
        dY = global_tensor(Y.shape, seed=20 + step)
        _backward(y.local, block_of(dY, P_y))
        Y.backward(dY)
        yg, root = gather(y.local, P_y, Y.shape)
        grads = layer.global_grads()
        now = layer.global_state_dict()
        if root.active:
            errs[f"y{step}"] = maxerr(yg, Y.detach())
        if grads:
            errs[f"dw{step}"] = maxerr(grads["weight"], seq.weight.grad)
            errs[f"w{step}"] = maxerr(now["weight"], seq.weight.detach())  # after max_norm
    return errs


EMB_CASES = [
    # world, kind, partition (index axes, v, d), ranks, index shape, V, D, options, P_x, P_y
    (4, "emb", (2, 2, 1), [0, 1, 2, 3], (7,), 11, 5, {"padding_idx": 3}, None, None),
    (4, "emb", (1, 1, 1, 3), [1, 2, 3], (3, 5), 9, 8, {}, None, None),  # rank 0 inactive
    (4, "emb", (2, 1, 2, 1), [3, 2, 1, 0], (4, 3), 7, 4,
     {"max_norm": 1.5, "scale_grad_by_freq": True, "padding_idx": -2}, None, None),
    (6, "emb", (1, 2, 2), [0, 1, 2, 3], (9,), 10, 5, {"max_norm": 2.0, "norm_type": 1.0},
     [4], [5, 4]),                                                        # x, y elsewhere
    (6, "embz", (3, 1, 2), [0, 1, 2, 3, 4, 5], (8,), 6, 7, {"padding_idx": 0}, None, None),
    (4, "embz", (2, 2, 1), [0, 1, 2, 3], (6,), 9, 3,
     {"max_norm": 1.0, "scale_grad_by_freq": True}, None, None),
    (6, "embz", (2, 1, 1, 2), [5, 4, 3, 2], (5, 2), 8, 5, {"max_norm": 1.2}, None, None),
]


@pytest.mark.parametrize("case", EMB_CASES,
                         ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[2]))}")
def test_embedding_equals_torch(cluster, case):
    n, *args = case
    res = cluster.run(n, _emb_case, *args)
    keys = set().union(*res)
    assert {"init", "y0", "y1", "dw0", "dw1", "w1"} <= keys, keys
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_embedding_mpi(cluster, backend):
    res = cluster.run(4, _emb_case, "embz", (2, 1, 2), [0, 1, 2, 3], (7,), 9, 6,
                      {"max_norm": 1.0, "scale_grad_by_freq": True}, backend=backend)
    assert "dw1" in set().union(*res)
    assert all(v < TOL for r in res for v in r.values()), res


def _emb_bad_index(pshape, bad):
    """Indices (0, 3, bad) over P_x; P on ranks 0 and 1 of a 3-rank world (rank 2 outside
    the layer: it learns of the failure at its next call that waits for a peer)."""
    P = Partition([0, 1], pshape)
    emb = DistributedEmbedding(P, 4, 4, dtype=torch.float64)
    everyone = AllSumReduce(Partition.grid((3,)), axes=(0,))
    T = torch.tensor([0, 3, bad])
    x = DistTensor.from_local(block_of(T, emb.P_x), emb.P_x, (3,))
    emb(x)
    everyone(torch.ones(2))


@pytest.mark.parametrize("pshape", [(1, 1, 2), (1, 2, 1), (2, 1, 1)],
                         ids=["dim-split", "vocab-split", "index-split"])
@pytest.mark.parametrize("bad", [4, -1])
def test_embedding_index_out_of_range(cluster, pshape, bad):
    """torch's Embedding raises IndexError for such an index; gpudist raised torch's bare
    IndexError (no layer named) after the broadcast, on the ranks holding the index, and
    with a vocabulary split a RemoteError on the others (fuzz-found): now the rank whose
    block holds it raises an IndexError naming the layer, the index and the range before
    anything moves, and every other rank a RemoteError carrying it."""
    _bad_index_everywhere(cluster.run(3, _emb_bad_index, pshape, bad, expect_error=True),
                          pshape, bad)


def test_embedding_index_out_of_range_backends(cluster, backend):
    errs = cluster.run(3, _emb_bad_index, (1, 2, 1), 5, backend=backend, expect_error=True)
    _bad_index_everywhere(errs, (1, 2, 1), 5)


def _bad_index_everywhere(errs, pshape, bad):
    holder = 1 if pshape == (2, 1, 1) else 0  # the index (third entry) lives there
    e = errs[holder]
    assert e is not None and e.type == "IndexError", errs
    assert f"index {bad} is out of range for 4 embeddings" in e.message, e.message
    assert "DistributedEmbedding" in e.message, e.message
    for r in {0, 1, 2} - {holder}:
        assert errs[r] is not None and errs[r].type in ("RemoteError", "WorldAborted"), errs
        assert f"rank {holder} failed with IndexError" in errs[r].message, errs[r].message


# ------------------------------------------------------------------ transpose: 2-D FFT
def _fft_case(pshape, ranks, gshape, a, b):
    """FFT along the unsplit dim b, transpose (a split -> b split), FFT along a: equals
    torch.fft.fft2 over (a, b), forward and gradient, in complex128."""
    P_in = Partition(ranks, pshape)
    P_out = transposed_partition(P_in, a, b)
    tr = DistributedTranspose(P_in, P_out)
    X = torch.complex(global_tensor(gshape, seed=1), global_tensor(gshape, seed=2))
    x = block_of(X, P_in).requires_grad_(True)
    u = torch.fft.fft(x, dim=b) if P_in.active else x * 1
    v = tr(DistTensor.from_local(u, P_in, gshape))
    y = torch.fft.fft(v.local, dim=a) if P_out.active else v.local * 1
    Xs = X.clone().requires_grad_(True)
    Y = torch.fft.fft2(Xs, dim=(a, b))
    dY = torch.complex(global_tensor(gshape, seed=3), global_tensor(gshape, seed=4))
    _backward(y, block_of(dY, P_out))
    Y.backward(dY)
    yg, root = gather(y, P_out, gshape)
    dxg, root_in = gather(x.grad if x.grad is not None else torch.zeros_like(x), P_in, gshape)
    errs = {"moved": float(v.partition != P_out)}
    if root.active:
        errs["y"] = maxerr(yg, Y.detach())
    if root_in.active:
        errs["dx"] = maxerr(dxg, Xs.grad)
    return errs


FFT_CASES = [
    (4, (4, 1), [0, 1, 2, 3], (10, 7), 0, 1),        # rows split -> columns split
    (6, (1, 3), [5, 3, 1], (8, 11), 1, 0),            # ranks 0, 2, 4 inactive
    (4, (2, 2, 1), [0, 1, 2, 3], (3, 6, 5), 1, 2),    # batch split too
]


@pytest.mark.parametrize("case", FFT_CASES, ids=lambda c: "x".join(map(str, c[1])))
def test_transpose_fft2(cluster, case):
    n, *args = case
    res = cluster.run(n, _fft_case, *args)
    keys = set().union(*res)
    assert {"y", "dx", "moved"} <= keys
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_transpose_fft2_mpi(cluster):
    n, *args = FFT_CASES[0]
    res = cluster.run(n, _fft_case, *args, backend="mpi")
    assert all(v < TOL for r in res for v in r.values()) and "y" in set().union(*res)


def _partner():
    P = Partition([5, 4, 3, 2, 1, 0], (2, 3, 1))
    Q = transposed_partition(P, 1, 2)
    return Q.shape, [Q.world_rank_of((i, 0, j)) == P.world_rank_of((i, j, 0))
                     for i in range(2) for j in range(3)]


def test_transposed_partition(cluster):
    shape, same = cluster.run(6, _partner)[0]
    assert shape == (2, 1, 3) and all(same) and len(same) == 6


# ------------------------------------------------------------------ Jacobian adjoints
def _adjoints():
    from torch.func import functional_call

    torch.manual_seed(0)
    res = {}
    P = Partition([1, 2, 3, 4], (2, 2))  # ranks 0 and 5 inactive
    G = global_tensor((5, 9), seed=1) + 2
    x = DistTensor.from_local(block_of(G, P), P, G.shape)
    for kind, cls in NORMS.items():
        layer = cls(P, 9, dtype=torch.float64)
        with torch.no_grad():
            for p in layer.parameters():
                p.uniform_(0.5, 1.5)
        res[f"{kind}.x"] = jam(layer, x, eps=1e-5, seed=1)
        for name, p in layer.named_parameters():  # affine in the parameters: eps = 1
            res[f"{kind}.{name}"] = jam(lambda t, n=name, m=layer: functional_call(
                m, {n: t}, (x,)).local, p.detach(), eps=1.0, seed=2)
    Pe = Partition([4, 3, 2, 1], (2, 2, 1))
    T = torch.randint(0, 7, (9,), generator=torch.Generator().manual_seed(3))
    for kind, cls in EMBS.items():
        emb = cls(Pe, 7, 4, padding_idx=1, dtype=torch.float64)
        i = DistTensor.from_local(block_of(T, emb.P_x), emb.P_x, T.shape)
        res[f"{kind}.weight"] = jam(lambda t, m=emb, i=i: functional_call(
            m, {"weight": t}, (i,)).local, emb.weight.detach(), eps=1.0, seed=4)
    Pt = Partition([0, 2, 4], (3, 1))
    tr = DistributedTranspose(Pt, transposed_partition(Pt, 0, 1))
    xt = DistTensor.from_local(block_of(G, Pt), Pt, G.shape)
    res["transpose.x"] = jam(tr, xt, eps=1.0, seed=5)
    return res


def test_jacobian_adjoints(cluster):
    res = cluster.run(6, _adjoints)
    assert all(r == res[0] for r in res)
    assert len(res[0]) == 11, sorted(res[0])  # rmsz has no bias
    for key, m in res[0].items():
        assert m < (1e-7 if key.endswith(".x") and "transpose" not in key else 1e-12), (key, m)


# ------------------------------------------------------------------ checkpoints
def _roundtrip(path):
    """Distributed layers -> global state dicts -> torch.save -> fresh layers (another seed)
    load them -> same global state; the dicts load strictly into the torch layers."""
    from gpudist.runtime import require_world

    world = require_world(None)
    P = Partition.grid((2, 1, 2))
    Pe = Partition.grid((2, 2, 1))

    def build(seed):
        torch.manual_seed(seed)
        return {"ln": DistributedLayerNorm(P, (3, 5), dtype=torch.float64),
                "lnz": DistributedLayerNormZero(P, 5, dtype=torch.float64),
                "rmsz": DistributedRMSNormZero(P, (3, 5), dtype=torch.float64),
                "emb": DistributedEmbedding(Pe, 9, 4, padding_idx=2, dtype=torch.float64),
                "embz": DistributedEmbeddingZero(Pe, 9, 4, dtype=torch.float64)}

    a, b, loaded, sd2, same = global_checkpoint_roundtrip(build, path)
    out = {"same_local": same}
    if world.rank == 0:
        seq = {"ln": torch.nn.LayerNorm((3, 5), dtype=torch.float64),
               "lnz": torch.nn.LayerNorm(5, dtype=torch.float64),
               "rmsz": torch.nn.RMSNorm((3, 5), dtype=torch.float64),
               "emb": torch.nn.Embedding(9, 4, padding_idx=2, dtype=torch.float64),
               "embz": torch.nn.Embedding(9, 4, dtype=torch.float64)}
        for k, m in seq.items():
            m.load_state_dict(loaded[k])  # strict: every key, every shape
            out[k] = all(torch.equal(v, sd2[k][n]) for n, v in m.state_dict().items())
            out[k + ".changed"] = not torch.equal(m.weight, torch.ones_like(m.weight))
    # per-rank state dicts carry the layout: a ZeRO one does not load into another rank's
    other = b["lnz"].state_dict() if world.rank == 1 else None
    objs = [None] * world.size
    import torch.distributed as dist
    if dist.is_initialized():
        dist.all_gather_object(objs, other)
        if world.rank == 0:
            try:
                b["lnz"].load_state_dict(objs[1])
                out["refused"] = False
            except Exception as e:  # noqa: BLE001
                out["refused"] = "saved by rank 1" in str(e)
    return out


def test_global_state_dict_roundtrip(cluster, tmp_path):
    res = cluster.run(4, _roundtrip, str(tmp_path / "ckpt.pt"))
    assert all(r["same_local"] for r in res)
    root = res[0]
    for k in ("ln", "lnz", "rmsz", "emb", "embz"):
        assert root[k] and root[k + ".changed"], (k, root)
    assert root["refused"] is True


# ------------------------------------------------------------------ errors
def _bad(which):
    if which == "norm_dims":
        DistributedLayerNorm(Partition.grid((2, 2)), (2, 3, 4))
    elif which == "norm_split":
        DistributedLayerNormZero(Partition.grid((1, 4)), 3)
    elif which == "norm_input":
        P = Partition.grid((2, 2))
        layer = DistributedRMSNormZero(P, 6)
        layer(DistTensor.from_local(block_of(global_tensor((4, 5)).float(), P), P, (4, 5)))
    elif which == "emb_partition":
        DistributedEmbedding(Partition.grid((2, 2)), 10, 4)
    elif which == "emb_sparse":
        DistributedEmbeddingZero(Partition.grid((2, 2, 1)), 10, 4, sparse=True)
    elif which == "emb_padding":
        DistributedEmbedding(Partition.grid((2, 2, 1)), 10, 4, padding_idx=10)
    elif which == "emb_float_indices":
        P = Partition.grid((2, 2, 1))
        emb = DistributedEmbedding(P, 10, 4)
        emb(DistTensor.from_local(block_of(global_tensor((6,)), emb.P_x), emb.P_x, (6,)))
    elif which == "transpose_ranks":
        DistributedTranspose(Partition([0, 1], (2, 1)), Partition([2, 3], (1, 2)))
    elif which == "transpose_input":
        P = Partition.grid((4, 1))
        tr = DistributedTranspose(P, transposed_partition(P, 0, 1))
        Q = P.reshape((2, 2))  # a well-formed tensor over another partition
        tr(DistTensor.from_local(block_of(global_tensor((3, 4)), Q), Q, (3, 4)))


@pytest.mark.parametrize("which,err,text", [
    ("norm_dims", "PartitionError", "has 3 dimensions"),
    ("norm_split", "PartitionError", "fewer than the 4 workers"),
    ("norm_input", "ShapeError", "normalized_shape=[6]"),
    ("emb_partition", "PartitionError", "at least 3"),
    ("emb_sparse", "ValueError", "sparse=True"),
    ("emb_padding", "ValueError", "padding_idx must be within"),
    ("emb_float_indices", "ShapeError", "int64/int32 indices"),
    ("transpose_ranks", "PartitionError", "same ranks"),
    ("transpose_input", "ShapeError", "distributed over partition"),
])
def test_errors_on_every_rank(cluster, which, err, text):
    errs = cluster.run(4, _bad, which, expect_error=True)
    assert_raised_everywhere(errs, err, text)
