"""The FNO and transformer examples: their distributed layers equal the sequential ones
(float64, forward and all gradients), a few training steps agree, and the command lines
produce their plots and JSON results."""

import json
import subprocess
import sys

import pytest
import torch

from gpudist import DistTensor, Partition
from gpudist.examples.fno import network as fno_net
from gpudist.examples.fno import train as fno_train
from gpudist.testing import jacobian_adjoint_mismatch as jam
from tests.util import block_of, gather, global_tensor, maxerr

TOL = 1e-10


# ------------------------------------------------------------------ FNO: spectral conv
def _spectral_case(pshape, gshape, cout, modes):
    """The distributed spectral convolution against the sequential one: output, input
    gradient, weight gradients (local ones summed over the ranks), seeded init."""
    P = Partition.grid(pshape)
    b, cin, nx, ny = gshape
    torch.manual_seed(11)
    seq = fno_net.SpectralConv2d(cin, cout, *modes)
    torch.manual_seed(11)
    layer = fno_net.DistributedSpectralConv2d(P, cin, cout, *modes)
    errs = {"init": max(maxerr(layer.weights1.detach(), seq.weights1.detach()),
                        maxerr(layer.weights2.detach(), seq.weights2.detach()))}
    G = global_tensor(gshape, seed=1)
    x = block_of(G, P).requires_grad_(True)
    y = layer(DistTensor.from_local(x, P, gshape))
    Gs = G.clone().requires_grad_(True)
    Y = seq(Gs)
    oshape = (b, cout, nx, ny)
    dY = global_tensor(oshape, seed=2)
    y.local.backward(block_of(dY, P))
    Y.backward(dY)
    errs["moved"] = float(y.partition != P or tuple(y.shape) != oshape)
    yg, root = gather(y.local, P, oshape)
    dxg, _ = gather(x.grad, P, gshape)
    gsum = fno_train.GradSum(P, layer)
    gsum(torch.zeros((), dtype=torch.float64))
    if root.active:
        errs["y"] = maxerr(yg, Y.detach())
        errs["dx"] = maxerr(dxg, Gs.grad)
        errs["dw1"] = maxerr(layer.weights1.grad, seq.weights1.grad)
        errs["dw2"] = maxerr(layer.weights2.grad, seq.weights2.grad)
        errs["scale"] = float(Y.abs().max() < 1e-3 or seq.weights1.grad.abs().max() < 1e-3)
    # the Jacobian adjoint in the input (the layer is linear in it)
    errs["adjoint"] = jam(layer, DistTensor.from_local(block_of(G, P), P, gshape), eps=1.0,
                          seed=3)
    return errs


SPECTRAL_CASES = [
    # world, partition, global shape (B, Cin, X, Y), Cout, modes
    (2, (1, 1, 2, 1), (3, 4, 12, 10), 5, (3, 4)),
    (4, (1, 1, 4, 1), (2, 3, 10, 9), 2, (2, 5)),     # uneven X, odd Y, uneven ky columns
    (4, (1, 1, 4, 1), (2, 3, 8, 8), 3, (4, 3)),      # 3 ky modes on 4 ranks: one holds none
    (4, (2, 1, 2, 1), (3, 2, 9, 12), 2, (3, 4)),     # batch split too
]


@pytest.mark.parametrize("case", SPECTRAL_CASES,
                         ids=lambda c: "x".join(map(str, c[1])) + f"-{c[2][2]}x{c[2][3]}")
def test_spectral_conv_equals_sequential(cluster, case):
    n, *args = case
    res = cluster.run(n, _spectral_case, *args)
    assert {"y", "dx", "dw1", "dw2"} <= set(res[0]), res[0]
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_spectral_conv_mpi(cluster, backend):
    n, *args = SPECTRAL_CASES[0]
    res = cluster.run(n, _spectral_case, *args, backend=backend)
    assert "y" in res[0] and all(v < TOL for r in res for v in r.values()), res


def _spectral_errors():
    out = {}
    try:
        fno_net.DistributedSpectralConv2d(Partition.grid((1, 2, 1, 1)), 2, 2, 2, 2)
    except Exception as e:
        out["partition"] = (type(e).__name__, str(e))
    P = Partition.grid((1, 1, 2, 1))
    layer = fno_net.DistributedSpectralConv2d(P, 2, 2, 5, 2)  # 2 * 5 > X = 8
    G = global_tensor((1, 2, 8, 8))
    try:
        layer(DistTensor.from_local(block_of(G, P), P, G.shape))
    except Exception as e:
        out["modes"] = (type(e).__name__, str(e))
    return out


def test_spectral_conv_errors(cluster):
    res = cluster.run(2, _spectral_errors)
    for r in res:
        assert r["partition"][0] == "PartitionError" and "(P_b, 1, P_X, 1)" in r["partition"][1]
        assert r["modes"][0] == "ShapeError" and "need X >= 10" in r["modes"][1], r
    assert res[0] == res[1]


