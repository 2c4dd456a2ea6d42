"""Transport over mpi4py.

CPU tensors are handed to MPI by address (no copy). CUDA tensors go straight to MPI when
it is CUDA-aware (through ``__cuda_array_interface__``; :func:`cuda_aware`, env
``GPUDIST_MPI_CUDA_AWARE`` overrides) and through reused host buffers otherwise. Sums of
float16/bfloat16 (no MPI datatype) run in float32 buffers. Every request is polled by the
world's wait loop, so a missing peer raises instead of hanging. Batches started again and
again on the same host buffers (a halo step) are persistent requests, made
once and freed before ``MPI_Finalize`` (env ``GPUDIST_MPI_PERSISTENT=0``: none).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from functools import partial

import torch

from ..control import Label
from ..envvars import setting
from ..errors import DeviceError
from .base import (
    P2P,
    Group,
    P2PProgram,
    Staging,
    Transport,
    Work,
    left_in_flight,
    p2p_label,
)

_HALF = (torch.float16, torch.bfloat16)


# MPICH's schedules for the nonblocking collectives gpudist posts, where its default is
# slower than the blocking call's (measured, 4 ranks: Ireduce_scatter_block of 1 MiB 578 us
# by default, 419 us pairwise, 414 us blocking). Read at MPI_Init; the user's value wins.
MPICH_DEFAULTS = {"MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "sched_pairwise"}


def _mpi():
    """``mpi4py.MPI``, importing (which initializes MPI) with :data:`MPICH_DEFAULTS`."""
    for k, v in MPICH_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from mpi4py import MPI

    return MPI


def cuda_aware() -> bool:
    """Whether the MPI library accepts device pointers (env GPUDIST_MPI_CUDA_AWARE overrides)."""
    aware = setting("GPUDIST_MPI_CUDA_AWARE", None)
    if aware is not None:
        return aware
    MPI = _mpi()
    q = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(q()) if q else False
    except Exception:  # pragma: no cover - library without MPIX extension
        return False


class _AllOf:
    """Several requests waited for as one (:meth:`MPITransport._complete` polls ``Test``)."""

    __slots__ = ("reqs", "testall")

    def __init__(self, reqs: list, testall) -> None:
        self.reqs, self.testall = reqs, testall

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.testall(self.reqs)


class MPITransport(Transport):
    """``MPI.COMM_WORLD`` (or a given communicator) as a transport."""

    reduce_keeps_input = True  # a non-root member's buffer is MPI's read-only send buffer

    def __init__(self, comm=None, timeout: float = 120.0, stage_all: bool | None = None
                 ) -> None:
        MPI = _mpi()
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.size, self.timeout = self.comm.Get_rank(), self.comm.Get_size(), timeout
        self.cuda_aware = cuda_aware()
        if stage_all is None:
            stage_all = setting("GPUDIST_FORCE_STAGING", False)
        self.stage_all = stage_all
        # persistent requests for halo steps (env GPUDIST_MPI_PERSISTENT=0: none)
        self.persistent = setting("GPUDIST_MPI_PERSISTENT", True)
        # MPICH moves messages only inside MPI calls unless asked for a progress thread
        self.progresses_alone = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0") not in (
            "0", "", "no", "false")
        self.name = "mpi4py" + ("/cuda-aware" if self.cuda_aware else "")
        self.staging = Staging()
        self._address = MPI.buffer.fromaddress
        self._groups: dict[tuple[int, ...], Group] = {}
        self._programs: weakref.WeakSet = weakref.WeakSet()  # freed before MPI_Finalize
        # the world's groups, made now while every rank is here (world-collective)
        everyone = tuple(range(self.size))
        self.world_meta = self.comm.Dup()
        # point-to-point messages (halo steps, the sums' trees and rings) on a duplicate of
        # the world: one an aborted world left unreceived would otherwise fail MPI_Finalize
        # ("Communicator being freed has 1 unmatched message(s)": an MPI_Abort at exit)
        self.p2p_comm = self.comm.Dup()
        self.tag_limit = self.comm.allreduce(int(self.comm.Get_attr(MPI.TAG_UB)), op=MPI.MIN)
        self._groups[everyone] = Group(everyone, self.comm, self.world_meta)
        self._types = {
            torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT, torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T, torch.complex128: MPI.C_DOUBLE_COMPLEX,
            torch.complex64: MPI.C_FLOAT_COMPLEX, torch.bool: MPI.C_BOOL,
        }

    # -- buffers ------------------------------------------------------------
    def native(self, t: torch.Tensor) -> bool:
        """Whether MPI takes ``t``'s memory as it is."""
        return not self.stage_all and (not t.is_cuda or self.cuda_aware)

    def _by_address(self, t: torch.Tensor) -> bool:
        """Host memory MPI takes by address as it is (no staging, no check needed)."""
        return not t.is_cuda and not self.stage_all and t.is_contiguous()

    def _spec(self, t: torch.Tensor, typed: bool):
        """MPI buffer spec of a contiguous tensor MPI can read (host, or device if aware).
        Host memory is handed over by address (a NumPy view costs 2-5x more per call): the
        caller keeps ``t`` alive until the request is done (``Work.keep``)."""
        if not t.is_contiguous():
            raise DeviceError("transport buffers must be contiguous")
        kind = self._mpi_type(t.dtype) if typed else self.MPI.BYTE
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            return [t if typed else t.view(torch.uint8), kind]
        return [self._address(t.data_ptr(), t.nbytes), kind]

    def _mpi_type(self, dtype: torch.dtype):
        if dtype not in self._types:
            raise DeviceError(f"MPI transport cannot sum tensors of dtype {dtype}")
        return self._types[dtype]

    def _sum(self, t: torch.Tensor):
        """MPI's sum for ``t``'s dtype: logical or for bool (MPI_SUM is undefined on
        MPI_C_BOOL; torch's sum of bools saturates at True, as gloo's does)."""
        return self.MPI.LOR if t.dtype == torch.bool else self.MPI.SUM

    def _direct(self, t: torch.Tensor, typed: bool):
        """The buffer spec of host memory MPI takes by address as it is (None: staged, or
        a half type summed in float32): the common case of every call, kept short."""
        if t.is_cuda or self.stage_all or not t.is_contiguous() or (typed and t.dtype in _HALF):
            return None
        return [self._address(t.data_ptr(), t.nbytes),
                self._mpi_type(t.dtype) if typed else self.MPI.BYTE]

    def _src(self, key: object, t: torch.Tensor, typed: bool = False):
        """(buffer spec, staged tensor) for data MPI reads; sums of half types in float32."""
        b = self._direct(t, typed)
        if b is not None:  # the common case
            return b, t
        if typed and t.dtype in _HALF:
            s = self.staging.host(key, t.shape, torch.float32)
            s.copy_(t)
            return self._spec(s, True), s
        if self.native(t):
            return self._spec(t, typed), t
        s = self.staging.stage_in(key, t)
        return self._spec(s, typed), s

    def _dst(self, key: object, t: torch.Tensor, typed: bool = False):
        """(buffer spec, staged tensor) for data MPI writes (copied back by finish)."""
        b = self._direct(t, typed)
        if b is not None:  # the common case
            return b, t
        if typed and t.dtype in _HALF:
            s = self.staging.host(key, t.shape, torch.float32)
            return self._spec(s, True), s
        if self.native(t):
            return self._spec(t, typed), t
        s = self.staging.host(key, t.shape, t.dtype)
        return self._spec(s, typed), s

    def _work(self, req, what: Label, staged, orig=None, other=None) -> Work:
        """The request as a Work that keeps ``staged`` (and ``other``: the tensors MPI was
        handed by address) alive; ``orig``: where a staged result is copied back."""
        back = None if orig is None or staged is orig else (lambda: orig.copy_(staged))
        return Work(what, req.Test, back, spin=True, keep=(staged, other))

    # -- interface ----------------------------------------------------------
    def _make_group(self, key: tuple[int, ...]) -> tuple[object, object]:
        color = 0 if self.rank in key else self.MPI.UNDEFINED
        comm = self.comm.Split(color, self.rank)
        if comm == self.MPI.COMM_NULL:
            return None, None
        return comm, comm.Dup()

    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        if not ops:
            return []
        reqs, back, keep = [], [], []
        for o in ops:
            t = o.tensor
            if self._by_address(t):
                buf, staged = self._spec(t, False), t  # the common case
            elif o.op == "send":
                buf, staged = self._src(("p2p", o.op, o.peer, o.tag), t)
            else:
                buf, staged = self._dst(("p2p", o.op, o.peer, o.tag), t)
            keep.append(staged)
            if o.op == "send":
                reqs.append(self.p2p_comm.Isend(buf, dest=o.peer, tag=o.tag))
            else:
                reqs.append(self.p2p_comm.Irecv(buf, source=o.peer, tag=o.tag))
                if staged is not t:
                    back.append((staged, t))

        def done() -> bool:
            return self.MPI.Request.Testall(reqs)

        def finish() -> None:
            for staged, t in back:
                t.copy_(staged)

        what = p2p_label(ops)
        return [Work(what, done, finish if back else None, spin=True, keep=keep)]

    def p2p_program(self, ops: Sequence[P2P]) -> P2PProgram:
        """Host buffers MPI takes as they are become persistent requests (made once,
        started by one ``Startall`` per call); anything else is posted anew each time."""
        if self.persistent and ops and all(self._by_address(o.tensor) for o in ops):
            p = _Persistent(self, ops)
            self._programs.add(p)
            return p
        return P2PProgram(self, ops)

    def broadcast(self, tensor, src, group):
        what = group.doing("broadcast from", src)
        key = ("bcast", group.ranks, src)
        if self.rank == src:
            buf, s = self._src(key, tensor)
            req = group.handle.Ibcast(buf, root=group.index(src))
            return self._work(req, what, s)
        buf, s = self._dst(key, tensor)
        req = group.handle.Ibcast(buf, root=group.index(src))
        return self._work(req, what, s, tensor)

    def prepare(self, kind, group, root=None, splits=None):
        """Host memory MPI takes by address: the request posted and polled directly
        (anything else: the general call)."""
        general = super().prepare(kind, group, root, splits)
        h, direct, done = group.handle, self._direct, self._complete
        if kind == "all_to_all" and not splits[2]:
            return self._prepared_all_to_allv(general, group, splits)
        if kind == "broadcast":
            post, at, label = h.Ibcast, group.index(root), group.doing("broadcast from", root)

            def bcast(t: torch.Tensor) -> None:
                b = direct(t, False)
                if b is None:
                    return general(t)
                done(post(b, root=at), label, t)
            return bcast
        typed = kind not in ("all_gather", "all_to_all")  # (sums carry their MPI type)
        post = {"all_reduce": h.Iallreduce, "all_gather": h.Iallgather,
                "reduce_scatter": h.Ireduce_scatter_block, "all_to_all": h.Ialltoall}[kind]
        label, sums = group.doing(kind.replace("_", "-")), self._sum

        def run(out: torch.Tensor, inp: torch.Tensor) -> None:
            ob, ib = direct(out, typed), direct(inp, typed)
            if ob is None or ib is None:
                return general(out, inp)
            done(post(ib, ob, op=sums(inp)) if typed else post(ib, ob), label, (out, inp))
        return run

    def prepare_p2p(self, pattern):
        """Host memory MPI takes by address: the requests posted and polled directly
        (anything else: the general call)."""
        general = super().prepare_p2p(pattern)
        comm, addr, byte, done, direct = (self.p2p_comm, self._address, self.MPI.BYTE,
                                          self._complete, self._by_address)
        posts = [(comm.Isend if op == "send" else comm.Irecv, peer, tag)
                 for op, peer, tag in pattern]
        label, testall = p2p_label([P2P(op, None, peer, tag) for op, peer, tag in pattern]), \
            self.MPI.Request.Testall

        def run(tensors: Sequence[torch.Tensor]) -> None:
            for t in tensors:
                if not direct(t):
                    return general(tensors)
            reqs = [post([addr(t.data_ptr(), t.nbytes), byte], peer, tag)
                    for (post, peer, tag), t in zip(posts, tensors)]
            done(reqs[0] if len(reqs) == 1 else _AllOf(reqs, testall), label, tensors)
        return run

    def _prepared_all_to_allv(self, general, group, splits):
        """:meth:`prepare`'s uneven all-to-all: counts and displacements in bytes, made
        once per element size."""
        o, i, _ = splits
        post, addr, byte, done = group.handle.Ialltoallv, self._address, self.MPI.BYTE, \
            self._complete
        label, layouts = group.doing("all-to-all"), {}

        def layout(e: int) -> tuple:
            def cd(splits):
                c = [x * e for x in splits]
                return c, [sum(c[:j]) for j in range(len(c))]
            return layouts.setdefault(e, (cd(i), cd(o)))

        def run(out: torch.Tensor, inp: torch.Tensor) -> None:
            if not (self._by_address(out) and self._by_address(inp)):
                return general(out, inp)
            ins, outs = layout(inp.element_size())
            done(post([addr(inp.data_ptr(), inp.nbytes), ins, byte],
                      [addr(out.data_ptr(), out.nbytes), outs, byte]), label, (out, inp))
        return run

    def _complete(self, req, what: Label, keep: object) -> None:
        """Wait for ``req`` through the control plane (polled once first: a small message
        is often done by then); ``keep``, the memory MPI was handed, stays alive if the
        wait fails (as :meth:`Transport.wait` keeps a Work's)."""
        if req.Test():
            return
        try:
            self.control.wait(req.Test, what, spin=True)
        except BaseException:
            left_in_flight([Work(what, req.Test, keep=keep)])
            raise

    def reduce(self, tensor, dst, group):
        what = group.doing("reduce to", dst)
        key = ("reduce", group.ranks, dst)
        root = group.index(dst)
        buf, s = self._src(key, tensor, typed=True)
        if group.index(self.rank) == root:
            req = group.handle.Ireduce(self.MPI.IN_PLACE, buf, op=self._sum(tensor), root=root)
            return self._work(req, what, s, tensor)
        req = group.handle.Ireduce(buf, None, op=self._sum(tensor), root=root)
        return self._work(req, what, s)

    def all_reduce(self, tensor, group, src=None):
        if src is not None:
            sb, tb = self._direct(src, True), self._direct(tensor, True)
            if sb is not None and tb is not None:  # MPI reads src, writes tensor: no copy
                req = group.handle.Iallreduce(sb, tb, op=self._sum(tensor))
                return self._work(req, group.doing("all-reduce"), tensor, None, src)
            tensor.copy_(src)
        buf, s = self._src(("allreduce", group.ranks), tensor, typed=True)
        req = group.handle.Iallreduce(self.MPI.IN_PLACE, buf, op=self._sum(tensor))
        return self._work(req, group.doing("all-reduce"), s, tensor)

    def all_gather(self, out, tensor, group):
        ob, so = self._dst(("ag-out", group.ranks), out)
        ib, si = self._src(("ag-in", group.ranks), tensor)
        req = group.handle.Iallgather(ib, ob)
        return self._work(req, group.doing("all-gather"), so, out, si)

    def reduce_scatter(self, out, inp, group):
        ob, so = self._dst(("rs-out", group.ranks), out, typed=True)
        ib, si = self._src(("rs-in", group.ranks), inp, typed=True)
        req = group.handle.Ireduce_scatter_block(ib, ob, op=self._sum(inp))
        return self._work(req, group.doing("reduce-scatter"), so, out, si)

    def all_to_all(self, out, inp, out_splits, in_splits, group, even=False):
        ob, so = self._dst(("a2a-out", group.ranks), out)
        ib, si = self._src(("a2a-in", group.ranks), inp)
        e = out.element_size()
        if even:  # the regular all-to-all on every rank (MPICH's Ialltoallv is ~40 % slower)
            req = group.handle.Ialltoall(ib, ob)
            return self._work(req, group.doing("all-to-all"), so, out, si)

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
        return self._work(req, group.doing("all-to-all"), so, out, si)

    def meta_all_gather(self, out, row, group):
        req = group.meta.Iallgather([row.numpy(), self.MPI.INT64_T],
                                    [out.numpy(), self.MPI.INT64_T])
        return self._work(req, group.doing("metadata exchange"), None)

    def finalize(self) -> None:
        for p in list(self._programs):
            p.free()
        self._groups.clear()
        self.staging.clear()


