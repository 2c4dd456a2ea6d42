"""A small distributed program that fails on one rank, run under a real launcher by
tests/test_faults.py: ``python fault_script.py CASE --backend gloo|mpi``.

Cases: ``raise`` (rank 1 raises an uncaught exception between two layers), ``exit``
(rank 1 calls ``os._exit(3)``), ``quit`` (rank 1 returns without ``gpudist.finalize()``
while its peers go on), ``ckpt`` (every rank saves its per-rank checkpoint, rank 1's file
is truncated, every rank loads its own: rank 1 fails in ``torch.load``, outside gpudist).
Every rank prints one line ``RESULT <rank> <status>`` (the others
are expected to fail with a gpudist error naming rank 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import gpudist
import gpudist.nn as gnn
from gpudist import DistTensor, Partition


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["raise", "exit", "quit", "ckpt"])
    p.add_argument("--dir", default=".")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    w = gpudist.init(backend=a.backend, device="cpu", timeout=a.timeout)
    P = Partition.grid((1, 1, w.size))
    conv = gnn.DistributedConv1d(P, 2, 2, 3, padding=1)
    x = DistTensor.from_local(torch.randn(2, 2, 4), P, (2, 2, 4 * w.size))
    y = conv(x)
    print(f"RESULT {w.rank} warm", flush=True)
    if a.case == "ckpt":
        path = os.path.join(a.dir, f"rank{w.rank}.pt")
        torch.save(conv.state_dict(), path)
        w.transport.barrier()
        if w.rank == 1:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        conv.load_state_dict(torch.load(path))
    if w.rank == 1:
        if a.case == "raise":
            raise ValueError("rank 1 gave up on purpose")
        if a.case == "exit":
            os._exit(3)
        if a.case == "quit":
            return 0  # leaves without finalize: its peers are waiting in the next layer
    for _ in range(3):
        y = conv(y)
    y.local.sum().backward()
    print(f"RESULT {w.rank} done", flush=True)
    gpudist.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
