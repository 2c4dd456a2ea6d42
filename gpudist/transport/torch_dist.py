"""Transport over ``torch.distributed`` (NCCL for CUDA tensors, gloo for CPU tensors).

Waiting: where each rank has a core of its own, a gloo collective is waited for in torch's
timed wait, in slices between the control plane's checks (the thread sleeps without the
GIL and wakes when gloo is done); where ranks outnumber cores it naps between polls
instead (``block_collectives``, set by :func:`gpudist.runtime.init`). NCCL's collectives
are polled (``Work.is_completed``). gloo's point-to-point works cannot be polled (and a
timed-out gloo wait closes the connection), so the caller blocks in them directly while a
watch thread minds a wait that lasts (:class:`_P2PWatch`: a peer's failure, diagnostics,
the timeout; it ends the wait by closing its connections). Metadata goes over a second
communicator per group (gloo, on the CPU, also in NCCL worlds).

Staging: gloo cannot take CUDA tensors (point-to-point) and NCCL only takes them; a tensor
on the other kind of device goes through a :class:`~gpudist.transport.base.Staging`
buffer (allocated once per use and shape). ``stage_all=True`` (env
``GPUDIST_FORCE_STAGING=1``) stages every tensor, so the staging path runs on CPU-only
machines too.
"""

from __future__ import annotations

import ctypes
import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..control import Label, label_text
from ..envvars import setting
from ..errors import CommTimeout, DeviceError, GpudistError
from .base import P2P, Group, Staging, Transport, Work, p2p_label

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# dtypes gloo's collectives refuse ("Invalid scalar type"), moved as another dtype of the
# same width (a view: the bytes are the same). Of these only int16 reaches a sum (the
# others torch cannot add: refused at plan time, primitives.base.check_summable): it is
# summed in int32 (the sum cast back wraps alike).
_GLOO_MOVE_AS = {torch.int16: torch.float16, torch.uint16: torch.float16,
                 torch.uint32: torch.int32, torch.uint64: torch.int64}
_GLOO_MOVE_AS.update({getattr(torch, n): torch.uint8 for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)})


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the one-dimensional tensor torch's all-gather / reduce-scatter take."""
    return t if t.dim() == 1 else t.view(-1)


def _backend_error(e: BaseException, what: Label, control=None) -> BaseException:
    """The gpudist error for a backend failure: the failure a peer posted, if any (its
    exit is what broke the connection), else what the backend said."""
    what = label_text(what)
    if control is not None:
        try:
            control.poll_abort(what)
        except Exception as posted:  # noqa: BLE001 - the peer's own error says more
            return posted
    text = str(e)
    if "closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        gone = []
        if control is not None:
            try:
                gone = control.gone()
            except Exception:  # noqa: BLE001 - the store may be gone too
                pass
        who = (f"rank(s) {gone} no longer run (exited, crashed or killed); "
               if gone else "a peer closed its connection (it exited, crashed or aborted): ")
        return CommTimeout(f"{what}: {who}{text.splitlines()[0][:300]}")
    return CommTimeout(f"{what} failed in the backend: {text.splitlines()[0][:300]}")


_SLICE = datetime.timedelta(seconds=0.01)  # the control plane's usual slice, made once


def backend_timeout(timeout: float) -> datetime.timedelta:
    """The process groups' own timeout: a little after the world's, so that the control
    plane's (a CommTimeout naming the ranks that are missing) comes first. With the two
    equal, gloo's "Timed out waiting 3000ms for recv operation", which names no rank, won
    the race in 3 of 16 runs of a silent-peer test (a peer's black-box suite)."""
    return datetime.timedelta(seconds=timeout + max(2.0, 0.1 * timeout))


