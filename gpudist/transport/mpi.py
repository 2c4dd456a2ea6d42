"""Transport over mpi4py.

CPU tensors are passed to MPI as NumPy views (no copy). CUDA tensors go straight to MPI
when it is CUDA-aware (through ``__cuda_array_interface__``) and are staged through host
otherwise. Every wait polls with a deadline, so a missing peer raises instead of hanging.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from ..errors import CommTimeout, DeviceError
from .base import P2P, Group, Transport, Work


def _mpi():
    from mpi4py import MPI

    return MPI


def cuda_aware() -> bool:
    """Whether the MPI library accepts device pointers (env GPUDIST_MPI_CUDA_AWARE overrides)."""
    env = os.environ.get("GPUDIST_MPI_CUDA_AWARE")
    if env is not None:
        return env not in ("0", "false", "no", "")
    MPI = _mpi()
    q = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(q()) if q else False
    except Exception:  # pragma: no cover - library without MPIX extension
        return False


class MPITransport(Transport):
    """``MPI.COMM_WORLD`` (or a given communicator) as a transport."""

    def __init__(self, comm=None, timeout: float = 120.0) -> None:
        MPI = _mpi()
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.size, self.timeout = self.comm.Get_rank(), self.comm.Get_size(), timeout
        self.cuda_aware = cuda_aware()
        self.name = "mpi4py" + ("/cuda-aware" if self.cuda_aware else "")
        self._groups: dict[tuple[int, ...], Group] = {}
        self._poll_sleep = float(os.environ.get("GPUDIST_MPI_POLL_SLEEP", "0"))

    # -- buffers ------------------------------------------------------------
    def _buf(self, t: torch.Tensor, typed: bool):
        """(MPI buffer spec, host copy or None) for a contiguous tensor."""
        if not t.is_contiguous():
            raise DeviceError("transport buffers must be contiguous")
        host = None
        if t.is_cuda:
            if self.cuda_aware:
                torch.cuda.current_stream(t.device).synchronize()
                arr = t if typed else t.view(torch.uint8)
                return [arr, self._mpi_type(t.dtype) if typed else self.MPI.BYTE], None
            host = t.detach().cpu()
            t = host
        if typed:
            return [t.numpy(), self._mpi_type(t.dtype)], host
        return [t.view(torch.uint8).numpy(), self.MPI.BYTE], host

    def _mpi_type(self, dtype: torch.dtype):
        M = self.MPI
        table = {
            torch.float64: M.DOUBLE, torch.float32: M.FLOAT, torch.int64: M.INT64_T,
            torch.int32: M.INT32_T, torch.int16: M.INT16_T, torch.int8: M.INT8_T,
            torch.uint8: M.UINT8_T, torch.complex128: M.C_DOUBLE_COMPLEX,
            torch.complex64: M.C_FLOAT_COMPLEX, torch.bool: M.C_BOOL,
        }
        if dtype not in table:
            raise DeviceError(f"MPI transport cannot reduce dtype {dtype}")
        return table[dtype]

    def _work(self, req, what: str, orig: torch.Tensor | None = None, host=None) -> Work:
        def wait(timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not req.Test():
                if time.monotonic() > deadline:
                    raise CommTimeout(f"MPI {what} did not complete within {timeout:.1f}s")
                time.sleep(self._poll_sleep)

        after = None
        if orig is not None and host is not None:
            def after() -> None:
                orig.copy_(host)
        return Work(wait, what, after)

    # -- interface ----------------------------------------------------------
    def group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted({int(r) for r in ranks}))
        g = self._groups.get(key)
        if g is None:
            if key == tuple(range(self.size)):
                comm = self.comm
            else:  # world-collective: every rank calls this, in the same order
                color = 0 if self.rank in key else self.MPI.UNDEFINED
                comm = self.comm.Split(color, self.rank)
                if comm == self.MPI.COMM_NULL:
                    comm = None
            g = Group(key, comm)
            self._groups[key] = g
        return g

    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        works = []
        for o in ops:
            buf, host = self._buf(o.tensor, typed=False)
            if o.op == "send":
                req = self.comm.Isend(buf, dest=o.peer, tag=o.tag)
                works.append(self._work(req, f"send {tuple(o.tensor.shape)} to {o.peer}"))
            else:
                req = self.comm.Irecv(buf, source=o.peer, tag=o.tag)
                works.append(
                    self._work(req, f"recv {tuple(o.tensor.shape)} from {o.peer}", o.tensor, host)
                )
        return works

    def broadcast(self, tensor, src, group):
        buf, host = self._buf(tensor, typed=False)
        req = group.handle.Ibcast(buf, root=group.index(src))
        return self._work(req, f"broadcast from {src} over {group.ranks}", tensor, host)

    def reduce(self, tensor, dst, group):
        buf, host = self._buf(tensor, typed=True)
        root = group.index(dst)
        if group.index(self.rank) == root:
            req = group.handle.Ireduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM, root=root)
            return self._work(req, f"reduce to {dst} over {group.ranks}", tensor, host)
        req = group.handle.Ireduce(buf, None, op=self.MPI.SUM, root=root)
        return self._work(req, f"reduce to {dst} over {group.ranks}")

    def all_reduce(self, tensor, group):
        buf, host = self._buf(tensor, typed=True)
        req = group.handle.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return self._work(req, f"all-reduce over {group.ranks}", tensor, host)

    def all_gather(self, out, tensor, group):
        ob, oh = self._buf(out, typed=False)
        ib, _ = self._buf(tensor, typed=False)
        req = group.handle.Iallgather(ib, ob)
        return self._work(req, f"all-gather over {group.ranks}", out, oh)

    def all_to_all(self, out, inp, out_splits, in_splits, group):
        ob, oh = self._buf(out, typed=False)
        ib, _ = self._buf(inp, typed=False)
        e = out.element_size()

        def displ(splits):
            d, s = [], 0
            for x in splits:
                d.append(s)
                s += x * e
            return d

        oc, ic = [x * e for x in out_splits], [x * e for x in in_splits]
        req = group.handle.Ialltoallv(
            [ib[0], (ic, displ(in_splits)), self.MPI.BYTE],
            [ob[0], (oc, displ(out_splits)), self.MPI.BYTE],
        )
        return self._work(req, f"all-to-all over {group.ranks}", out, oh)

    def barrier(self, group=None):
        comm = self.comm if group is None else group.handle
        self._work(comm.Ibarrier(), "barrier").wait(self.timeout)
