"""LeNet-5 on MNIST, sequential and distributed, trained side by side from the same start.

    python -m gpudist.examples.lenet5 --ranks 4 --epochs 10      # starts its own 4 ranks
    torchrun --nproc-per-node 4 -m gpudist.examples.lenet5        # or joins a launcher's job
    mpiexec -n 4 python -m gpudist.examples.lenet5 --backend mpi

The network (28x28 inputs, C1 padded by 2 so it sees 32x32 as in LeCun et al.):

    C1 conv 1->6 5x5 pad 2, ReLU, S2 max-pool 2 | C3 conv 6->16 5x5, ReLU, S4 max-pool 2
    C5 affine 400->120, ReLU | F6 affine 120->84, ReLU | Output affine 84->10

Distributed over 4 workers (the paper's layout): the input is scattered from worker 0 over a
2x2 spatial partition of NCHW; C1..S4 run there with the convolution weights held by worker
0 only. A repartition moves the 16x5x5 features to a split over channels on workers 0 and 1,
where flattening gives each worker one contiguous half of the 400 features: exactly the
input blocks of the affine layers, whose weights are split 2x2 (blocks 60x200, 42x60 and
5x42, biases on the first column of the weight partition: workers 0 and 2). The 10 logits are
gathered to worker 0, which computes the loss. Other rank counts use the same scheme on
other grids (see :data:`LAYOUTS`).

Both networks start from the same weights (the sequential network's initial state is loaded
into the distributed one) and see the same batches, so their per-step losses agree to
round-off. The distributed training runs first on all ranks; then the other ranks leave and
worker 0 trains the sequential network alone, so neither run is slowed by the other.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import mnist

# ranks -> (spatial grid (P_h, P_w) of C1..S4, affine weight grid (P_fo, P_fi))
LAYOUTS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    1: ((1, 1), (1, 1)),
    2: ((1, 2), (1, 2)),
    4: ((2, 2), (2, 2)),
    8: ((2, 4), (2, 4)),
    16: ((4, 4), (4, 4)),
}
PARAM_LAYERS = ("c1", "c3", "c5", "f6", "out")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class UsageError(ValueError):
    """A command-line value the example cannot use (message says what works)."""


def supported_ranks() -> str:
    counts = sorted(LAYOUTS)
    return ", ".join(str(c) for c in counts[:-1]) + f" or {counts[-1]}"


def layout_for(ranks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (spatial grid, affine weight grid) for ``ranks`` workers, or a UsageError."""
    if ranks not in LAYOUTS:
        raise UsageError(
            f"the LeNet-5 example cannot run on {ranks} rank(s): it works with "
            f"{supported_ranks()} ranks (4 is the paper's 2x2 layout)"
        )
    return LAYOUTS[ranks]


# --------------------------------------------------------------------------- networks
class LeNet5(nn.Module):
    """The sequential network, from plain torch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 5, padding=2)
        self.s2 = nn.MaxPool2d(2)
        self.c3 = nn.Conv2d(6, 16, 5)
        self.s4 = nn.MaxPool2d(2)
        self.c5 = nn.Linear(16 * 5 * 5, 120)
        self.f6 = nn.Linear(120, 84)
        self.out = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.s2(F.relu(self.c1(x)))
        x = self.s4(F.relu(self.c3(x)))
        x = x.flatten(1)
        x = F.relu(self.c5(x))
        x = F.relu(self.f6(x))
        return self.out(x)


def make_sequential(seed: int, dtype: torch.dtype = torch.float64,
                    device: torch.device | str = "cpu") -> LeNet5:
    """LeNet-5 with torch's default initialization drawn from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return LeNet5().to(dtype=dtype, device=device)


