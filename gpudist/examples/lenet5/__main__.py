"""``python -m gpudist.examples.lenet5``: train LeNet-5 on MNIST sequentially and
distributed, from the same initial weights, and compare losses, accuracy and time.

    python -m gpudist.examples.lenet5 --ranks 4 --epochs 10      # starts its own 4 ranks
    python -m gpudist.examples.lenet5 --ranks 4 --backend mpi    # ... under mpiexec
    torchrun --nproc-per-node 4 -m gpudist.examples.lenet5        # or joins a launcher's job
    mpiexec -n 4 python -m gpudist.examples.lenet5 --backend mpi
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .. import mnist
from ..common import DTYPES, UsageError, launch_example, positive
from .network import layout_for, supported_ranks
from .train import Config, quiet, rank_task, run_rank


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
    p.add_argument("--steps", type=positive(int), default=None,
                   help="max training steps per epoch")
    p.add_argument("--test-limit", type=positive(int), default=None,
                   help="test on the first N images")
    p.add_argument("--quick", action="store_true",
                   help="short run: 1 epoch of 10 steps, 1000 test images")
    p.add_argument("--out", default="results/lenet5", help="directory for plot and JSON")
    p.add_argument("--launcher", choices=["auto", "spawn", "env"], default="auto",
                   help="spawn: start --ranks local processes; env: join the job of "
                        "torchrun/mpiexec/srun; auto: env under a launcher, else spawn")
    p.add_argument("--timeout", type=positive(), default=120.0,
                   help="communication timeout (s)")
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


def _spawn(a: argparse.Namespace, started: float) -> int:
    """Start ``--ranks`` local ranks (forked gloo/NCCL, or mpiexec) with gpudist.launch."""
    from gpudist import launch

    n = 4 if a.ranks is None else a.ranks
    layout_for(n)
    backend = a.backend
    if backend == "auto":
        backend = "nccl" if a.device.startswith("cuda") and n > 1 else "gloo"
    if backend == "mpi" and launch.mpiexec() is None:
        raise UsageError("--backend mpi needs mpiexec (pip install mpich mpi4py)")
    kw = {"device": a.device, "comm_timeout": a.timeout}
    if backend == "gloo" and a.device.startswith("cuda"):
        backend = "gloo-spawn"  # a parent holding a CUDA context must not fork
    try:
        launch_example(rank_task, n, config_from(a), a.seq_threads or _cores(), a.out, started,
                       backend=backend, **kw)
    except launch.RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _env(a: argparse.Namespace, started: float) -> int:
    import gpudist

    torch.set_num_threads(1)
    quiet()
    w = gpudist.init(backend=a.backend, device=a.device, timeout=a.timeout)
    try:
        if a.ranks is not None and a.ranks != w.size:
            raise UsageError(f"--ranks {a.ranks} but the launcher started {w.size} ranks")
        layout_for(w.size)
        run_rank(config_from(a), a.seq_threads or _cores(), Path(a.out), started,
                 idle_mpi=True)
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
            return _spawn(a, started)
        return _env(a, started)
    except (UsageError, mnist.MNISTMissing) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