# ------------------------------------------------------------------ FNO: training
SMALL = fno_train.Config(steps=4, batch_size=4, grid=12, width=4, modes=3, layers=2,
                         hidden=6, n_train=8, n_test=2, progress=False)


def _fno_training(cfg):
    """A few Adam steps of both networks (the distributed one on every rank, the
    sequential one on rank 0); rank 0 returns (losses, losses, max weight diff, least
    parameter change)."""
    import gpudist

    w = gpudist.world()
    x, y = fno_train.poisson_data(cfg.n_train, cfg.grid, 5)
    P = Partition.grid((1, 1, w.size, 1))
    seq = fno_net.make_sequential(cfg.seed, **cfg.net_kw())
    init = {k: v.clone() for k, v in seq.state_dict().items()}
    net = fno_net.make_distributed(P, seq, **cfg.net_kw())
    dist = fno_train.train_distributed(cfg, net, x, y)
    if w.rank != 0:
        return None
    ref = fno_train.train_sequential(cfg, seq, x, y)
    sd, dsd = seq.state_dict(), net.state_dict()
    assert set(sd) == set(dsd) and any(k.startswith("spectral.1.weights2") for k in sd)
    diff = max(float((sd[k] - dsd[k]).abs().max()) for k in sd)
    moved = min(float((init[k] - sd[k]).abs().max()) for k in sd)
    return ref.step_loss, dist.step_loss, diff, moved


@pytest.mark.parametrize("n", [2, 4])
def test_fno_training_agrees(cluster, n):
    seq, dist, diff, moved = cluster.run(n, _fno_training, SMALL)[0]
    assert len(seq) == len(dist) == SMALL.steps
    assert max(abs(a - b) for a, b in zip(seq, dist)) < 1e-12, (seq, dist)
    assert diff < 1e-12 and moved > 1e-5, (diff, moved)
    assert len(set(seq)) == len(seq)  # the steps change the losses


def test_fno_cli(tmp_path):
    from gpudist.examples.fno.__main__ import main

    out = tmp_path / "fno"
    rc = main(["--ranks", "2", "--steps", "3", "--grid", "12", "--width", "4", "--modes",
               "3", "--n-train", "8", "--n-test", "2", "--batch-size", "4", "--out",
               str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "fno.json").read_text())
    assert (out / "fno.png").stat().st_size > 10_000 and res["plot"] == str(out / "fno.png")
    assert res["ranks"] == 2 and len(res["distributed_loss"]) == 3
    assert res["max_abs_loss_diff"] < 1e-12


def test_fno_cli_usage(capsys):
    from gpudist.examples.fno.__main__ import main

    assert main(["--ranks", "4", "--modes", "2"]) == 2
    assert "--modes must be at least --ranks" in capsys.readouterr().err


# ------------------------------------------------------------------ transformer: block
def _block_case(gshape, heads):
    """The distributed transformer block against the sequential one: seeded init,
    output, input gradient and every parameter gradient, gathered to rank 0."""
    import gpudist
    from gpudist.examples.transformer import network as tr_net

    m = gpudist.world().size
    P = Partition.grid((1, m, 1))
    b, s, d = gshape
    torch.manual_seed(4)
    seq = tr_net.Block(d, heads, torch.float64)
    torch.manual_seed(4)
    blk = tr_net.DistributedBlock(P, d, heads, torch.float64)
    errs = {}
    for name in tr_net.SHARDED:
        sd = getattr(blk, name).global_state_dict()
        ref = getattr(seq, name).state_dict()
        if P.world.rank == 0:
            errs[f"init.{name}"] = float(set(sd) != set(ref)) + max(
                maxerr(v, ref[k]) for k, v in sd.items())
    with torch.no_grad():  # parameters away from their initial values
        for p in seq.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype,
                                     generator=torch.Generator().manual_seed(p.numel())))
    for name in tr_net.SHARDED:
        getattr(blk, name).load_global_state_dict(getattr(seq, name).state_dict())
    G = global_tensor(gshape, seed=1)
    x = block_of(G, P).requires_grad_(True)
    y = blk(DistTensor.from_local(x, P, gshape))
    Gs = G.clone().requires_grad_(True)
    Y = seq(Gs)
    dY = global_tensor(gshape, seed=2)
    y.local.backward(block_of(dY, P))
    Y.backward(dY)
    errs["moved"] = float(y.partition != P or tuple(y.shape) != gshape)
    yg, root = gather(y.local, P, gshape)
    dxg, _ = gather(x.grad, P, gshape)
    grads = {n: getattr(blk, n).global_grads() for n in tr_net.SHARDED}
    if root.active:
        errs["y"] = maxerr(yg, Y.detach())
        errs["dx"] = maxerr(dxg, Gs.grad)
        for n in tr_net.SHARDED:
            for k, p in getattr(seq, n).named_parameters():
                errs[f"d{n}.{k}"] = maxerr(grads[n][k], p.grad)
    # the Jacobian adjoint in the input (a smooth map: central differences)
    errs["adjoint"] = jam(blk, DistTensor.from_local(block_of(G, P), P, gshape), eps=1e-5,
                          seed=3) * 1e-3  # tolerance 1e-7
    return errs


