"""gpudist's own cost per primitive call, with the wire cut out.

Every rank builds the primitives of ``bench primitives`` on a 64 KiB block (or
``--bytes``), runs them for real a few times, then replaces the MPI communicators the
transport calls (every group's, the point-to-point one) with stand-ins whose nonblocking
calls return a request that completes at its second poll: what remains is gpudist's
Python per call (spec check, numbering, buffers, the transport's bookkeeping, one turn of
the wait loop, the DistTensor out) plus torch's part of it. Timed with
``time.thread_time`` (this thread's CPU time, so other load on the machine does not
count), the best of ``--repeats`` loops of ``--calls`` calls, per rank: ``fwd`` an
input that does not require grad, ``fwd+adj`` a forward recorded for backward and its
backward (autograd's engine included). Compares versions of the library (the source
tree is the first argument):

    git archive <commit> | tar -x -C /tmp/old
    .venv/bin/mpiexec -n 2 .venv/bin/python bench/overhead.py /tmp/old
    .venv/bin/mpiexec -n 2 .venv/bin/python bench/overhead.py .
"""

from __future__ import annotations

import argparse
import os
import sys
import time


class _Request:
    """A request that completes at its second poll (one turn of gpudist's wait loop)."""

    __slots__ = ("polls",)

    def __init__(self) -> None:
        self.polls = 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.polls += 1
        return self.polls >= 2

    def Start(self) -> None:  # noqa: N802
        self.polls = 0


class _Comm:
    """A communicator whose nonblocking calls do nothing and return a :class:`_Request`."""

    def __getattr__(self, name: str):
        if name.startswith("I") or name.endswith("_init"):
            return lambda *a, **k: _Request()
        raise AttributeError(name)


class _RequestNS:
    @staticmethod
    def Testall(reqs) -> bool:  # noqa: N802
        return all([r.Test() for r in reqs])


class _PrequestNS:
    @staticmethod
    def Startall(reqs) -> None:  # noqa: N802
        for r in reqs:
            r.Start()


class _MPI:
    """mpi4py's module, with ``Request.Testall`` and ``Prequest.Startall`` for stand-ins."""

    Request, Prequest = _RequestNS, _PrequestNS

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def cut_the_wire(world) -> None:
    tr = world.transport
    for g in tr._groups.values():
        object.__setattr__(g, "handle", _Comm())
    tr.p2p_comm = _Comm()
    tr.MPI = _MPI(tr.MPI)


def cases(world, nbytes: int):
    """(name, operator, input, gradient seed) of each primitive, as ``bench primitives``
    builds them."""
    import torch

    from gpudist import DistTensor, Partition
    from gpudist.primitives import (
        AllGather,
        AllSumReduce,
        Broadcast,
        ReduceScatter,
        Repartition,
        SumReduce,
    )
    from gpudist.spec import PARTIAL, TensorSpec

    n, r = world.size, world.rank
    numel = nbytes // 4
    P, root = Partition.grid((n,)), Partition.grid((1,), ranks=[0])
    empty = torch.empty(0)

    def dist(t, part, shape, placements=None):
        if placements is None:
            return DistTensor.from_local(t, part, shape)
        return DistTensor(t, TensorSpec(part, shape, torch.float32, "cpu", placements))

    m = max(1, numel // n)
    return [
        ("broadcast", Broadcast(root, P),
         dist(torch.rand(numel) if r == 0 else empty, root, (numel,)), torch.rand(numel)),
        ("sumreduce", SumReduce(P, root),
         dist(torch.rand(numel), P, (numel,), (PARTIAL,)),
         torch.rand(numel) if r == 0 else empty),
        ("allsumreduce", AllSumReduce(P, axes=(0,)),
         dist(torch.rand(numel), P, (numel,), (PARTIAL,)), torch.rand(numel)),
        ("repartition", Repartition(Partition.grid((n, 1)), Partition.grid((1, n))),
         dist(torch.rand(m, n), Partition.grid((n, 1)), (n * m, n)), torch.rand(n * m, 1)),
        ("allgather", AllGather(P, 0, 0), dist(torch.rand(m), P, (n * m,)),
         torch.rand(n * m)),
        ("reducescatter", ReduceScatter(P, 0, 0),
         dist(torch.rand(n * m), P, (n * m,), (PARTIAL,)), torch.rand(m)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", nargs="?", default=".", help="the gpudist source tree to time")
    ap.add_argument("--bytes", type=int, default=64 * 1024)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))  # the library version to time
    import torch

    import gpudist
    from gpudist import DistTensor

    torch.set_num_threads(1)
    w = gpudist.init(backend="mpi")
    from mpi4py import MPI

    todo = cases(w, a.bytes)

    def step(op, x, dy, grad):
        if not grad:  # (x does not require grad: nothing is recorded)
            return op(x)
        xg = DistTensor(x.local.detach().requires_grad_(), x.spec)
        op(xg).local.backward(dy)

    for op, x, dy in [(c[1], c[2], c[3]) for c in todo]:  # real calls first: plans made
        for grad in (False, True):
            for _ in range(3):
                step(op, x, dy, grad)
    cut_the_wire(w)
    rows = []
    for name, op, x, dy in todo:
        for grad in (False, True):
            best = float("inf")
            for _ in range(a.repeats):
                t = time.thread_time()
                for _ in range(a.calls):
                    step(op, x, dy, grad)
                best = min(best, (time.thread_time() - t) / a.calls)
            rows.append((name, "fwd+adj" if grad else "fwd", best * 1e6))
    every = MPI.COMM_WORLD.gather(rows)
    if w.rank == 0:
        print(f"# us per call, CPU time of the calling thread, {a.bytes} bytes, "
              f"{w.size} ranks; columns: rank 0..{w.size - 1}")
        for i, (name, mode, _) in enumerate(rows):
            print(f"{name:14s} {mode:8s}" + "".join(f"{r[i][2]:8.2f}" for r in every))
    sys.stdout.flush()
    os._exit(0)  # the communicators were replaced: no orderly MPI teardown


if __name__ == "__main__":
    main()
