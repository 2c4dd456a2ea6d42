"""The training loop of the LeNet-5 example: both networks, the same batches, the report.

Both networks start from the same weights (the sequential network's initial state is loaded
into the distributed one) and see the same batches, so their per-step losses agree to
round-off. The distributed training runs first on all ranks; then the other ranks leave and
worker 0 trains the sequential network alone, so neither run is slowed by the other.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import mnist
from ..common import DTYPES, progress_bar
from .network import DistributedLeNet5, layout_for, make_distributed, make_sequential


def sequential_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                    t: torch.Tensor, batch: int | None = None) -> float:
    loss = F.cross_entropy(net(x), t)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def distributed_step(net: DistributedLeNet5, opt: torch.optim.Optimizer, x: torch.Tensor,
                     t: torch.Tensor | None, batch: int | None = None) -> float:
    """One step on every rank: ``x``/``t`` on rank 0 (zero-volume ``x`` and None elsewhere);
    ``batch`` (the batch size, known to every rank) spares the network a metadata exchange.

    Every rank calls backward: rank 0 on the loss, the others on the (zero) sum of their
    zero-volume logits, which drives their part of the adjoint communication.
    """
    y = net(x, batch)
    loss = F.cross_entropy(y, t) if t is not None else y.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item() if t is not None else math.nan


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor | None, t: torch.Tensor | None, n: int,
             batch: int, blank: torch.Tensor, distributed: bool = False) -> float:
    """Test accuracy (%) over ``n`` images; collective for the distributed network (data
    on rank 0, ``x is None`` elsewhere). Keeps the last partial batch."""
    net.eval()
    correct = 0
    for idx in mnist.batch_indices(n, batch, drop_last=False):
        if x is None:
            net(blank, len(idx))
            continue
        i = torch.from_numpy(idx)
        y = net(x[i], len(idx)) if distributed else net(x[i])
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


def train(cfg: Config, trial: int, net: nn.Module, step_fn, data: Data | None,
          blank: torch.Tensor, label: str) -> History:
    """Train ``net`` for ``cfg.epochs``; ``data`` is None on ranks other than 0."""
    seed = cfg.seed + trial
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    hist = History()
    steps = cfg.steps_per_epoch()
    for epoch in range(cfg.epochs):
        batches = mnist.batch_indices(cfg.n_train, cfg.batch_size, seed=seed, epoch=epoch)
        bar = progress_bar(cfg.progress and data is not None, steps,
                   f"{label} trial {trial + 1}/{cfg.trials} epoch {epoch + 1}/{cfg.epochs}")
        losses = []
        t0 = time.perf_counter()
        for k, idx in enumerate(batches):
            if data is not None:
                i = torch.from_numpy(idx).to(data.x_train.device)
                losses.append(step_fn(net, opt, data.x_train[i], data.y_train[i], len(idx)))
            else:
                step_fn(net, opt, blank, None, len(idx))
            bar.update(1)
            if data is not None and (k % 10 == 0 or k == steps - 1):
                el = time.perf_counter() - t0
                bar.set_postfix(loss=f"{losses[-1]:.4f}",
                                img_s=f"{(k + 1) * cfg.batch_size / max(el, 1e-9):.0f}")
        hist.epoch_seconds.append(time.perf_counter() - t0)
        bar.close()
        t1 = time.perf_counter()
        dist = isinstance(net, DistributedLeNet5)
        if data is not None:
            acc = accuracy(net, data.x_test, data.y_test, cfg.n_test, cfg.batch_size, blank,
                           dist)
            hist.step_loss += losses
            hist.epoch_loss.append(float(np.mean(losses)))
            hist.test_accuracy.append(acc)
        else:
            accuracy(net, None, None, cfg.n_test, cfg.batch_size, blank, dist)
        hist.eval_seconds.append(time.perf_counter() - t1)
    return hist


def quiet() -> None:
    """torch.distributed deprecation notices, once per rank, are noise in a demo."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def rank_task(cfg: Config, seq_threads: int, out: str, started: float) -> dict | None:
    """One rank of a :mod:`gpudist.launch` pool (the world is already joined). Defined here,
    not in ``__main__``: an mpiexec-started rank finds it by this module's name."""
    quiet()
    return run_rank(cfg, seq_threads, Path(out), started)


def run_rank(cfg: Config, seq_threads: int, out_dir: Path, started: float,
             idle_mpi: bool = False) -> dict | None:
    """Everything one rank does after ``gpudist.init``; returns the results on rank 0.

    ``idle_mpi``: under ``mpiexec`` without a rank pool, the finished ranks wait for rank 0
    in a sleeping barrier (else MPI_Finalize would poll and slow its sequential run)."""
    import gpudist

    w = gpudist.world()
    layout_for(w.size)
    dt = DTYPES[cfg.dtype]
    dev = torch.device(cfg.device)
    rank0 = w.rank == 0
    data = load_data(cfg) if rank0 else None
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
        if backend == "mpi" and idle_mpi:
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
    if backend == "mpi" and idle_mpi:
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
