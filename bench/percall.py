"""Per-call cost of a small layer step, where Python dominates: ``DistributedConv2d``
4->4 3x3 then ``DistributedMaxPool2d`` on a 2x4x16x16 block per rank, barrier before each
call, median over 600 calls of the slowest rank. Cases: ``fwd`` (no grad), ``fwd+bwd``,
and ``alternating`` (a training step, then a no-grad evaluation, in turn: each call's grad
state differs from the previous one's, so each is checked across ranks -- one metadata
exchange per layer call; the time is per pair). Compares versions of the library (the
source tree is the first argument); MPI under ``mpiexec``, gloo under ``torchrun``:

    git archive <commit> | tar -x -C /tmp/old
    .venv/bin/mpiexec -n 2 .venv/bin/python bench/percall.py /tmp/old
    .venv/bin/mpiexec -n 2 .venv/bin/python bench/percall.py .
    .venv/bin/torchrun --nproc-per-node 2 bench/percall.py /tmp/old
    .venv/bin/torchrun --nproc-per-node 2 bench/percall.py .
"""

import os
import statistics as st
import sys
import time


def main(tree: str, calls: int = 600) -> None:
    sys.path.insert(0, os.path.abspath(tree))  # the library version to time
    import torch

    import gpudist
    import gpudist.nn as gnn
    from gpudist import DistTensor, Partition

    torch.set_num_threads(1)
    mpi = "RANK" not in os.environ  # torchrun sets RANK; mpiexec does not
    w = gpudist.init(backend="mpi" if mpi else "gloo")
    if mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        barrier, gather = comm.Barrier, comm.allgather
    else:
        import torch.distributed as dist

        def barrier() -> None:
            dist.barrier()

        def gather(obj):
            out = [None] * w.size
            dist.all_gather_object(out, obj)
            return out
    P = Partition.grid((1, 1, w.size, 1))
    conv = gnn.DistributedConv2d(P, 4, 4, 3, padding=1)
    pool = gnn.DistributedMaxPool2d(P, 2)
    g = (2, 4, 16 * w.size, 16)
    x = DistTensor.from_local(torch.randn(2, 4, 16, 16), P, g)
    xg = DistTensor.from_local(torch.randn(2, 4, 16, 16).requires_grad_(), P, g)

    def fwd():
        with torch.no_grad():
            pool(conv(x))

    def step():
        pool(conv(xg)).local.sum().backward()

    def alternating():
        step()
        fwd()

    res = {}
    for name, f in (("fwd", fwd), ("fwd+bwd", step), ("alternating", alternating)):
        for _ in range(50):
            f()
        ts = []
        for _ in range(calls):
            barrier()
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        every = gather(ts)
        res[name] = st.median(max(a[i] for a in every) for i in range(len(ts))) * 1e6
    if w.rank == 0:
        print(os.path.dirname(gpudist.__file__), w.backend,
              " ".join(f"{k}={v:.0f}us" for k, v in res.items()))
    gpudist.finalize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