def _timed_wait(w) -> Callable[[float], None]:
    """``block(s)`` for a gloo collective's work: wait in torch up to ``s`` seconds.

    The thread sleeps in C++ without the GIL and wakes the moment gloo completes the
    collective; polling ``is_completed`` with naps woke 80-100 us late on a 64 KiB
    broadcast, and spinning starved gloo's own threads. A timed-out wait leaves a gloo
    collective as it was (unlike a point-to-point one, whose timed-out wait closes the
    connection: those are waited for directly, see :class:`_P2PWatch`). A failed
    collective ends the wait too; ``finish`` raises its error."""
    def block(s: float) -> None:
        try:
            w.wait(timeout=_SLICE if s == 0.01 else datetime.timedelta(seconds=s))
        except RuntimeError as e:  # timed out, or failed (then completed: finish raises
            if "timed out" not in str(e) and not w.is_completed():  # it); an error that
                time.sleep(min(s, 1e-3))  # leaves the work pending must not make the
                # caller's loop spin until its timeout

    return block


class _Pending:
    """One batch of gloo point-to-point works, from its post until its wait ends."""

    __slots__ = ("works", "what", "event", "error", "t0")

    def __init__(self, works, what: Label) -> None:
        self.works, self.what, self.event, self.error, self.t0 = (
            works, what, threading.Event(), None, 0.0)