class _Requests:
    """MPI persistent requests made once and started together: :meth:`start` posts them
    all (None while an earlier start never completed: its wait failed); ``free()`` frees
    them (not while live, not once MPI is finalized; also when garbage-collected)."""

    def __init__(self, MPI, reqs: list, what: Label) -> None:
        self.reqs, self._what = reqs, what
        self._active = [False]  # shared with the finalizer
        if len(reqs) == 1:  # one request: its own Start/Test (Testall errs
            self._startall, self._done = reqs[0].Start, reqs[0].Test  # on it, MPICH 5)
        else:
            self._startall = partial(MPI.Prequest.Startall, reqs)
            self._done = partial(MPI.Request.Testall, reqs)
        self.free = weakref.finalize(self, _free, MPI, reqs, self._active)

    def _finish(self) -> None:
        self._active[0] = False

    def start(self) -> Work | None:
        if self._active[0]:
            return None
        self._startall()
        self._active[0] = True
        return Work(self._what, self._done, self._finish, spin=True)


class _Persistent(P2PProgram):
    """A batch of MPI persistent requests (``Send_init``/``Recv_init`` on buffers that live
    as long as the program). A start while the previous one never completed (its wait
    failed) posts a fresh batch instead of restarting live requests."""

    def __init__(self, transport: MPITransport, ops: Sequence[P2P]) -> None:
        super().__init__(transport, ops)
        comm, spec = transport.p2p_comm, transport._spec
        self.requests = _Requests(transport.MPI, [
            comm.Send_init(spec(o.tensor, False), dest=o.peer, tag=o.tag) if o.op == "send"
            else comm.Recv_init(spec(o.tensor, False), source=o.peer, tag=o.tag)
            for o in self.ops], p2p_label(self.ops))
        self.free = self.requests.free

    def start(self) -> list[Work]:
        w = self.requests.start()
        return [w] if w is not None else self.transport.batch_p2p(self.ops)


def _free(MPI, reqs, active: list[bool]) -> None:
    """Free persistent requests (not live ones, not once MPI is finalized)."""
    if active[0] or MPI.Is_finalized():
        return
    for r in reqs:
        if r != MPI.REQUEST_NULL:
            r.Free()
