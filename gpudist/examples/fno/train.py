"""Data, training loops, report and plot of the FNO example.

The task: learn the solution operator of the periodic Poisson equation ``-lap u = f`` on
the unit square (``f`` a random smooth field with zero mean; ``u`` solved spectrally,
``u_hat = f_hat / (4 pi^2 |k|^2)``, scaled to unit spread). The input has three channels
(``f`` and the two grid coordinates), the output one (``u``).

Both networks start from the same weights and see the same batches. The distributed run
(every rank, the grid's X dim split over the ranks, the parameters replicated, their
gradients summed by one AllSumReduce per step) goes first; then rank 0 trains the
sequential network alone, and the per-step losses are compared.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gpudist import DistTensor, Partition
from gpudist.decomposition import block_range
from gpudist.primitives import Repartition

from ..common import DTYPES, GradSum, loss_panels, save_results, train_loop
from .network import DistributedFNO2d, FNO2d, make_distributed, make_sequential


@dataclass
class Config:
    steps: int = 300
    batch_size: int = 16
    grid: int = 32
    width: int = 12
    modes: int = 6
    layers: int = 2
    hidden: int = 32
    n_train: int = 256
    n_test: int = 32
    lr: float = 3e-3
    seed: int = 0
    dtype: str = "float64"
    progress: bool = True

    def net_kw(self) -> dict:
        return {"width": self.width, "modes": self.modes, "layers": self.layers,
                "hidden": self.hidden}


@dataclass
class History:
    step_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0
    test_rel_error: float = math.nan


# --------------------------------------------------------------------------- data
def poisson_data(n: int, grid: int, seed: int, dtype: torch.dtype = torch.float64
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs (input ``(n, 3, grid, grid)``: f, x, y; target ``(n, 1, grid, grid)``:
    u) of ``-lap u = f`` on the periodic unit square; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    k = torch.fft.fftfreq(grid, 1.0 / grid, dtype=torch.float64)
    k2 = k[:, None] ** 2 + k[None, :] ** 2
    noise = torch.randn(n, grid, grid, generator=g, dtype=torch.float64)
    fh = torch.fft.fft2(noise) * (1.0 + k2 / 4.0) ** -1.5  # smooth random fields
    fh[:, 0, 0] = 0.0
    f = torch.fft.ifft2(fh).real
    f = f / f.std(dim=(1, 2), keepdim=True)
    fh = torch.fft.fft2(f)
    uh = fh / (4 * math.pi ** 2 * torch.where(k2 == 0, 1.0, k2))
    uh[:, 0, 0] = 0.0
    u = torch.fft.ifft2(uh).real
    u = u / 0.02  # order-one targets (the solutions' spread is ~0.02)
    s = torch.arange(grid, dtype=torch.float64) / grid
    gx, gy = torch.meshgrid(s, s, indexing="ij")
    x = torch.stack([f, gx.expand(n, -1, -1), gy.expand(n, -1, -1)], dim=1)
    return x.to(dtype), u[:, None].to(dtype)


def batches(cfg: Config) -> list[torch.Tensor]:
    """The index batches of every step (epochs of a seeded permutation)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    per = cfg.n_train // cfg.batch_size
    out: list[torch.Tensor] = []
    while len(out) < cfg.steps:
        perm = torch.randperm(cfg.n_train, generator=g)
        out += [perm[i * cfg.batch_size:(i + 1) * cfg.batch_size] for i in range(per)]
    return out[:cfg.steps]


def x_block(t: torch.Tensor, P_x: Partition) -> torch.Tensor:
    """This rank's block of ``t`` (batch, channels, X, Y) with X split over ``P_x``."""
    lo, hi = block_range(t.shape[2], P_x.shape[2], P_x.coords[2])
    return t[:, :, lo:hi].contiguous()


