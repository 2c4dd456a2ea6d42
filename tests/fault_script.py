"""A small distributed program that fails on one rank, run under a real launcher by
tests/test_faults.py: ``python fault_script.py CASE --backend gloo|mpi``.

Cases: ``raise`` (rank 1 raises an uncaught exception between two layers), ``exit``
(rank 1 calls ``os._exit(3)``), ``exitbwd`` (the same in backward, its peers in batch
norm's backward), ``quit`` (rank 1 returns without ``gpudist.finalize()``
while its peers go on), ``mismatch`` (rank 1 runs another collective than its peers'),
``ckpt`` (every rank saves its per-rank checkpoint, rank 1's file
is truncated, every rank loads its own: rank 1 fails in ``torch.load``, outside gpudist),
``caught`` (4 ranks; rank 3 repeats a SumReduce call with a stale spec its peers changed:
it sends its block up the sum's tree, to rank 1, and goes on, its peers find the mismatch;
every rank catches its error and exits normally, leaving that message unreceived),
``caughtring`` (3 ranks; the same with an AllSumReduce run as a ring: rank 1 repeats a
stale spec and checks while its peers' ring messages wait, unmatched, for it).
Every rank prints one line ``RESULT <rank> <status>`` (the others
are expected to fail with a gpudist error naming rank 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref

import torch

import gpudist
import gpudist.nn as gnn
from gpudist import PARTIAL, DistTensor, Partition, TensorSpec


class _Gone:
    pass


_DEAD: list = []


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=["raise", "exit", "exitbwd", "quit", "ckpt", "mismatch",
                                    "caught", "caughtring"])
    p.add_argument("--dir", default=".")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    w = gpudist.init(backend=a.backend, device="cpu", timeout=a.timeout)
    log = open(os.path.join(a.dir, f"log{w.rank}.txt"), "w")  # left open, not flushed:
    log.write("started\n")  # an error must not lose it
    _DEAD.append(weakref.proxy(_Gone()))  # a dead proxy (torch.compile leaves some): the
    # hook's scan for open files must pass over it (it raised ReferenceError there before)
    if a.case == "mismatch":  # steady state, then rank 1 runs another collective of the
        # same group: a MismatchError on every rank, uncaught (the job must end at once;
        # under torchrun it outlived the error by the backend's timeout before)
        from gpudist.primitives import AllGather, AllSumReduce

        Q = Partition.grid((w.size, 1))
        g, s = AllGather(Q, 0, 0), AllSumReduce(Q, [0])
        n = 2 * w.size + 1  # uneven blocks: the gather goes through its staging buffer
        xg = DistTensor.from_local(torch.ones(3 if w.rank == 0 else 2, 5), Q, (n, 5))
        xs = DistTensor(torch.ones(3, 5), TensorSpec(Q, (3, 5), torch.float32, "cpu",
                                                     (PARTIAL, -1)))
        for _ in range(2):
            g(xg)
            s(xs)
        s(xs) if w.rank == 1 else g(xg)
    if a.case == "caught":
        return _caught(w)
    if a.case == "caughtring":
        return _caught_ring(w)
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
    if a.case == "exitbwd":  # rank 1 vanishes in backward, while its peers are in batch
        # norm's hand-written backward (its reductions): they name rank 1
        bn = gnn.DistributedBatchNorm(P, 2)
        z = bn(conv(y))
        if w.rank == 1:
            z.local.register_hook(lambda g: os._exit(3))
        try:  # a program catching the error and leaving (no excepthook posts it)
            z.local.sum().backward()
        except gpudist.GpudistError as e:
            print(f"RESULT {w.rank} caught {type(e).__name__}: {e}", flush=True)
            sys.exit(1)
    if w.rank == 1:
        if a.case == "raise":
            # a setting made bad after init must not break the handler of the uncaught
            # error (init read it; a fuzz found the handler reading it and failing)
            os.environ["GPUDIST_EXIT_TEARDOWN_S"] = "0"
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


def _caught(w) -> int:
    from gpudist.primitives import SumReduce

    P = Partition.grid((w.size, 1))
    S = SumReduce(P, Partition([2], (1, 1)))  # the tree: 0 -> 2, 3 -> 1, 1 -> 2
    try:
        for rows in (4, 3, 3 if w.rank == 3 else 4):  # both shapes planned everywhere
            S(DistTensor(torch.ones(rows, 5), TensorSpec(P, (rows, 5), torch.float32,
                                                         "cpu", (PARTIAL, 1))))
        gpudist.finalize()
        print(f"RESULT {w.rank} missed", flush=True)
    except gpudist.GpudistError as e:
        print(f"RESULT {w.rank} caught {type(e).__name__}", flush=True)
    return 0


def _caught_ring(w) -> int:
    from gpudist.primitives import AllSumReduce, ring

    ring.RING_MIN_BYTES = 0  # (9 MiB at the shipped threshold: the same, slower)
    P = Partition.grid((w.size,))
    A = AllSumReduce(P, [0])
    big = 1 << 19
    try:
        for n in (big, big - 8, big if w.rank != 1 else big - 8):
            A(DistTensor(torch.ones(n, dtype=torch.float64),
                         TensorSpec(P, (n,), torch.float64, "cpu", (PARTIAL,))))
        gpudist.finalize()
        print(f"RESULT {w.rank} missed", flush=True)
    except gpudist.GpudistError as e:
        gpudist.finalize()
        print(f"RESULT {w.rank} caught {type(e).__name__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