class DistributedLeNet5(nn.Module):
    """LeNet-5 from gpudist layers over ``ranks`` workers (collective construction).

    ``forward`` takes the whole batch (N, 1, 28, 28) on world rank 0 and a zero-volume
    tensor elsewhere; it returns the (N, 10) logits on rank 0 and zero-volume elsewhere.
    """

    def __init__(self, ranks: int | None = None) -> None:
        super().__init__()
        import gpudist
        from gpudist import Partition
        from gpudist.nn import DistributedConv2d, DistributedLinear, DistributedMaxPool2d
        from gpudist.primitives import Repartition

        w = gpudist.world()
        ranks = w.size if ranks is None else ranks
        if ranks != w.size:
            raise UsageError(f"DistributedLeNet5 for {ranks} ranks in a world of {w.size}")
        (ph, pw), (pfo, pfi) = layout_for(ranks)
        self.layout = ((ph, pw), (pfo, pfi))
        # every rank builds the same partitions in the same order
        self.P_root4 = Partition.root(4, 0)
        self.P_conv = Partition.grid((1, 1, ph, pw))
        self.P_flat = Partition(list(range(pfi)), (1, pfi, 1, 1))  # channel split
        self.P_in = Partition(list(range(pfi)), (1, pfi))  # affine input features
        self.P_w = Partition.grid((pfo, pfi))  # affine weight blocks
        self.P_out = Partition(list(range(pfo)), (1, pfo))  # affine output features
        self.P_root2 = Partition.root(2, 0)

        self.scatter = Repartition(self.P_root4, self.P_conv)
        self.c1 = DistributedConv2d(self.P_conv, 1, 6, 5, padding=2)
        self.s2 = DistributedMaxPool2d(self.P_conv, 2)
        self.c3 = DistributedConv2d(self.P_conv, 6, 16, 5)
        self.s4 = DistributedMaxPool2d(self.P_conv, 2)
        # 16 channels over P_fi workers: each gets 16/P_fi whole 5x5 maps, i.e. the
        # contiguous block of 400/P_fi flattened features that P_in assigns it
        self.to_features = Repartition(self.P_conv, self.P_flat)
        self.c5 = DistributedLinear(self.P_in, self.P_out, self.P_w, 400, 120)
        self.t5 = Repartition(self.P_out, self.P_in)  # identity when P_fo == P_fi
        self.f6 = DistributedLinear(self.P_in, self.P_out, self.P_w, 120, 84)
        self.t6 = Repartition(self.P_out, self.P_in)
        self.out = DistributedLinear(self.P_in, self.P_out, self.P_w, 84, 10)
        self.gather = Repartition(self.P_out, self.P_root2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scatter(x)
        x = self.s2(F.relu(self.c1(x)))
        x = self.s4(F.relu(self.c3(x)))
        x = self.to_features(x).flatten(1)
        x = self.t5(F.relu(self.c5(x)))
        x = self.t6(F.relu(self.f6(x)))
        return self.gather(self.out(x))

    def load_from(self, seq: LeNet5) -> None:
        """Take the sequential network's parameters (every rank passes the same ones)."""
        for name in PARAM_LAYERS:
            getattr(self, name).load_global_state_dict(getattr(seq, name).state_dict())

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full parameters (sequential names) on rank 0, {} elsewhere."""
        out: dict[str, torch.Tensor] = {}
        for name in PARAM_LAYERS:
            for k, v in getattr(self, name).global_state_dict().items():
                out[f"{name}.{k}"] = v
        return out


def make_distributed(seq: LeNet5, dtype: torch.dtype, device: torch.device | str
                     ) -> DistributedLeNet5:
    net = DistributedLeNet5().to(dtype=dtype, device=device)
    net.load_from(seq)
    return net.to(dtype=dtype, device=device)


# --------------------------------------------------------------------------- training
def sequential_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                    t: torch.Tensor) -> float:
    loss = F.cross_entropy(net(x), t)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def distributed_step(net: DistributedLeNet5, opt: torch.optim.Optimizer, x: torch.Tensor,
                     t: torch.Tensor | None) -> float:
    """One step on every rank: ``x``/``t`` on rank 0 (zero-volume ``x`` and None elsewhere).

    Every rank calls backward: rank 0 on the loss, the others on the (zero) sum of their
    zero-volume logits, which drives their part of the adjoint communication.
    """
    y = net(x)
    loss = F.cross_entropy(y, t) if t is not None else y.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item() if t is not None else math.nan


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor | None, t: torch.Tensor | None, n: int,
             batch: int, blank: torch.Tensor) -> float:
    """Test accuracy (%) over ``n`` images; collective for the distributed network (data
    on rank 0, ``x is None`` elsewhere). Keeps the last partial batch."""
    net.eval()
    correct = 0
    for idx in mnist.batch_indices(n, batch, drop_last=False):
        if x is None:
            net(blank)
            continue
        i = torch.from_numpy(idx)
        y = net(x[i])
        correct += int((y.argmax(1) == t[i]).sum())
    net.train()
    return 100.0 * correct / n


@dataclass
class History:
    """One training run of one network (kept on rank 0)."""

    step_loss: list[float] = field(default_factory=list)
    epoch_loss: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)


@dataclass
class Config:
    epochs: int = 10
    batch_size: int = 256
    seed: int = 0
    trials: int = 1
    dtype: str = "float64"
    device: str = "cpu"
    steps: int | None = None  # max training steps per epoch (None: all full batches)
    test_limit: int | None = None  # first N test images (None: all 10,000)
    progress: bool = True

    @property
    def n_train(self) -> int:
        n = mnist.SIZES["train"]
        if self.steps is not None:
            n = min(n, self.steps * self.batch_size)
        return n

    @property
    def n_test(self) -> int:
        return min(mnist.SIZES["test"], self.test_limit or mnist.SIZES["test"])

    def steps_per_epoch(self) -> int:
        return len(mnist.batch_indices(self.n_train, self.batch_size))


@dataclass
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_data(cfg: Config, raw: dict | None = None) -> Data:
    dt = DTYPES[cfg.dtype]
    parts = []
    for split, n in (("train", mnist.SIZES["train"]), ("test", cfg.n_test)):
        images, labels = raw[split] if raw is not None else mnist.load_raw(split)
        x = mnist.normalize(images[:n], dt).to(cfg.device)
        parts += [x, torch.from_numpy(labels[:n].astype(np.int64)).to(cfg.device)]
    return Data(*parts)


def _bar(show: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not show, unit="step",
                dynamic_ncols=True, mininterval=0.5, file=sys.stderr)


def train(cfg: Config, trial: int, net: nn.Module, step_fn, data: Data | None,
          blank: torch.Tensor, label: str) -> History:
    """Train ``net`` for ``cfg.epochs``; ``data`` is None on ranks other than 0."""
    seed = cfg.seed + trial
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    hist = History()
    steps = cfg.steps_per_epoch()
    for epoch in range(cfg.epochs):
        batches = mnist.batch_indices(cfg.n_train, cfg.batch_size, seed=seed, epoch=epoch)
        bar = _bar(cfg.progress and data is not None, steps,
                   f"{label} trial {trial + 1}/{cfg.trials} epoch {epoch + 1}/{cfg.epochs}")
        losses = []
        t0 = time.perf_counter()
        for k, idx in enumerate(batches):
            if data is not None:
                i = torch.from_numpy(idx).to(data.x_train.device)
                losses.append(step_fn(net, opt, data.x_train[i], data.y_train[i]))
            else:
                step_fn(net, opt, blank, None)
            bar.update(1)
            if data is not None and (k % 10 == 0 or k == steps - 1):
                el = time.perf_counter() - t0
                bar.set_postfix(loss=f"{losses[-1]:.4f}",
                                img_s=f"{(k + 1) * cfg.batch_size / max(el, 1e-9):.0f}")
        hist.epoch_seconds.append(time.perf_counter() - t0)
        bar.close()
        t1 = time.perf_counter()
        if data is not None:
            acc = accuracy(net, data.x_test, data.y_test, cfg.n_test, cfg.batch_size, blank)
            hist.step_loss += losses
            hist.epoch_loss.append(float(np.mean(losses)))
            hist.test_accuracy.append(acc)
        else:
            accuracy(net, None, None, cfg.n_test, cfg.batch_size, blank)
        hist.eval_seconds.append(time.perf_counter() - t1)
    return hist


def run_rank(cfg: Config, raw: dict | None, seq_threads: int, out_dir: Path,
             started: float) -> dict | None:
    """Everything one rank does after ``gpudist.init``; returns the results on rank 0."""
    import gpudist

    w = gpudist.world()
    layout_for(w.size)
    dt = DTYPES[cfg.dtype]
    dev = torch.device(cfg.device)
    rank0 = w.rank == 0
    data = load_data(cfg, raw) if rank0 else None
    blank = torch.zeros((0, 0, 0, 0), dtype=dt, device=dev)

    dist_hist, dist_final = [], []
    for trial in range(cfg.trials):
        seq0 = make_sequential(cfg.seed + trial, dt, dev)
        net = make_distributed(seq0, dt, dev)
        dist_hist.append(train(cfg, trial, net, distributed_step, data, blank,
                               f"distributed ({w.size} ranks)"))
        sd = net.global_state_dict()
        dist_final.append({k: v.detach().cpu() for k, v in sd.items()})
    backend = w.backend
    gpudist.finalize()  # the other ranks are done; rank 0 trains the sequential network alone
    if not rank0:
        if backend == "mpi":
            _idle_barrier()
        return None

    if seq_threads > 0:
        torch.set_num_threads(seq_threads)
    seq_hist, weight_diff = [], []
    for trial in range(cfg.trials):
        seq = make_sequential(cfg.seed + trial, dt, dev)
        seq_hist.append(train(cfg, trial, seq, sequential_step, data, blank, "sequential"))
        sd = seq.state_dict()
        weight_diff.append(max(float((sd[k].detach().cpu() - v).abs().max())
                               for k, v in dist_final[trial].items()))
    res = report(cfg, w.size, backend, seq_hist, dist_hist, weight_diff, seq_threads,
                 out_dir, started)
    print(json.dumps(res), flush=True)  # the last line: machine-readable results
    if backend == "mpi":
        _idle_barrier()
    return res


def _idle_barrier() -> None:
    """MPI ranks that are done wait here, sleeping, until rank 0 is done too.

    Without it they would sit in MPI_Finalize at exit, which polls and would take the
    CPU away from rank 0's sequential run (and from its timing).
    """
    from mpi4py import MPI

    req = MPI.COMM_WORLD.Ibarrier()
    while not req.Test():
        time.sleep(0.02)


# --------------------------------------------------------------------------- reporting
def _mean(v):
    return float(np.mean(v)) if len(v) else math.nan


def report(cfg: Config, ranks: int, backend: str, seq: list[History], dist: list[History],
           weight_diff: list[float], seq_threads: int, out_dir: Path, started: float) -> dict:
    loss_diff = [float(np.max(np.abs(np.subtract(s.step_loss, d.step_loss))))
                 if s.step_loss else 0.0 for s, d in zip(seq, dist)]
    acc_s = [h.test_accuracy[-1] for h in seq]
    acc_d = [h.test_accuracy[-1] for h in dist]
    # time per epoch: training only, every epoch of every trial
    tpe_s = _mean([t for h in seq for t in h.epoch_seconds])
    tpe_d = _mean([t for h in dist for t in h.epoch_seconds])
    res = {
        "sequential_accuracy": _mean(acc_s),
        "distributed_accuracy": _mean(acc_d),
        "max_abs_loss_diff": max(loss_diff),
        "max_abs_weight_diff": max(weight_diff),
        "epochs": cfg.epochs,
        "trials": cfg.trials,
        "steps_per_epoch": cfg.steps_per_epoch(),
        "batch_size": cfg.batch_size,
        "test_images": cfg.n_test,
        "ranks": ranks,
        "backend": backend,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "sequential_seconds_per_epoch": tpe_s,
        "distributed_seconds_per_epoch": tpe_d,
        "sequential_final_loss": _mean([h.epoch_loss[-1] for h in seq]),
        "distributed_final_loss": _mean([h.epoch_loss[-1] for h in dist]),
        "sequential_accuracy_trials": acc_s,
        "distributed_accuracy_trials": acc_d,
        "sequential_threads": seq_threads,
        "seconds": time.perf_counter() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = out_dir / "lenet5.png"
    try:
        make_plot(seq[0], dist[0], cfg, ranks, plot)
        res["plot"] = str(plot)
    except ImportError as e:
        print(f"(no plot: {e})", file=sys.stderr)
        res["plot"] = None
    (out_dir / "lenet5.json").write_text(json.dumps(
        {**res, "sequential": [asdict(h) for h in seq],
         "distributed": [asdict(h) for h in dist]}, indent=1))

    n_steps = sum(len(h.step_loss) for h in seq)
    threads = f"{seq_threads} thread(s)" if seq_threads > 0 else "torch default threads"
    rows = [
        ("test accuracy (%)", f"{res['sequential_accuracy']:.2f}",
         f"{res['distributed_accuracy']:.2f}"),
        ("final epoch train loss", f"{res['sequential_final_loss']:.5f}",
         f"{res['distributed_final_loss']:.5f}"),
        ("train time / epoch (s)", f"{tpe_s:.2f}", f"{tpe_d:.2f}"),
        ("test time / epoch (s)", f"{_mean([t for h in seq for t in h.eval_seconds]):.2f}",
         f"{_mean([t for h in dist for t in h.eval_seconds]):.2f}"),
    ]
    head = ("", "sequential", f"distributed ({ranks} ranks)")
    wid = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    print(f"\nLeNet-5 / MNIST: {cfg.epochs} epoch(s) x {cfg.steps_per_epoch()} steps of "
          f"{cfg.batch_size}, {cfg.trials} trial(s), {cfg.dtype} on {cfg.device}, backend "
          f"{backend}; test set: {cfg.n_test} images")
    for r in [head, *rows]:
        print(f"  {r[0]:<{wid[0]}}   {r[1]:>{wid[1]}}   {r[2]:>{wid[2]}}")
    print(f"  largest |loss difference| over {n_steps} steps: {res['max_abs_loss_diff']:.3g}; "
          f"largest |final weight difference|: {res['max_abs_weight_diff']:.3g}")
    print(f"  (distributed: {ranks} processes x 1 thread; sequential: 1 process, {threads})")
    if res["plot"]:
        print(f"plot: {res['plot']}")
    print(f"details: {out_dir / 'lenet5.json'}")
    return res


def make_plot(seq: History, dist: History, cfg: Config, ranks: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = np.arange(1, len(seq.step_loss) + 1)
    spe = cfg.steps_per_epoch()
    ep = np.arange(1, len(seq.epoch_loss) + 1)
    ax[0].plot(steps, seq.step_loss, lw=2.2, alpha=0.6, label="sequential")
    ax[0].plot(steps, dist.step_loss, lw=0.9, ls="--", label=f"distributed ({ranks} ranks)")
    ax[0].plot(ep * spe, seq.epoch_loss, "o", ms=7, mfc="none", color="C0",
               label="sequential, epoch mean")
    ax[0].plot(ep * spe, dist.epoch_loss, "x", ms=6, color="C1",
               label="distributed, epoch mean")
    ax[0].set(xlabel="training step", ylabel="cross-entropy loss", yscale="log",
              title="training loss")
    ax[0].legend(fontsize=8)
    ax[1].plot(ep, seq.test_accuracy, "o-", lw=2.2, alpha=0.6, label="sequential")
    ax[1].plot(ep, dist.test_accuracy, "x--", label=f"distributed ({ranks} ranks)")
    ax[1].set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    ax[1].set_xticks(ep)
    ax[1].legend(fontsize=8)
    diff = np.abs(np.subtract(seq.step_loss, dist.step_loss))
    ax[2].semilogy(steps, np.maximum(diff, 1e-18), lw=0.8)
    ax[2].set(xlabel="training step", ylabel="|loss difference| (0 drawn at 1e-18)",
              title=f"sequential vs distributed ({cfg.dtype})")
    fig.suptitle(f"LeNet-5 on MNIST, batch {cfg.batch_size}, Adam lr 1e-3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- launching
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpudist.examples.lenet5",
        description="Train LeNet-5 on MNIST sequentially and distributed (gpudist), from the "
                    "same initial weights, and compare losses, accuracy and time.")
    p.add_argument("--epochs", type=int, default=None, help="epochs (paper: 10; default 10)")
    p.add_argument("--batch-size", type=int, default=256, help="training batch (default 256)")
    p.add_argument("--ranks", type=int, default=None,
                   help=f"workers to start ({supported_ranks()}; default 4); under a "
                        "launcher the launcher's world size is used")
    p.add_argument("--backend", choices=["auto", "gloo", "mpi", "nccl"], default="auto")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64",
                   help="float64 (default) keeps the two runs equal to ~1e-12 over many "
                        "steps; float32 is faster but lets round-off grow over training")
    p.add_argument("--seed", type=int, default=0, help="trial t uses seed + t")
    p.add_argument("--trials", type=int, default=1, help="trainings to average (paper: 50)")
    p.add_argument("--steps", type=int, default=None, help="max training steps per epoch")
    p.add_argument("--test-limit", type=int, default=None, help="test on the first N images")
    p.add_argument("--quick", action="store_true",
                   help="short run: 1 epoch of 10 steps, 1000 test images")
    p.add_argument("--out", default="results/lenet5", help="directory for plot and JSON")
    p.add_argument("--launcher", choices=["auto", "spawn", "env"], default="auto",
                   help="spawn: start --ranks local processes; env: join the job of "
                        "torchrun/mpiexec/srun; auto: env under a launcher, else spawn")
    p.add_argument("--timeout", type=float, default=120.0, help="communication timeout (s)")
    p.add_argument("--seq-threads", type=int, default=0,
                   help="torch threads of the sequential run (0: all CPU cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    if a.quick:
        a.epochs = 1 if a.epochs is None else a.epochs
        a.steps = 10 if a.steps is None else a.steps
        a.test_limit = 1000 if a.test_limit is None else a.test_limit
    if a.epochs is None:
        a.epochs = 10
    for name in ("epochs", "batch_size", "trials"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return a


def config_from(a: argparse.Namespace) -> Config:
    return Config(epochs=a.epochs, batch_size=a.batch_size, seed=a.seed, trials=a.trials,
                  dtype=a.dtype, device=a.device, steps=a.steps, test_limit=a.test_limit,
                  progress=not a.no_progress)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _quiet() -> None:
    # torch.distributed deprecation notices, once per rank, are noise in a demo
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def _rank_entry(rank: int, size: int, backend: str, store_path: str, a, raw,
                started: float) -> None:
    """A forked rank: join through the FileStore, run, exit without running atexit."""
    code = 0
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        _quiet()
        import torch.distributed as dist

        import gpudist
        from gpudist import runtime

        runtime._WORLD = None
        store = dist.FileStore(store_path, size)
        gpudist.init(backend=backend, device=a.device, timeout=a.timeout, rank=rank,
                     world_size=size, store=store)
        run_rank(config_from(a), raw, a.seq_threads or _cores(), Path(a.out), started)
        sys.stdout.flush()
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        import traceback

        print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr)
        if not isinstance(e, UsageError):
            traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _spawn(a: argparse.Namespace, argv: list[str], started: float) -> int:
    n = 4 if a.ranks is None else a.ranks
    layout_for(n)
    backend = a.backend
    if backend == "auto":
        backend = "nccl" if a.device.startswith("cuda") and n > 1 else "gloo"
    if backend == "mpi":  # MPI ranks cannot be forked: run ourselves under mpiexec
        exe = Path(sys.executable).parent / "mpiexec"
        exe = str(exe) if exe.exists() else shutil.which("mpiexec")
        if exe is None:
            raise UsageError("--backend mpi needs mpiexec (pip install mpich mpi4py)")
        cmd = [exe, "-n", str(n), sys.executable, "-m", "gpudist.examples.lenet5", *argv,
               "--launcher", "env"]
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    # load the data once here (NumPy only: no torch threads before fork); ranks inherit it
    raw = {"train": mnist.load_raw("train"), "test": mnist.load_raw("test")}
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="gpudist-lenet5-")
    procs = []
    try:
        for r in range(n):
            p = ctx.Process(target=_rank_entry,
                            args=(r, n, backend, os.path.join(tmp, "store"), a, raw, started))
            p.start()
            procs.append(p)
        live = {p.sentinel: p for p in procs}
        code = 0
        while live:
            for s in mp_wait(list(live)):
                p = live.pop(s)
                p.join()
                if p.exitcode != 0 and code == 0:
                    code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                    for q in live.values():  # one rank failed: the others would only hang
                        q.kill()
        return code
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                p.kill()
        return 130
    finally:
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _env(a: argparse.Namespace, started: float) -> int:
    import gpudist

    torch.set_num_threads(1)
    _quiet()
    w = gpudist.init(backend=a.backend, device=a.device, timeout=a.timeout)
    try:
        if a.ranks is not None and a.ranks != w.size:
            raise UsageError(f"--ranks {a.ranks} but the launcher started {w.size} ranks")
        layout_for(w.size)
        run_rank(config_from(a), None, a.seq_threads or _cores(), Path(a.out), started)
    except UsageError as e:
        if w.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        gpudist.finalize()
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    launcher = a.launcher
    if launcher == "auto":
        from gpudist.runtime import detect_launch

        launcher = "env" if detect_launch().launcher != "none" else "spawn"
    try:
        if launcher == "spawn":
            layout_for(4 if a.ranks is None else a.ranks)
        mnist.check_available()
        if launcher == "spawn":
            return _spawn(a, argv, started)
        return _env(a, started)
    except (UsageError, mnist.MNISTMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
