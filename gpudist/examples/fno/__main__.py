"""``python -m gpudist.examples.fno``: train a small Fourier neural operator (2-D Poisson
solution operator) sequentially and distributed (the grid split along X over the ranks),
from the same initial weights, and compare the losses step by step.

    python -m gpudist.examples.fno --ranks 4 --steps 300
    python -m gpudist.examples.fno --ranks 2 --backend mpi --out results/fno
"""

from __future__ import annotations

import argparse
import sys
import time

from ..common import UsageError, add_run_args, positive, run_example
from .train import Config, task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpudist.examples.fno",
        description="Train a 2-D Fourier neural operator sequentially and distributed "
                    "(gpudist: X split over the ranks, FFTs with a distributed transpose), "
                    "from the same initial weights, and compare the losses step by step.")
    p.add_argument("--ranks", type=int, default=4, help="workers to start (default 4)")
    p.add_argument("--steps", type=int, default=300, help="Adam steps (default 300)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grid", type=int, default=32, help="grid points per side (default 32)")
    p.add_argument("--width", type=int, default=12, help="channels of the FNO layers")
    p.add_argument("--modes", type=int, default=6, help="Fourier modes kept per dim")
    p.add_argument("--layers", type=int, default=2, help="FNO layers (default 2)")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-test", type=int, default=32)
    p.add_argument("--lr", type=positive(), default=3e-3)
    add_run_args(p, "fno")
    return p.parse_args(argv)


def check(a: argparse.Namespace) -> None:
    if not 1 <= a.ranks <= a.grid:
        raise UsageError(f"--ranks must be between 1 and --grid ({a.grid}), got {a.ranks}")
    if a.modes < a.ranks or 2 * a.modes > a.grid:
        raise UsageError(f"--modes must be at least --ranks ({a.ranks}) and at most half "
                         f"the grid ({a.grid // 2}), got {a.modes}")
    for name in ("steps", "batch_size", "n_train", "n_test", "width", "layers"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if a.batch_size > a.n_train:
        raise UsageError("--batch-size must not exceed --n-train")


def config_from(a: argparse.Namespace) -> Config:
    return Config(steps=a.steps, batch_size=a.batch_size, grid=a.grid, width=a.width,
                  modes=a.modes, layers=a.layers, n_train=a.n_train, n_test=a.n_test,
                  lr=a.lr, seed=a.seed, dtype=a.dtype, progress=not a.no_progress)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    a = parse_args(sys.argv[1:] if argv is None else argv)
    return run_example(task, a, config_from, lambda: check(a), started)


if __name__ == "__main__":
    sys.exit(main())