class _P2PWatch:
    """gloo's point-to-point works complete only inside ``wait()``, and a timed-out wait
    closes the connection, so they cannot be polled: the caller blocks in them directly
    (waking the moment gloo is done, as a raw ``irecv().wait()`` does). Meanwhile this
    daemon thread does what the control plane's wait loop would: for a wait still open
    ``grace`` seconds after it began, it runs :meth:`Control.wait` on the caller's behalf
    (a peer's posted failure, mismatch diagnostics, the timeout). If that raises, the
    error is handed to the caller and the waits are *cut*: a timed wait on each from this
    thread times out and closes its connection, which ends the caller's wait (and the
    peer's) with an error. A wait wakes this thread once, off the caller's path (waited
    in a helper thread instead, two hand-offs a step, a 64 KiB swap took 1.35-1.44x the
    raw one on a 2-core machine; now 1.23-1.24x)."""

    grace = 0.005  # the control plane's first look for a posted failure (ABORT_FIRST_CHECK_S)

    def __init__(self, control_of: Callable[[], object]) -> None:
        self.control_of = control_of  # the world's Control, once gpudist.init has set it
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.open: set[_Pending] = set()  # posted, not yet waited out

    def post(self, works, what: Label) -> _Pending:
        p = _Pending(works, what)
        self.open.add(p)
        return p

    def wait(self, p: _Pending) -> None:
        """Block until ``p``'s works are done, failed, or cut (then ``p.error`` says why)."""
        if p.event.is_set():
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="gpudist-p2p-watch",
                                           daemon=True)
            self.thread.start()
        p.t0 = time.monotonic()
        self.q.put(p)
        w = None
        try:
            for w in p.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - finish raises it (or the cut's cause)
            if p.error is None:
                p.error = e
        # hold no backend work past its wait (the group may go next), nor the label's
        # tensors (the queue may hold ``p`` a while: a buffer still held is not reused)
        p.works = p.what = w = None
        self.open.discard(p)
        p.event.set()

    def _run(self) -> None:
        while True:
            p = self.q.get()
            if p is None:
                return
            if not p.event.is_set():
                time.sleep(max(0.0, p.t0 + self.grace - time.monotonic()))
            control, what = self.control_of(), p.what
            if p.event.is_set() or control is None or what is None:
                p = what = None
                continue
            try:
                control.wait(p.event.is_set, what, block=p.event.wait)
            except BaseException as e:  # noqa: BLE001 - the caller's, with its waits cut
                p.error = e
                control.undelivered = e  # (its wait may have completed meanwhile)
                self._cut(p)
            p = what = None

    @staticmethod
    def _cut(p: _Pending) -> None:
        brief = datetime.timedelta(milliseconds=1)
        for w in p.works or ():
            try:
                w.wait(timeout=brief)
            except Exception:  # noqa: BLE001 - timed out (the point) or failed
                pass

    def cut(self) -> None:
        """An aborted world's exit: close the connections of the works still open (their
        peers, blocked in the matching waits, wake with an error instead of waiting for
        this process to exit)."""
        for p in list(self.open):
            self._cut(p)

    def stop(self) -> None:
        """End the thread and wait for it, so no backend object outlives the group here."""
        if self.thread is not None:
            self.q.put(None)
            self.thread.join(timeout=5.0)
            self.thread = None


class TorchDistTransport(Transport):
    """``torch.distributed`` process group as a transport."""

    tag_limit = 2**31 - 1

    def __init__(self, timeout: float, stage_all: bool | None = None,
                 owns_default_group: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call gpudist.init()")
        self.rank, self.size, self.timeout = dist.get_rank(), dist.get_world_size(), timeout
        # whether gpudist.init made the default group (else the program's: finalize then
        # destroys only the groups made here, and leaves it)
        self.owns_default_group = owns_default_group
        self.backend = dist.get_backend()
        self.name = f"torch.distributed/{self.backend}"
        if stage_all is None:
            stage_all = setting("GPUDIST_FORCE_STAGING", False)
        self.stage_all = stage_all and self.backend != "nccl"
        self.staging = Staging()
        self._groups: dict[tuple[int, ...], Group] = {}
        self._watch = _P2PWatch(lambda: self.control)
        # a gloo collective's wait: torch's timed wait, or naps between polls (set by
        # gpudist.init from GPUDIST_GLOO_WAIT and how many ranks share this host's cores)
        self.block_collectives = False
        self._td = backend_timeout(timeout)
        # the world's groups, made now while every rank is here (world-collective)
        everyone = tuple(range(self.size))
        self._made: list = []  # every group made here (destroyed by finalize)
        self.world_meta = self._new(everyone, backend="gloo")
        # gloo: the world's data collectives on a group of gpudist's own: a user's
        # collective on the default group called in another order on some ranks would
        # otherwise pair with gpudist's and swap their data silently (a fuzz found it).
        # (NCCL: the default group, as for point-to-point below.)
        data = (self._new(everyone) if self.size > 1 and self.backend == "gloo"
                else dist.group.WORLD)
        self._groups[everyone] = Group(everyone, data, self.world_meta)
        # gloo: gpudist's point-to-point messages (halo steps, trees, rings) on a group of
        # their own, never matched by a user's own send or receive with the same tag on
        # the default group, and under gpudist's timeout even where the program made that
        # group. NCCL ignores tags and would make another world-wide communicator at the
        # group's first batch, which must then include every rank: the default group.
        self.p2p_group = (self._new(everyone)
                          if self.size > 1 and self.backend == "gloo" else None)

    # -- helpers ------------------------------------------------------------
    def native(self, t: torch.Tensor) -> bool:
        """Whether the backend takes ``t``'s memory as it is."""
        if self.stage_all:
            return False
        return t.is_cuda if self.backend == "nccl" else not t.is_cuda

    def _check(self, t: torch.Tensor) -> None:
        if self.backend == "nccl" and not t.is_cuda:
            raise DeviceError(f"the NCCL backend moves CUDA tensors only; got a tensor on "
                              f"{t.device} (use gloo or MPI for CPU tensors)")

    def _in(self, key: object, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the backend reads it (staged to the host if it cannot take it)."""
        if self.native(t):
            return t
        self._check(t)
        return self.staging.stage_in(key, t)

    def _out(self, key: object, t: torch.Tensor) -> torch.Tensor:
        """Where the backend writes ``t``'s data (a host buffer, copied back by finish)."""
        if self.native(t):
            return t
        self._check(t)
        return self.staging.host(key, t.shape, t.dtype)

    def _moved(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a collective that copies it hands it to the backend (gloo: a dtype it
        refuses as one of the same width it takes)."""
        dt = _GLOO_MOVE_AS.get(t.dtype) if self.backend == "gloo" else None
        return t if dt is None else t.view(dt)

    def _summed(self, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """(what a summing collective hands the backend for ``t``, what copies its sum back
        into ``t`` afterwards, or None)."""
        if self.backend != "gloo" or t.dtype != torch.int16:
            return t, None
        wide = t.to(torch.int32)
        return wide, lambda: t.copy_(wide)

    def _coll(self, w, what: Label, staged: torch.Tensor | None = None,
              orig: torch.Tensor | None = None, gloo: bool | None = None,
              then: Callable[[], None] | None = None, keep: object = None) -> Work:
        """The Work of collective ``w`` (``gloo``: it runs on a gloo group; default: the
        world's backend is gloo); once done, ``then`` runs and ``staged`` is copied back
        into ``orig``. ``keep``: what must stay alive (held) until then."""
        def finish() -> None:
            try:
                w.wait()
            except RuntimeError as e:
                raise _backend_error(e, what, self.control) from e
            if then is not None:
                then()
            if orig is not None and staged is not orig:
                orig.copy_(staged)

        return Work(what, w.is_completed, finish, block=self._block(w, gloo), keep=keep)

    def _block(self, w, gloo: bool | None = None) -> Callable[[float], None] | None:
        """How the wait loop blocks for collective ``w``: torch's timed wait where this
        world blocks for gloo collectives (``gloo``: ``w`` runs on a gloo group; default:
        the world's backend is gloo), else None (polled)."""
        if self.block_collectives and (self.backend == "gloo" if gloo is None else gloo):
            return _timed_wait(w)
        return None

    # -- interface ----------------------------------------------------------
    def _new(self, ranks: Sequence[int], backend: str | None = None):
        """``dist.new_group`` (every rank of the world calls it, in the same order) under
        gpudist's timeout, remembered for :meth:`finalize`."""
        g = dist.new_group(list(ranks), timeout=self._td, backend=backend)
        self._made.append(g)
        return g

    def _make_group(self, key: tuple[int, ...]) -> tuple[object, object]:
        return self._new(key), self._new(key, backend="gloo")

    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        if not ops:
            return []
        dops, back, g = [], [], self.p2p_group
        gloo = self.backend == "gloo"
        for o in ops:
            key = ("p2p", o.op, o.peer, o.tag)
            if o.op == "send":
                t = self._in(key, o.tensor)
            else:
                t = self._out(key, o.tensor)
                if t is not o.tensor:
                    back.append((t, o.tensor))
            fn = dist.isend if o.op == "send" else dist.irecv
            # gloo: each posted on its own (batch_isend_irecv's coalescing, which NCCL
            # needs, costs gloo ~30 us a 64 KiB swap: 234 against 204-208 us)
            dops.append(fn(t, o.peer, group=g, tag=o.tag) if gloo else
                        dist.P2POp(fn, t, o.peer, group=g, tag=o.tag))
        works = dops if gloo else dist.batch_isend_irecv(dops)
        what = p2p_label(ops)

        def copy_back() -> None:
            for staged, orig in back:
                orig.copy_(staged)

        if self.backend != "gloo":  # NCCL works poll through CUDA events
            def finish() -> None:
                for w in works:
                    w.wait()
                copy_back()

            return [Work(what, lambda: all(w.is_completed() for w in works), finish)]
        watch = self._watch
        pending = watch.post(works, what)

        def finish_gloo() -> None:
            e = pending.error
            if e is not None:  # the backend's failure, or the watch's error (its cause)
                e._gpudist_delivered = True  # (raised here: not again, Control.undelivered)
                if isinstance(e, RuntimeError) and not isinstance(e, GpudistError):
                    raise _backend_error(e, what, self.control) from e
                raise e
            copy_back()

        return [Work(what, pending.event.is_set, finish_gloo,
                     block=lambda _s: watch.wait(pending))]

    # A staged result is copied back only where the collective writes one: the root of a
    # broadcast and the senders of a reduce leave ``tensor`` untouched (a copy back would
    # bump its autograd version: the sender's input may be saved for backward).
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Work:
        key, root = ("bcast", group.ranks, src), self.rank == src
        s = self._in(key, tensor) if root else self._out(key, tensor)  # (nothing to stage in)
        w = dist.broadcast(self._moved(s), src, group=group.handle, async_op=True)
        return self._coll(w, group.doing("broadcast from", src), s, None if root else tensor)

    def reduce(self, tensor: torch.Tensor, dst: int, group: Group) -> Work:
        s = self._in(("reduce", group.ranks, dst), tensor)
        wire, then = self._summed(s)
        w = dist.reduce(wire, dst, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
        back = tensor if self.rank == dst else None
        return self._coll(w, group.doing("reduce to", dst), s, back,
                          then=then if back is not None else None)

    def all_reduce(self, tensor: torch.Tensor, group: Group,
                   src: torch.Tensor | None = None) -> Work:
        if src is not None:
            tensor.copy_(src)
        s = self._in(("allreduce", group.ranks), tensor)
        wire, then = self._summed(s)
        w = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
        return self._coll(w, group.doing("all-reduce"), s, tensor, then=then)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work:
        out = _flat(out)
        so = self._out(("ag-out", group.ranks), out)
        si = self._in(("ag-in", group.ranks), _flat(tensor))
        w = _all_gather_single(self._moved(so), self._moved(si), group=group.handle,
                               async_op=True)
        return self._coll(w, group.doing("all-gather"), so, out)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group) -> Work:
        what = group.doing("reduce-scatter")
        out = _flat(out)
        so = self._out(("rs-out", group.ranks), out)
        si = self._in(("rs-in", group.ranks), _flat(inp))
        if self.backend == "gloo":  # gloo has none: an all-to-all brings this member
            # the group's chunks of its slot, summed here: (n-1)/n of the input's bytes
            # per rank, half of what a ring all-reduce moves, and none of its copies (2
            # ranks, 1 / 16 MiB: 0.56x / 0.70x the all-reduce's time)
            stage = self.staging.host(("rs-chunks", group.ranks),
                                      (len(group.ranks), out.numel()), inp.dtype)
            w = dist.all_to_all_single(self._moved(stage.view(-1)), self._moved(si),
                                       group=group.handle, async_op=True)
            return self._coll(w, what, so, out, then=lambda: torch.sum(stage, 0, out=so),
                              keep=si)
        w = dist.reduce_scatter_tensor(so, si, op=dist.ReduceOp.SUM, group=group.handle,
                                       async_op=True)
        return self._coll(w, what, so, out)

    def all_to_all(self, out, inp, out_splits, in_splits, group: Group,
                   even: bool = False) -> Work:
        so = self._out(("a2a-out", group.ranks), out)
        si = self._in(("a2a-in", group.ranks), inp)
        w = dist.all_to_all_single(self._moved(so), self._moved(si), list(out_splits),
                                   list(in_splits), group=group.handle, async_op=True)
        return self._coll(w, group.doing("all-to-all"), so, out)

    def meta_all_gather(self, out: torch.Tensor, row: torch.Tensor, group: Group) -> Work:
        w = _all_gather_single(out, row, group=group.meta, async_op=True)
        return self._coll(w, group.doing("metadata exchange"), gloo=True)

    def abandon(self) -> None:
        """Keep every process group alive through the interpreter's teardown: a gloo
        group's destructor joins its worker threads, and a thread in a collective its peers
        left waits the backend's whole timeout (``abort()`` does not wake it). The process
        is exiting; the operating system reclaims the groups."""
        for pg in list(dist.distributed_c10d._world.pg_map):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))

    def release_in_flight(self) -> None:
        """An aborted world's exit: close the connections of the point-to-point works left
        open (:meth:`_P2PWatch.cut`)."""
        self._watch.cut()

    def finalize(self) -> None:
        """Drop the groups; where the default group is the program's (it stays), destroy
        those made here (with the default group, torch destroys them all)."""
        self._watch.stop()
        self._groups.clear()
        self.staging.clear()
        made, self._made = self._made, []
        if not self.owns_default_group and dist.is_initialized():
            for g in made:
                if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
