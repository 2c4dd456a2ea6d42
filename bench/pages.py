"""Page size and MPI's large messages: ``mpiexec -n 2 python -m bench.pages [--mib 64]``.

One ``MPI_Bcast`` from rank 0 to rank 1, root's and receiver's buffers each on 4 KiB pages
(torch's default allocation) or on transparent huge pages (a 2 MiB-aligned slice,
``madvise(MADV_HUGEPAGE)`` before first touch). Prints the median over ``--repeats`` of
the slowest rank's time for the four combinations, twice (the second round is the one to
read). What it showed on the 2-core dev machine (bench/RESULTS.md, 2026-11-27, fifth
session): the root's (the sender's) pages set the time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

MADV_HUGEPAGE = 14
HUGE = 2 << 20


def huge_pages(nbytes: int):
    """A float32 tensor of ``nbytes`` on 2 MiB-aligned memory advised as huge pages."""
    import torch

    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(raw.data_ptr() + off), ctypes.c_size_t(nbytes),
                    MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    t = raw[off:off + nbytes].view(torch.float32)
    t.uniform_()  # first touch: the kernel backs it with huge pages where it can
    return t


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pages", description=__doc__)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    nbytes = args.mib << 20
    small, big = torch.rand(nbytes // 4).clone(), huge_pages(nbytes)
    cases = {"root 4 KiB, receiver 4 KiB": (small, small),
             "root huge, receiver huge": (big, big),
             "root 4 KiB, receiver huge": (small, big),
             "root huge, receiver 4 KiB": (big, small)}
    for rnd in range(2):
        for name, (root_buf, recv_buf) in cases.items():
            buf = (root_buf if comm.rank == 0 else recv_buf).numpy()
            times = []
            for _ in range(args.repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                comm.Bcast(buf, root=0)
                times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            if comm.rank == 0:
                print(f"round {rnd + 1}, {args.mib} MiB Bcast, {name}: "
                      f"{statistics.median(times) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
