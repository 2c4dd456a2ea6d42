"""``python -m gpudist.examples.transformer``: train a small character transformer
(next-character prediction on a shipped corpus) sequentially and distributed (sequence
split over the ranks, heads and MLP features over the same ranks), from the same initial
weights, and compare the losses step by step.

    python -m gpudist.examples.transformer --ranks 4 --steps 300
    python -m gpudist.examples.transformer --ranks 2 --backend mpi --out results/transformer
"""

from __future__ import annotations

import argparse
import sys
import time

from ..common import UsageError, add_run_args, positive, run_example
from .network import CORPUS, check_layout
from .train import Config, task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpudist.examples.transformer",
        description="Train a character transformer sequentially and distributed (gpudist "
                    "sharded linear layers, layer norm and embeddings), from the same "
                    "initial weights, and compare the losses step by step.")
    p.add_argument("--ranks", type=int, default=4, help="workers to start: 1, 2 or 4 "
                   "(any count that divides --heads; default 4)")
    p.add_argument("--steps", type=int, default=300, help="Adam steps (default 300)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=32, help="characters per sequence")
    p.add_argument("--dim", type=int, default=32, help="model width (default 32)")
    p.add_argument("--heads", type=positive(int), default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=positive(), default=1e-2)
    p.add_argument("--clip", type=positive(infinite=True), default=None,
                   help="clip gradients to this norm of the whole model (default: off)")
    add_run_args(p, "transformer")
    return p.parse_args(argv)


def config_from(a: argparse.Namespace) -> Config:
    return Config(steps=a.steps, batch_size=a.batch_size, context=a.context, dim=a.dim,
                  heads=a.heads, layers=a.layers, lr=a.lr, clip=a.clip, seed=a.seed,
                  dtype=a.dtype,
                  progress=not a.no_progress)


def check(a: argparse.Namespace) -> None:
    check_layout(a.ranks, a.context, a.dim, a.heads)
    if a.context > len(CORPUS) - 2:
        raise UsageError(f"--context must be at most {len(CORPUS) - 2} (the corpus has "
                         f"{len(CORPUS)} characters), got {a.context}")
    for name in ("steps", "batch_size", "layers"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    a = parse_args(sys.argv[1:] if argv is None else argv)
    return run_example(task, a, config_from, lambda: check(a), started)


if __name__ == "__main__":
    sys.exit(main())
