"""The transport interface: the only thing a backend implements.

Primitives are written once against :class:`Transport`; a backend only moves bytes. All
ranks are *world* ranks. A :class:`Group` is a set of world ranks with two backend
communicators: ``handle`` for data and ``meta`` for the small metadata exchanges of
:mod:`gpudist.meta` (so a metadata exchange can never be matched with a data collective of
a rank that disagrees). ``Transport.group(ranks)`` is collective over the whole world (like
``torch.distributed.new_group``) and cached.

Every call starts asynchronously and returns :class:`Work`; :meth:`Transport.wait` waits
for a batch through the world's control plane (:class:`gpudist.control.Control`): aborts
posted by other ranks, mismatch diagnostics and the timeout all live there, so no backend
can hang the program on its own.

Device tensors go straight to a backend that takes device pointers (NCCL, CUDA-aware MPI);
for the others (gloo point-to-point, host-only MPI) the backend stages them through host
buffers it keeps per shape (:class:`Staging`), allocated once and reused.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..buffers import BufferPool
from ..control import Label, label_text

DEFAULT_TIMEOUT_S = 120.0


@dataclass(eq=False)
class Group:
    """A set of world ranks (ascending) plus the backend's handles for it."""

    ranks: tuple[int, ...]
    handle: object = field(repr=False, default=None)
    meta: object = field(repr=False, default=None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, world_rank: int) -> int:
        return self.ranks.index(world_rank)

    def doing(self, what: str, rank: int | None = None) -> Label:
        """The label "<what> [rank] over [ranks]" of an operation on this group, as a
        function: formatted only if a wait turns slow or fails."""
        if rank is not None:
            return lambda: f"{what} {rank} over {list(self.ranks)}"
        return lambda: f"{what} over {list(self.ranks)}"


class Work:
    """A pending operation: ``done()`` polls it (driving progress where the backend needs
    that), ``finish()`` runs once it is done (raises the backend's error, copies staged
    data back). ``block(s)`` optionally blocks up to ``s`` seconds for progress."""

    __slots__ = ("what", "done", "_finish", "block", "spin", "keep")

    def __init__(self, what: Label, done: Callable[[], bool],
                 finish: Callable[[], None] | None = None,
                 block: Callable[[float], object] | None = None, spin: bool = False,
                 keep: object = None) -> None:
        # ``done`` is the backend's poll itself (no method in between: it runs in loops);
        # ``keep``: what must stay alive until the operation is done (the tensors whose
        # memory the backend was handed by address)
        self.what, self.done, self._finish, self.block, self.spin, self.keep = (
            what, done, finish, block, spin, keep)

    def finish(self) -> None:
        if self._finish is not None:
            f, self._finish = self._finish, None
            f()


def left_in_flight(works: Sequence[Work]) -> None:
    """Keep works a failed wait leaves in flight, and what they hold, alive for the rest of
    the process (a deliberate leak: the world is over). Their backend may still complete
    them: MPI writing into a receive buffer it was handed by address (freed and reused by
    then, in a process that goes on), a gloo worker thread destroying a collective it
    finished with the last reference to the tensors (see ``runtime._at_exit``)."""
    for w in works:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(w))


def completed(what: str = "no-op") -> Work:
    return Work(what, lambda: True)


