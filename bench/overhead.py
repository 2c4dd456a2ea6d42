"""gpudist's own cost per primitive call, with the wire cut out.

Every rank replaces the MPI communicators the transport calls (every group's, the
point-to-point one) with stand-ins whose nonblocking calls return a request that
completes at its second poll (first: operators bind their prepared collectives when built
or planned), builds the cases of ``bench primitives`` (its ``_cases``) for a 64 KiB buffer
(or ``--bytes``) and runs gpudist's calls of them a few times (plans made, buffers kept): what
remains is gpudist's Python per call (spec check, numbering, buffers, the transport's
bookkeeping, one turn of the wait loop, the DistTensor out) plus torch's part of it.
Timed with ``time.thread_time`` (this thread's CPU time, so other load on the machine
does not count), the best of ``--repeats`` loops of ``--calls`` calls, per rank: ``fwd``
and ``fwd+adj`` as that bench calls them (the latter with autograd's engine). Compares
versions of the library (the source tree is the first argument):

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
    """Every data communicator, the world's and those made from now on, a stand-in (the
    metadata communicators stay real: the first calls' checks run). Called before the
    cases are built: operators bind their prepared collectives to a group's handle when
    they are built or planned (``Transport.prepare``)."""
    tr = world.transport
    for g in tr._groups.values():
        object.__setattr__(g, "handle", _Comm())
    tr.p2p_comm = _Comm()
    tr.MPI = _MPI(tr.MPI)
    make = tr._make_group

    def stand_in(key):
        handle, meta = make(key)
        return (None if handle is None else _Comm()), meta
    tr._make_group = stand_in


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
    from bench.primitives import PRIMS, _cases  # (the bench of that tree)

    torch.set_num_threads(1)
    w = gpudist.init(backend="mpi")
    from mpi4py import MPI

    # gpudist's two calls of each case of ``bench primitives`` (the packed Repartition's is
    # the Repartition's): forward, and forward + adjoint
    cut_the_wire(w)
    todo = [(p, _cases(p, a.bytes, w, True)[0][:2]) for p in PRIMS if p != "repartition_pack"]
    for _, calls in todo:  # first calls: plans made (checked over the real metadata
        for f in calls:  # communicators), buffers kept
            for _ in range(3):
                f()
    rows = []
    for name, calls in todo:
        for mode, f in zip(("fwd", "fwd+adj"), calls):
            best = float("inf")
            for _ in range(a.repeats):
                t = time.thread_time()
                for _ in range(a.calls):
                    f()
                best = min(best, (time.thread_time() - t) / a.calls)
            rows.append((name, mode, best * 1e6))
    every = MPI.COMM_WORLD.gather(rows)
    if w.rank == 0:
        print(f"# us per call, CPU time of the calling thread, {a.bytes} bytes, "
              f"{w.size} ranks; columns: rank 0..{w.size - 1}")
        for i, (name, mode, _) in enumerate(rows):
            print(f"{name:14s} {mode:8s}" + "".join(f" {r[i][2]:9.2f}" for r in every))
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()  # (a rank leaving first can get rank 0 killed before it prints)
    os._exit(0)  # the communicators were replaced: no orderly MPI teardown


if __name__ == "__main__":
    main()