BLOCK_CASES = [(1, (2, 5, 8), 2), (2, (2, 7, 8), 2), (4, (3, 10, 16), 4)]  # uneven S


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}ranks")
def test_transformer_block_equals_sequential(cluster, case):
    n, *args = case
    res = cluster.run(n, _block_case, *args)
    assert {"y", "dx", "dfc2.bias", "dq.weight", "dln1.weight", "init.o"} <= set(res[0])
    for errs in res:
        assert all(v < TOL for v in errs.values()), errs


def test_transformer_block_mpi(cluster, backend):
    res = cluster.run(2, _block_case, (2, 7, 8), 2, backend=backend)
    assert "y" in res[0] and all(v < TOL for r in res for v in r.values()), res


# ------------------------------------------------------------------ transformer: training
def _tr_small():
    from gpudist.examples.transformer import train as tr_train

    return tr_train.Config(steps=4, batch_size=3, context=8, dim=8, heads=4, layers=1,
                           progress=False)


def _transformer_training(cfg):
    import gpudist
    from gpudist.examples.transformer import network as tr_net
    from gpudist.examples.transformer import train as tr_train

    w = gpudist.world()
    data, V = tr_train.encode(), len(tr_net.vocabulary())
    seq = tr_net.make_sequential(cfg.seed, V, cfg.context, **cfg.net_kw())
    init = {k: v.clone() for k, v in seq.state_dict().items()}
    net = tr_net.make_distributed(seq, V, cfg.context, **cfg.net_kw())
    dist = tr_train.train_distributed(cfg, net, data)
    dsd = net.global_state_dict()
    if w.rank != 0:
        return None
    ref = tr_train.train_sequential(cfg, seq, data)
    sd = seq.state_dict()
    assert set(sd) == set(dsd), sorted(set(sd) ^ set(dsd))
    diff = max(float((sd[k] - dsd[k]).abs().max()) for k in sd)
    moved = min(float((init[k] - sd[k]).abs().max()) for k in sd)
    return ref.step_loss, dist.step_loss, diff, moved


@pytest.mark.parametrize("n,clip", [(1, None), (2, None), (4, None), (4, 0.05)])
def test_transformer_training_agrees(cluster, n, clip):
    """(clip: gpudist.nn.clip_grad_norm_ on the distributed model, torch's on the
    sequential one, every step; 0.05 clips every step here)"""
    cfg = _tr_small()
    cfg.clip = clip
    seq, dist, diff, moved = cluster.run(n, _transformer_training, cfg)[0]
    assert len(seq) == len(dist) == cfg.steps
    assert max(abs(a - b) for a, b in zip(seq, dist)) < 1e-12, (seq, dist)
    assert diff < 1e-10 and moved > 1e-5, (diff, moved)
    assert len(set(seq)) == len(seq)


def test_transformer_cli(tmp_path):
    from gpudist.examples.transformer.__main__ import main

    out = tmp_path / "tr"
    rc = main(["--ranks", "2", "--steps", "3", "--context", "8", "--dim", "8", "--layers",
               "1", "--batch-size", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "transformer.json").read_text())
    assert (out / "transformer.png").stat().st_size > 10_000
    assert res["ranks"] == 2 and len(res["distributed_loss"]) == 3
    assert res["max_abs_loss_diff"] < 1e-12 and res["sample"].startswith("the workers ")


def test_transformer_cli_usage(capsys):
    from gpudist.examples.transformer.__main__ import main

    assert main(["--ranks", "3"]) == 2
    assert "4 heads to split evenly" in capsys.readouterr().err


@pytest.mark.parametrize("example,args,text", [
    ("transformer", ["--heads", "0"], "--heads: must be a positive int"),
    ("transformer", ["--lr", "-1"], "--lr: must be a positive float"),
    ("transformer", ["--clip", "-1"], "--clip: must be a positive float"),
    ("transformer", ["--context", "100000"], "--context must be at most"),
    ("fno", ["--lr", "nan"], "--lr: must be a positive float"),
    ("fno", ["--timeout", "0"], "--timeout: must be a positive float"),
    ("lenet5", ["--timeout", "-1"], "--timeout: must be a positive float"),
    ("lenet5", ["--steps", "0"], "--steps: must be a positive int"),
    ("lenet5", ["--test-limit", "0"], "--test-limit: must be a positive int"),
])
def test_example_cli_refuses_bad_values(example, args, text):
    """A usage error with exit code 2, never a traceback (fuzz-found: ZeroDivisionError for
    --heads 0, Adam's ValueError for --lr -1, a CommTimeout for --timeout 0; --clip -1
    flipped the gradients, --steps 0 trained nothing, --test-limit 0 tested everything)."""
    p = subprocess.run([sys.executable, "-m", f"gpudist.examples.{example}", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and text in p.stderr and "Traceback" not in p.stderr, p.stderr