class P2P(NamedTuple):
    """One half of a point-to-point transfer: ``op`` is "send" or "recv" (a named tuple:
    a halo exchange makes several per step)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def p2p_label(ops: Sequence[P2P]) -> Label:
    """The label of a batch of point-to-point transfers (formatted only if needed)."""
    return lambda: f"point-to-point with ranks {sorted({o.peer for o in ops})}"


class P2PProgram:
    """A fixed batch of point-to-point transfers, started again and again on the same
    buffers (a halo exchange step into its own send/receive buffers): :meth:`start` posts
    them and returns their Work. This one posts a new batch each time; a backend that can
    prepare a batch once does (:meth:`Transport.p2p_program`; MPI: persistent requests).
    The program keeps its tensors alive."""

    def __init__(self, transport: Transport, ops: Sequence[P2P]) -> None:
        self.transport, self.ops = transport, tuple(ops)

    def start(self) -> list[Work]:
        return self.transport.batch_p2p(self.ops)


_CPU = torch.device("cpu")


class Staging:
    """Host buffers for device tensors a backend cannot take, per (use, shape, dtype): one
    per operation in flight (a buffer a pending operation still holds is not handed out
    again), allocated on first use (pinned when CUDA is present) and reused by later
    calls."""

    def __init__(self) -> None:
        self._pool = BufferPool(max_keys=256)
        self._pin = torch.cuda.is_available()  # (asked once, not per staged operation)

    @property
    def allocations(self) -> int:
        return self._pool.allocations

    def host(self, key: object, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self._pool.get(key, shape, dtype, _CPU, pin=self._pin)

    def stage_in(self, key: object, t: torch.Tensor) -> torch.Tensor:
        """``t``'s data on the host (asynchronous copy on the current stream, then a sync
        so the backend may read it)."""
        h = self.host(key, t.shape, t.dtype)
        h.copy_(t, non_blocking=True)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        return h

    def clear(self) -> None:
        self._pool.clear()


class Transport(ABC):
    """Moves tensors between world ranks. Tensors handed in must be contiguous."""

    name: str = "abstract"
    rank: int
    size: int
    timeout: float = DEFAULT_TIMEOUT_S
    control = None  # set by gpudist.init: the world's Control
    # whether reduce() leaves a non-root member's tensor as it was (MPI reads the send
    # buffer only); where False, callers hand it a scratch copy
    reduce_keeps_input: bool = False
    # whether posted messages move while the rank computes (a progress thread: gloo's,
    # NCCL's streams); where False, computing while a halo exchange is in flight gains
    # nothing (the layers then complete the exchange first, HaloExchange.overlap)
    progresses_alone: bool = True
    # the largest message tag every rank's backend takes (MPI guarantees 32767; MPICH
    # takes 2^29 - 1, torch's gloo any 32-bit one)
    tag_limit: int = 32767

    # -- groups -------------------------------------------------------------
    _groups: dict
    world_meta: object  # the meta communicator of the whole world, made at construction

    def group(self, ranks: Sequence[int]) -> Group:
        """The cached group of the rank *set* ``ranks``, members in ascending order.

        Collective over the WORLD: every rank calls it with the same ranks in the same
        order (non-members get a Group whose handles are None). Before a new group is made,
        the world checks (through a pollable metadata exchange) that every rank is making
        the same one: a rank that builds another partition, or none, is a
        :class:`~gpudist.errors.MismatchError` or a timeout, never a hang in the backend.
        """
        key = tuple(sorted({int(r) for r in ranks}))
        g = self._groups.get(key)
        if g is None:
            if key != tuple(range(self.size)):
                self._agree_on(key)
            try:
                handle, meta = self._make_group(key)
            except Exception:  # a backend's store wait: the failure a peer posted (its
                if self.control is not None:  # leaving is what made it wait) says more
                    self.control.poll_abort(f"creating the communicator of ranks {list(key)}")
                raise
            member = self.rank in key
            g = Group(key, handle if member else None, meta if member else None)
            self._groups[key] = g
        return g

    def _agree_on(self, key: tuple[int, ...]) -> None:
        """Every rank is about to make the same communicator (a metadata exchange over the
        world, in the same row format as every other, so it meets any of them)."""
        from ..errors import MismatchError
        from ..meta import Row, exchange
        from ..spec import stable_hash

        world = self._groups[tuple(range(self.size))]
        row = Row.make("communicator", 1, stable_hash(key), None, "cpu",
                       (len(self._groups), len(key), key[0], key[-1]), None)
        rows = exchange(world, row, f"creating the communicator of ranks {list(key)}")
        if len({tuple(r.v) for r in rows}) > 1:
            detail = "; ".join(
                f"rank {i}: {r.name} #{r.local[0]} of {r.local[1]} ranks {r.local[2]}.."
                f"{r.local[3]}" if r.name == "communicator" else f"rank {i}: {r.describe()}"
                for i, r in enumerate(rows))
            err = MismatchError(
                f"ranks create different communicators, or one creates a communicator while "
                f"another runs an operator ({detail}): partitions and primitives must be "
                f"built by every rank, in the same order")
            if self.control is not None:  # the programs diverged: the world cannot go on
                self.control.abort(err, "creating a communicator")
            raise err

    @abstractmethod
    def _make_group(self, key: tuple[int, ...]) -> tuple[object, object]:
        """(data handle, meta handle) of a new group: world-collective, blocking."""

    # -- point to point -----------------------------------------------------
    @abstractmethod
    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        """Start all sends/receives at once (order-independent, deadlock-free)."""

    def p2p_program(self, ops: Sequence[P2P]) -> P2PProgram:
        """``ops`` prepared to be started many times (their tensors stay the same)."""
        return P2PProgram(self, ops)

    # -- collectives over a group (all start asynchronously) ----------------
    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Work:
        """Copy ``tensor`` from world rank ``src`` to every member, in place."""

    @abstractmethod
    def reduce(self, tensor: torch.Tensor, dst: int, group: Group) -> Work:
        """Sum members' ``tensor`` into world rank ``dst``'s, in place (others undefined
        unless :attr:`reduce_keeps_input`)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: Group,
                   src: torch.Tensor | None = None) -> Work:
        """Sum members' ``tensor`` in place on every member (``src``: sum members' ``src``
        into ``tensor``, same shape; a backend that can skips the copy)."""

    @abstractmethod
    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work:
        """Equal-sized ``tensor`` from each member into ``out`` (size * numel), group order
        (contiguous tensors of any shapes with these numbers of elements)."""

    @abstractmethod
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: Group) -> Work:
        """Sum members' ``inp`` (size * numel of ``out``) and keep this member's slot
        (contiguous tensors of any shapes)."""

    @abstractmethod
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], group: Group, even: bool = False) -> Work:
        """Uneven all-to-all of flat buffers: ``inp[in_splits[j]]`` goes to member ``j``.
        ``even``: every member sends every member the same count (the caller knows it for
        all members, so a backend may use its regular all-to-all on every rank alike)."""

    def prepare(self, kind: str, group: Group, root: int | None = None,
                splits: tuple[Sequence[int], Sequence[int], bool] | None = None
                ) -> Callable[..., None]:
        """A collective on ``group`` made ready once, to be run again and again (an
        operator keeps it): ``run(t)`` for ``kind`` "broadcast" (from ``root``),
        ``run(out, inp)`` for "all_reduce" (``out`` = the sum of the members' ``inp``),
        "all_gather", "reduce_scatter" and "all_to_all" (``splits``: its ``out_splits``,
        ``in_splits`` and ``even``); each posts the collective and waits. This one is the
        general method and :meth:`wait`; a backend may return a leaner one (MPI posts and
        polls its request with nothing in between)."""
        wait = self.wait
        if kind == "broadcast":
            return lambda t: wait([self.broadcast(t, root, group)])
        if kind == "all_to_all":
            o, i, even = splits
            return lambda out, inp: wait([self.all_to_all(out, inp, o, i, group, even)])
        if kind == "all_reduce":
            return lambda out, inp: wait([self.all_reduce(out, group, src=inp)])
        if kind == "all_gather":
            return lambda out, inp: wait([self.all_gather(out, inp, group)])
        if kind == "reduce_scatter":
            return lambda out, inp: wait([self.reduce_scatter(out, inp, group)])
        raise ValueError(f"no collective {kind!r}")

    def prepare_p2p(self, pattern: Sequence[tuple[str, int, int]]
                    ) -> Callable[[Sequence[torch.Tensor]], None]:
        """Point-to-point transfers of a fixed pattern made ready once, on tensors that may
        change from call to call (:meth:`p2p_program` is for fixed ones): ``run(tensors)``
        posts ``pattern[i] = (op, peer, tag)`` ("send" or "recv") on ``tensors[i]``, all at
        once, and waits. This one is :meth:`batch_p2p` and :meth:`wait`; MPI returns a
        leaner one."""
        post, wait = self.batch_p2p, self.wait

        def run(tensors: Sequence[torch.Tensor]) -> None:
            wait(post([P2P(op, t, peer, tag) for (op, peer, tag), t in zip(pattern, tensors)]))
        return run

    @abstractmethod
    def meta_all_gather(self, out: torch.Tensor, row: torch.Tensor, group: Group) -> Work:
        """All-gather of CPU int64 rows over the group's meta communicator."""

    # -- waiting ----------------------------------------------------------------
    def wait(self, works: Sequence[Work], what: str | None = None) -> None:
        """Wait for every work item (one deadline), then finish them in order."""
        if not works:
            return
        if len(works) == 1:  # the common case, kept cheap: it runs on every operator
            w = works[0]
            done, block, spin = w.done, w.block, w.spin
        else:
            works = list(works)

            def done() -> bool:
                return all(w.done() for w in works)

            blocking = [w for w in works if w.block is not None]

            def block_any(s: float) -> None:
                for w in blocking:
                    if not w.done():
                        w.block(s)
                        return

            block = block_any if blocking else None
            spin = any(w.spin for w in works)

        def label() -> str:
            return what or ", ".join(dict.fromkeys(label_text(w.what) for w in works))

        try:
            if self.control is None:  # before gpudist.init finished: a plain bounded wait
                from ..control import Control

                Control(None, self.rank, self.size, self.timeout).wait(
                    done, label, block=block, spin=spin)
            else:
                self.control.wait(done, label, block=block, spin=spin)
        except BaseException:
            left_in_flight(works)
            raise
        for w in works:
            w.finish()

    def barrier(self, group: Group | None = None) -> None:
        """Block until every member arrives (a zero-byte meta all-gather)."""
        g = group or self.group(range(self.size))
        if g.size <= 1:
            return
        row = torch.zeros(1, dtype=torch.int64)
        out = torch.empty(g.size, dtype=torch.int64)
        self.wait([self.meta_all_gather(out, row, g)], f"barrier over {list(g.ranks)}")

    def finalize(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""

    def release_in_flight(self) -> None:  # noqa: B027 - optional hook
        """An aborted world's exit: end the operations still open (gloo's point-to-point:
        close their connections), so that peers blocked in the matching waits wake now,
        and no wait returns into Python during the interpreter's teardown."""

    def abandon(self) -> None:  # noqa: B027 - optional hook
        """Leave the backend as it is for an exit after an error: a backend whose teardown
        would wait for an operation left in flight skips that teardown."""
