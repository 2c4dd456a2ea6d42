"""What the examples share: the data-parallel gradient sum, the training loop with its
progress bar, the loss plots and the results files."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from gpudist import PARTIAL, DistTensor, Partition, TensorSpec
from gpudist.primitives import AllSumReduce

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class GradSum:
    """The data-parallel gradient sum: every parameter's local gradient (and the local
    loss) flattened into one vector, summed over the ranks by one AllSumReduce (its
    spec known to every rank: no metadata exchange), written back."""

    def __init__(self, P_x: Partition, net: torch.nn.Module) -> None:
        self.P = Partition(P_x.ranks, (P_x.size,), P_x.world)
        self.sum = AllSumReduce(self.P, [0])
        self.params = list(net.parameters())
        self.spec: TensorSpec | None = None

    @staticmethod
    def _real(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t) if t.is_complex() else t

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients in place; returns the summed loss (0-dim)."""
        parts = [self._real(p.grad).reshape(-1) for p in self.params]
        flat = torch.cat(parts + [loss.detach().reshape(1)])
        if self.spec is None:
            self.spec = TensorSpec(self.P, (flat.numel(),), flat.dtype, flat.device.type,
                                   (PARTIAL,))
        total = self.sum(DistTensor(flat, self.spec, check=False)).local
        at = 0
        for p in self.params:
            g = self._real(p.grad)
            g.copy_(total[at:at + g.numel()].view_as(g))
            at += g.numel()
        return total[at]


def progress_bar(show: bool, total: int, desc: str):
    """A tqdm bar on stderr (disabled where ``show`` is false)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not show, unit="step", dynamic_ncols=True,
                mininterval=0.5, file=sys.stderr)


def train_loop(batches: Sequence, step: Callable[[object], float], show: bool, desc: str
               ) -> tuple[list[float], float]:
    """``step(batch)`` for every batch under a progress bar: (losses, seconds)."""
    bar = progress_bar(show, len(batches), desc)
    losses: list[float] = []
    t0 = time.perf_counter()
    for k, b in enumerate(batches):
        losses.append(step(b))
        bar.update(1)
        if k % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    seconds = time.perf_counter() - t0
    bar.close()
    return losses, seconds


def loss_panels(ax_loss, ax_diff, seq: Sequence[float], dist: Sequence[float], ranks: int,
                dtype: str, ylabel: str) -> None:
    """Both loss curves on ``ax_loss``, their difference on ``ax_diff``."""
    steps = np.arange(1, len(seq) + 1)
    ax_loss.plot(steps, seq, lw=2.2, alpha=0.6, label="sequential")
    ax_loss.plot(steps, dist, lw=0.9, ls="--", label=f"distributed ({ranks} ranks)")
    ax_loss.set(xlabel="training step", ylabel=ylabel, yscale="log", title="training loss")
    ax_loss.legend(fontsize=8)
    d = np.abs(np.subtract(seq, dist))
    ax_diff.semilogy(steps, np.maximum(d, 1e-18), lw=0.8)
    ax_diff.set(xlabel="training step", ylabel="|loss difference| (0 drawn at 1e-18)",
                title=f"sequential vs distributed ({dtype})")


def save_results(out_dir: Path, name: str, res: dict, seq: Sequence[float],
                 dist: Sequence[float], plot: Callable[[Path], None]) -> dict:
    """Write ``name.png`` (by ``plot``) and ``name.json`` (``res`` and both loss curves)
    into ``out_dir``; ``res["plot"]`` says where the plot went (None without
    matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    try:
        plot(path)
        res["plot"] = str(path)
    except ImportError as e:
        print(f"(no plot: {e})", file=sys.stderr)
        res["plot"] = None
    (out_dir / f"{name}.json").write_text(json.dumps(
        {**res, "sequential_loss": list(seq), "distributed_loss": list(dist)}, indent=1))
    return res


class UsageError(ValueError):
    """A command-line argument the example cannot run with (exit status 2)."""


def run_captured(fn: Callable, *args) -> tuple[object, str]:
    """``fn(*args)`` on a rank, and what it printed to stdout, returned instead of printed
    (see :func:`launch_example`)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = fn(*args)
    return out, buf.getvalue()


def launch_example(task: Callable, n: int, *args, backend: str, **kw) -> list:
    """``gpudist.launch.run(task, n, *args)``. Ranks started by mpiexec print through it,
    and it dropped the ranks' last output now and then as the job ended (2 cores under
    load: 1 run in 5); their stdout comes back with the results and is printed here."""
    from gpudist import launch

    if backend != "mpi":
        return launch.run(task, n, *args, backend=backend, **kw)
    res = launch.run(run_captured, n, task, *args, backend=backend, **kw)
    for _, text in res:
        if text:
            print(text, end="", flush=True)
    return [r for r, _ in res]


def run_example(task: Callable, a, make_config: Callable, check: Callable[[], None],
                started: float) -> int:
    """Start ``a.ranks`` ranks on ``a.backend`` and run ``task(config, a.out, started)`` on
    each: 0 when done, 2 for a usage error (``check`` raises :class:`UsageError`), 1 when
    a rank failed."""
    from gpudist import launch

    try:
        check()
        if a.backend == "mpi" and launch.mpiexec() is None:
            raise UsageError("--backend mpi needs mpiexec (pip install mpich mpi4py)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        launch_example(task, a.ranks, make_config(a), a.out, started, backend=a.backend,
                       comm_timeout=a.timeout)
    except launch.RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def positive(kind: type = float, infinite: bool = False):
    """An argparse type: a number above 0 (``kind`` int or float), finite unless
    ``infinite``."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or math.isnan(v) or (math.isinf(v) and not infinite) or v <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, not "
                                             f"{text!r}")
        return v

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def add_run_args(p, name: str) -> None:
    """The options every example's CLI has: backend, seed, dtype, output folder,
    communication timeout, progress bar."""
    p.add_argument("--backend", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--out", default=f"results/{name}", help="directory for plot and JSON")
    p.add_argument("--timeout", type=positive(), default=120.0,
                   help="communication timeout (s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