# --------------------------------------------------------------------------- steps
def sequential_step(net: FNO2d, opt: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> float:
    loss = F.mse_loss(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def distributed_step(net: DistributedFNO2d, opt: torch.optim.Optimizer, gsum: GradSum,
                     x: torch.Tensor, y: torch.Tensor, shape: tuple[int, ...]) -> float:
    """One step on every rank, on this rank's X blocks ``x``, ``y`` of the global batch
    (input ``shape``): local loss part, local backward (the transposes' adjoints are the
    only communication), gradients summed, the same Adam step everywhere."""
    pred = net(x, shape)
    loss = ((pred - y) ** 2).sum() / (shape[0] * y.shape[1] * shape[2] * shape[3])
    opt.zero_grad(set_to_none=False)
    for p in net.parameters():  # every parameter has a gradient tensor to sum
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    loss.backward()
    total = gsum(loss)
    opt.step()
    return total.item()


def train_sequential(cfg: Config, net: FNO2d, x: torch.Tensor, y: torch.Tensor) -> History:
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    losses, secs = train_loop(batches(cfg), lambda idx: sequential_step(net, opt, x[idx], y[idx]),
                              cfg.progress, "sequential")
    return History(losses, secs)


def train_distributed(cfg: Config, net: DistributedFNO2d, x: torch.Tensor,
                      y: torch.Tensor) -> History:
    """Every rank: ``x``, ``y`` are the whole data set (the same everywhere); each rank
    uses its X blocks. The history (losses summed over the ranks) on every rank."""
    P_x = net.P_x
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    gsum = GradSum(P_x, net)
    xb, yb = x_block(x, P_x), x_block(y, P_x)

    def step(idx):
        shape = (len(idx),) + tuple(x.shape[1:])
        return distributed_step(net, opt, gsum, xb[idx], yb[idx], shape)

    losses, secs = train_loop(batches(cfg), step, cfg.progress and P_x.world.rank == 0,
                              f"distributed ({P_x.size} ranks)")
    return History(losses, secs)


@torch.no_grad()
def predict_distributed(net: DistributedFNO2d, x: torch.Tensor) -> torch.Tensor | None:
    """The prediction for the whole ``x`` (the same on every rank), gathered to rank 0
    (None elsewhere). Collective."""
    P_x = net.P_x
    pred = net(x_block(x, P_x), tuple(x.shape))
    root = Partition([P_x.ranks[0]], (1, 1, 1, 1), P_x.world)
    shape = (x.shape[0], pred.shape[1], x.shape[2], x.shape[3])
    out = Repartition(P_x, root)(DistTensor.from_local(pred, P_x, shape))
    return out.local if root.active else None


def rel_error(pred: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over samples of ||pred - y|| / ||y||."""
    num = (pred - y).flatten(1).norm(dim=1)
    return float((num / y.flatten(1).norm(dim=1)).mean())


# --------------------------------------------------------------------------- one rank
def run_rank(cfg: Config, out_dir: str | Path, started: float | None = None) -> dict | None:
    """Everything one rank does (the world already joined); the results on rank 0."""
    import gpudist

    started = time.perf_counter() if started is None else started
    w = gpudist.world()
    dt = DTYPES[cfg.dtype]
    x, y = poisson_data(cfg.n_train + cfg.n_test, cfg.grid, cfg.seed + 100, dt)
    xtr, ytr, xte, yte = x[:cfg.n_train], y[:cfg.n_train], x[cfg.n_train:], y[cfg.n_train:]
    P_x = Partition.grid((1, 1, w.size, 1))
    seq0 = make_sequential(cfg.seed, dt, **cfg.net_kw())
    init = {k: v.clone() for k, v in seq0.state_dict().items()}
    net = make_distributed(P_x, seq0, dt, **cfg.net_kw())
    dist = train_distributed(cfg, net, xtr, ytr)
    dpred = predict_distributed(net, xte)
    if w.rank != 0:
        return None
    dist.test_rel_error = rel_error(dpred, yte)
    seq = make_sequential(cfg.seed, dt, **cfg.net_kw())
    seq_hist = train_sequential(cfg, seq, xtr, ytr)
    with torch.no_grad():
        spred = seq(xte)
    seq_hist.test_rel_error = rel_error(spred, yte)
    sd, dsd = seq.state_dict(), net.state_dict()
    weight_diff = max(float((sd[k] - dsd[k]).abs().max()) for k in sd)
    moved = min(float((init[k] - sd[k]).abs().max()) for k in sd)
    return report(cfg, w.size, w.backend, seq_hist, dist, weight_diff, moved,
                  (xte[0, 0], yte[0, 0], spred[0, 0], dpred[0, 0]), Path(out_dir), started)


def report(cfg: Config, ranks: int, backend: str, seq: History, dist: History,
           weight_diff: float, moved: float, sample: tuple, out_dir: Path,
           started: float) -> dict:
    diff = np.abs(np.subtract(seq.step_loss, dist.step_loss))
    res = {
        "max_abs_loss_diff": float(diff.max()),
        "max_abs_weight_diff": weight_diff,
        "least_parameter_change": moved,
        "sequential_final_loss": seq.step_loss[-1],
        "distributed_final_loss": dist.step_loss[-1],
        "sequential_test_rel_error": seq.test_rel_error,
        "distributed_test_rel_error": dist.test_rel_error,
        "sequential_seconds": seq.seconds,
        "distributed_seconds": dist.seconds,
        "ranks": ranks,
        "backend": backend,
        **{k: v for k, v in asdict(cfg).items() if k != "progress"},
        "seconds": time.perf_counter() - started,
    }
    save_results(out_dir, "fno", res, seq.step_loss, dist.step_loss,
                 lambda path: make_plot(seq, dist, cfg, ranks, sample, path))
    print(f"\nFNO / 2-D Poisson ({cfg.grid}x{cfg.grid}, width {cfg.width}, modes {cfg.modes}, "
          f"{cfg.layers} layers): {cfg.steps} Adam steps of {cfg.batch_size}, {cfg.dtype}, "
          f"{ranks} rank(s), backend {backend}")
    print(f"  final loss: sequential {res['sequential_final_loss']:.5g}, distributed "
          f"{res['distributed_final_loss']:.5g}; test relative L2 error: "
          f"{seq.test_rel_error:.4f} / {dist.test_rel_error:.4f}")
    print(f"  largest |loss difference| over {cfg.steps} steps: {res['max_abs_loss_diff']:.3g};"
          f" largest |final weight difference|: {weight_diff:.3g}")
    print(f"  train time: sequential {seq.seconds:.2f} s, distributed {dist.seconds:.2f} s")
    if res["plot"]:
        print(f"plot: {res['plot']}")
    print(f"details: {out_dir / 'fno.json'}")
    return res


def make_plot(seq: History, dist: History, cfg: Config, ranks: int, sample: tuple,
              path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 7.5))
    loss_panels(fig.add_subplot(2, 3, 1), fig.add_subplot(2, 3, 2), seq.step_loss,
                dist.step_loss, ranks, cfg.dtype, "MSE loss")
    f, u, us, ud = (t.detach().cpu().numpy() for t in sample)
    panels = [(f, "input f"), (u, "solution u of -lap u = f"),
              (us, f"sequential FNO (rel. err {seq.test_rel_error:.3f})"),
              (ud, f"distributed FNO (rel. err {dist.test_rel_error:.3f})")]
    for i, (img, title) in enumerate(panels):
        ax = fig.add_subplot(2, 3, 3 + i)
        im = ax.imshow(img, cmap="RdBu_r", origin="lower")
        ax.set(title=title, xticks=[], yticks=[])
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"Fourier neural operator, {cfg.grid}x{cfg.grid} grid split over {ranks} "
                 f"rank(s) along X; Adam lr {cfg.lr}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def task(cfg: Config, out_dir: str, started: float) -> dict | None:
    """One rank of a :mod:`gpudist.launch` pool (importable by module path)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return run_rank(cfg, out_dir, started)
