"""Training loops, report and plot of the transformer example (next-character prediction).

Both networks start from the same weights and see the same batches (random windows of the
corpus). The distributed run (every rank: its sequence block of each window) goes first;
then rank 0 trains the sequential network alone, and the per-step losses are compared.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gpudist.decomposition import block_range

from ...nn import clip_grad_norm_
from ..common import DTYPES, loss_panels, save_results, train_loop
from .network import (
    CORPUS,
    CharTransformer,
    DistributedCharTransformer,
    make_distributed,
    make_sequential,
    vocabulary,
)


@dataclass
class Config:
    steps: int = 300
    batch_size: int = 8
    context: int = 32
    dim: int = 32
    heads: int = 4
    layers: int = 2
    lr: float = 1e-2
    clip: float | None = None  # gradient clipping by the whole model's norm (None: off)
    seed: int = 0
    dtype: str = "float64"
    progress: bool = True

    def net_kw(self) -> dict:
        return {"dim": self.dim, "heads": self.heads, "layers": self.layers}


@dataclass
class History:
    step_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0


def encode(text: str = CORPUS) -> torch.Tensor:
    vocab = vocabulary()
    return torch.tensor([vocab.index(c) for c in text], dtype=torch.long)


def batches(cfg: Config, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-character targets) of every step: ``batch_size`` random windows of
    ``context`` characters; the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    off = torch.arange(cfg.context)
    for _ in range(cfg.steps):
        start = torch.randint(0, len(data) - cfg.context - 1, (cfg.batch_size, 1), generator=g)
        out.append((data[start + off], data[start + off + 1]))
    return out


def sequential_step(net: CharTransformer, opt: torch.optim.Optimizer, x: torch.Tensor,
                    t: torch.Tensor, clip: float | None = None) -> float:
    logits = net(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    opt.step()
    return loss.item()


def distributed_step(net: DistributedCharTransformer, opt: torch.optim.Optimizer,
                     x: torch.Tensor, t: torch.Tensor, batch: int,
                     clip: float | None = None) -> float:
    """One step on every rank with its sequence block ``x`` and the whole targets ``t``:
    the vocabulary-parallel mean cross-entropy, backward (the layers' adjoint collectives
    sum their parameter gradients), the gradients clipped by the whole model's norm
    (``clip``), an Adam step. Returns the loss (rank 0's; 0 elsewhere)."""
    loss = net.loss(net(x, batch), t)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        clip_grad_norm_(net, clip)
    opt.step()
    return loss.item()


def seq_block(t: torch.Tensor, net: DistributedCharTransformer) -> torch.Tensor:
    P = net.P_x
    lo, hi = block_range(t.shape[1], P.shape[1], P.coords[1])
    return t[:, lo:hi].contiguous()


def train_sequential(cfg: Config, net: CharTransformer, data: torch.Tensor) -> History:
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    losses, secs = train_loop(batches(cfg, data),
                              lambda b: sequential_step(net, opt, b[0], b[1], cfg.clip),
                              cfg.progress, "sequential")
    return History(losses, secs)


def train_distributed(cfg: Config, net: DistributedCharTransformer, data: torch.Tensor
                      ) -> History:
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    w = net.P_x.world

    def step(b):
        return distributed_step(net, opt, seq_block(b[0], net), b[1], cfg.batch_size,
                                cfg.clip)

    losses, secs = train_loop(batches(cfg, data), step, cfg.progress and w.rank == 0,
                              f"distributed ({w.size} ranks)")
    return History(losses, secs)


@torch.no_grad()
def generate(net: CharTransformer, prompt: str, n: int, context: int) -> str:
    """Greedy continuation of ``prompt`` by ``n`` characters."""
    vocab = vocabulary()
    idx = [vocab.index(c) for c in prompt]
    for _ in range(n):
        x = torch.tensor([idx[-context:]])
        idx.append(int(net(x)[0, -1].argmax()))
    return "".join(vocab[i] for i in idx)


def run_rank(cfg: Config, out_dir: str | Path, started: float | None = None) -> dict | None:
    """Everything one rank does (the world already joined); the results on rank 0."""
    import gpudist

    started = time.perf_counter() if started is None else started
    w = gpudist.world()
    dt = DTYPES[cfg.dtype]
    data = encode()
    V = len(vocabulary())
    seq0 = make_sequential(cfg.seed, V, cfg.context, dt, **cfg.net_kw())
    net = make_distributed(seq0, V, cfg.context, dt, **cfg.net_kw())
    dist = train_distributed(cfg, net, data)
    dsd = net.global_state_dict()
    if w.rank != 0:
        return None
    seq = make_sequential(cfg.seed, V, cfg.context, dt, **cfg.net_kw())
    init = {k: v.clone() for k, v in seq.state_dict().items()}
    seq_hist = train_sequential(cfg, seq, data)
    sd = seq.state_dict()
    if set(sd) != set(dsd):
        raise RuntimeError(f"parameter names differ: {sorted(set(sd) ^ set(dsd))}")
    weight_diff = max(float((sd[k] - dsd[k]).abs().max()) for k in sd)
    moved = min(float((init[k] - sd[k]).abs().max()) for k in sd)
    sample = generate(seq, "the workers ", 80, cfg.context)
    return report(cfg, w.size, w.backend, seq_hist, dist, weight_diff, moved, sample,
                  Path(out_dir), started)


def report(cfg: Config, ranks: int, backend: str, seq: History, dist: History,
           weight_diff: float, moved: float, sample: str, out_dir: Path,
           started: float) -> dict:
    diff = np.abs(np.subtract(seq.step_loss, dist.step_loss))
    res = {
        "max_abs_loss_diff": float(diff.max()),
        "max_abs_weight_diff": weight_diff,
        "least_parameter_change": moved,
        "sequential_final_loss": seq.step_loss[-1],
        "distributed_final_loss": dist.step_loss[-1],
        "sequential_seconds": seq.seconds,
        "distributed_seconds": dist.seconds,
        "sample": sample,
        "ranks": ranks,
        "backend": backend,
        **{k: v for k, v in asdict(cfg).items() if k != "progress"},
        "seconds": time.perf_counter() - started,
    }
    save_results(out_dir, "transformer", res, seq.step_loss, dist.step_loss,
                 lambda path: make_plot(seq, dist, cfg, ranks, path))
    print(f"\nchar transformer ({cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, context "
          f"{cfg.context}): {cfg.steps} Adam steps of {cfg.batch_size}, {cfg.dtype}, {ranks} "
          f"rank(s), backend {backend}")
    print(f"  final loss: sequential {res['sequential_final_loss']:.5g}, distributed "
          f"{res['distributed_final_loss']:.5g}")
    print(f"  largest |loss difference| over {cfg.steps} steps: {res['max_abs_loss_diff']:.3g};"
          f" largest |final weight difference|: {weight_diff:.3g}")
    print(f"  train time: sequential {seq.seconds:.2f} s, distributed {dist.seconds:.2f} s")
    print(f"  sample: {sample!r}")
    if res["plot"]:
        print(f"plot: {res['plot']}")
    print(f"details: {out_dir / 'transformer.json'}")
    return res


def make_plot(seq: History, dist: History, cfg: Config, ranks: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    loss_panels(ax[0], ax[1], seq.step_loss, dist.step_loss, ranks, cfg.dtype,
                "cross-entropy (nats / character)")
    fig.suptitle(f"character transformer, sequence split over {ranks} rank(s); Adam lr "
                 f"{cfg.lr}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def task(cfg: Config, out_dir: str, started: float) -> dict | None:
    """One rank of a :mod:`gpudist.launch` pool (importable by module path)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return run_rank(cfg, out_dir, started)
