"""The control plane: how a failure on one rank reaches every rank, and how a wait that
takes too long finds out why.

Every world has a small key-value store beside its data backend (the torch ``Store`` that
rendezvous used, or one rank 0 serves for MPI). It carries three things, none of them on
the data path of a healthy program:

* ``abort``: the first error any rank posts (its rank, type and message). Every wait polls
  it (after ~5 ms, then every 20 ms), so a rank blocked in a collective raises
  :class:`~gpudist.errors.RemoteError` naming the failing rank within milliseconds.
* ``state/<rank>``: what a rank is waiting in, published only when a wait has lasted
  ``diag_after`` seconds. Peers compare: two ranks waiting in the same group at the same
  point (sequence number) in different operators is a :class:`~gpudist.errors.MismatchError`
  (a rank skipped a layer, a shape change seen by some ranks only); a timeout names the
  ranks that never arrived and where they were last seen.
* nothing else: metadata (shapes, fingerprints) travels over each group's own meta
  communicator (:mod:`gpudist.meta`).

:meth:`Control.op` numbers the operators each group runs (the same numbers on every member
of a consistent program); :meth:`Control.wait` is the one wait loop every transport uses.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .envvars import setting
from .errors import (
    CommTimeout,
    MismatchError,
    RemoteError,
    WorldAborted,
    WorldFinalized,
    is_everywhere,
)

ABORT_FIRST_CHECK_S = 0.005
ABORT_EVERY_S = 0.02
SPIN_S = 0.04  # a spinning wait (MPI) polls this long before it naps
HOT_SPIN_S = 5e-5  # ... the first this long without yielding, where ranks fit the cores
NAP_MAX_S = 1e-4  # the longest nap between two polls (MPI moves data only while polled)
HISTORY = 64  # operators remembered per group for the diagnostics
HISTORY_MASK = (1 << 62) - 1  # (a group's history hash fits a metadata row's int64)
TASK_DONE_OPS = 8  # a pool rank's last operators per group published when its task ends
DEFAULT_DIAG_AFTER_S = 2.0  # (env GPUDIST_DIAG_AFTER, read by each Control)


class Op(NamedTuple):
    """One operator instance on one group: ``seq`` counts the group's operators;
    ``needs_all``: it cannot complete without every member (a collective; a halo exchange
    needs only neighbours). A named tuple: one is made on every call of every operator."""

    group: tuple[int, ...]
    seq: int
    what: str
    fingerprint: int
    needs_all: bool = True


_new_op = functools.partial(tuple.__new__, Op)
_ident = threading.get_ident

Label = str | Callable[[], str]


def label_text(what: Label) -> str:
    """The text of a label given as a string or as a function making it."""
    return what if isinstance(what, str) else what()


def _control_flow() -> tuple[type, ...]:
    """Exceptions torch raises through user code to steer it, not failures: non-reentrant
    activation checkpointing stops a recomputation early with one."""
    try:
        from torch.utils.checkpoint import _StopRecomputationError
    except ImportError:  # pragma: no cover - another torch
        return ()
    return (_StopRecomputationError,)


_CONTROL_FLOW = _control_flow()


class _Scope:
    """``with control.scope(where)``: an error not every rank raises is posted (a class,
    not a generator: it runs on every call of every operator)."""

    __slots__ = ("control", "where")

    def __init__(self, control: Control, where: str) -> None:
        self.control, self.where = control, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if e is not None:
            self.control.failed(e, self.where)
        return False


class _Numbered:
    """``with control.op(...) as op``: ``op`` is the current operator while inside."""

    __slots__ = ("control", "op", "prev")

    def __init__(self, control: Control, op: Op) -> None:
        self.control, self.op, self.prev = control, op, None

    def __enter__(self) -> Op:
        self.prev = self.control.make_current(self.op)
        return self.op

    def __exit__(self, kind, e, tb) -> bool:
        self.control._op = self.prev
        return False


class Control:
    """Abort flag, op numbering, diagnostics and the shared wait loop of one rank.

    ``store`` is a torch ``Store`` shared by every rank (None: a world of one).
    """

    def __init__(self, store, rank: int, size: int, timeout: float,
                 diag_after: float | None = None) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timeout
        self.diag_after = (setting("GPUDIST_DIAG_AFTER", DEFAULT_DIAG_AFTER_S)
                           if diag_after is None else diag_after)
        self.aborted: BaseException | None = None
        self._seq: dict[tuple[int, ...], int] = {}
        # a hash of each group's operators so far, in order (their fingerprints): equal on
        # every member of a program that runs alike; the call checks compare it, so an
        # operator skipped, added or swapped on some ranks since the last check is found
        self._history: dict[tuple[int, ...], int] = {}
        # the last HISTORY operators of each group (ring by sequence number): a peer stuck
        # at an operator number this rank has passed is checked against what ran here
        self._past: dict[tuple[int, ...], list[Op | None]] = {}
        self._op: Op | None = None
        self._thread = 0  # the thread that made _op current (one thread at a time)
        self._scopes: dict[str, _Scope] = {}
        self.waits = 0  # waits that did not complete at once (for tests and benches)
        # the number of the launch pool's task this rank runs (gpudist.launch.serve; the
        # same on every rank), None outside a pool: a peer that finished this task without
        # reaching an operator this rank waits in never will
        self.task: int | None = None
        # an error a helper thread raised for a wait of this rank's (the gloo point-to-point
        # watch) that the caller may never have seen (its wait had completed meanwhile):
        # the caller's next call raises it, not a WorldAborted that only wraps it
        self.undelivered: BaseException | None = None
        self.spin_s = setting("GPUDIST_SPIN_S", SPIN_S)
        self.nap_max_s = setting("GPUDIST_NAP_MAX_S", NAP_MAX_S)
        # set by gpudist.init where this host's ranks fit its cores (no peer to yield to)
        self.hot_spin_s = 0.0
        # the rank whose process serves the store (MPI: rank 0; None: the launcher's or
        # a file): set by gpudist.init
        self.store_server: int | None = None

    # -- which peers still run ----------------------------------------------------------
    def register_process(self) -> None:
        """Publish this rank's host and process id (so that a peer seeing a connection
        closed can tell which rank is gone)."""
        if self.store is not None:
            self.store.set(f"proc/{self.rank}", f"{socket.gethostname()} {os.getpid()}")

    def gone(self) -> list[int]:
        """The ranks on this host whose process no longer runs (exited, killed, a zombie);
        ranks on other hosts are not known."""
        out: list[int] = []
        if self.store is None:
            return out
        host = socket.gethostname()
        for r in range(self.size):
            if r == self.rank:
                continue
            key = f"proc/{r}"
            try:  # (get waits for a key not yet set: checked first)
                if not self.store.check([key]):
                    continue
                where, pid = self.store.get(key).decode().rsplit(" ", 1)
            except Exception:  # noqa: BLE001 - unknown: not named
                continue
            if where == host and not _running(int(pid)):
                out.append(r)
        return out

    # -- the abort flag -----------------------------------------------------------------
    def abort(self, exc: BaseException, where: str = "") -> None:
        """Post ``exc`` as this rank's failure (first poster wins) and stop this world."""
        if self.aborted is not None:
            return
        self.aborted = exc
        if self.store is None:
            return
        msg = str(exc) + (f" (in {where})" if where else "")
        try:
            if self.store.add("abort_n", 1) == 1:
                self.store.set("abort", json.dumps(
                    {"rank": self.rank, "kind": type(exc).__name__, "message": msg}))
            self._seen()
        except Exception:  # the store is gone too: nothing more to tell
            pass

    def _seen(self) -> None:
        """Tell the store's server that this rank knows the world aborted (it waits for
        that before it leaves: :meth:`linger`)."""
        self.store.set(f"seen/{self.rank}", "1")

    def linger(self, limit: float) -> None:
        """The store's server leaving an aborted world: wait, up to ``limit`` seconds,
        until every peer has seen the failure or left this host, so that a peer waiting
        in an operator reads the failure (a ``RemoteError`` naming it) instead of finding
        the store gone. Elsewhere a no-op."""
        if self.store_server != self.rank or self.store is None or self.aborted is None:
            return
        deadline = time.monotonic() + limit
        try:
            while time.monotonic() < deadline:
                gone = set(self.gone())
                left = [f"seen/{r}" for r in range(self.size) if r != self.rank and
                        r not in gone]
                if not left or self.store.check(left):
                    return
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - best effort: the exit goes on
            pass

    def failed(self, e: BaseException, where: str) -> None:
        """``e`` ends a call in ``where``: posted unless every rank raises it alike (what
        :meth:`scope` does; for the hot paths that catch instead of entering a scope).
        A KeyboardInterrupt is posted too: the call stopped half-way here (its peers wait
        for it, and a receive it left posted would take a later call's message)."""
        if not is_everywhere(e) and not isinstance(e, (GeneratorExit, *_CONTROL_FLOW)):
            self.abort(e, where)

    def close(self) -> None:
        """The world was finalized: every later call raises :class:`WorldFinalized`."""
        if self.aborted is None:
            self.aborted = WorldFinalized(
                "gpudist.finalize() was called: the layers, primitives and partitions of "
                "that world cannot communicate any more (after gpudist.init(), build new "
                "ones)")

    def ensure_alive(self) -> None:
        """Raise at once if this world was aborted (no communication after a failure) or
        finalized: the error itself where a helper thread found it and the caller has not
        raised it yet (:attr:`undelivered`), else a :class:`WorldAborted` naming it."""
        if self.aborted is not None:
            u, self.undelivered = self.undelivered, None
            if u is self.aborted and not getattr(u, "_gpudist_delivered", False):
                u._gpudist_delivered = True
                raise u.with_traceback(None)
            e = self.aborted
            if isinstance(e, WorldFinalized):
                raise WorldFinalized(str(e))
            if isinstance(e, RemoteError):
                raise WorldAborted(f"the world was aborted: {e}") from e
            raise WorldAborted(f"the world was aborted after this rank's "
                               f"{type(e).__name__}: {e}") from e

    def poll_abort(self, where: str = "") -> None:
        """Raise :class:`RemoteError` if some rank posted a failure."""
        if self.store is None or self.aborted is not None:
            self.ensure_alive()
            return
        try:
            if not self.store.check(["abort"]):
                return
            info = json.loads(self.store.get("abort"))
        except Exception as e:  # noqa: BLE001 - the store's server left
            err = CommTimeout(self._store_gone(where, e))
            self.aborted = err
            raise err from None
        err = RemoteError(int(info["rank"]), info["kind"], info["message"], where)
        self.aborted = err
        try:
            self._seen()
        except Exception:  # noqa: BLE001 - it told us; it may be leaving
            pass
        raise err

    def _store_gone(self, where: str, e: BaseException) -> str:
        who = (f"rank {self.store_server}, which serves it," if self.store_server is not None
               else "the process serving it (rank 0 or the launcher)")
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        return (f"{where}: the control plane's store cannot be reached: {who} has left "
                f"(exited, crashed or killed; what it failed with, if anything, is not "
                f"known here) ({first})")

    def scope(self, where: str) -> _Scope:
        """Errors raised inside that not every rank raises are posted to the world (the
        scope of a ``where`` is made once: it runs on every call of every operator)."""
        if self.aborted is not None:
            self.ensure_alive()
        s = self._scopes.get(where)
        if s is None:
            s = _Scope(self, where)
            if len(self._scopes) < 1024:
                self._scopes[where] = s
        return s

    # -- operator numbering ---------------------------------------------------------------
    def op(self, group: Sequence[int], what: str, fingerprint: int = 0,
           needs_all: bool = True) -> _Numbered:
        """Number one operator on ``group`` (every member calls it, in program order):
        ``with control.op(...)`` makes it the current operator while inside."""
        key = group if type(group) is tuple else tuple(group)
        return _Numbered(self, self._number(key, what, fingerprint, needs_all))

    def numberer(self, key: tuple[int, ...], what: str, fingerprint: int, needs_all: bool
                 ) -> Callable[[], Op | None]:
        """:meth:`op` without the context object, for the calls of one operator and
        direction (a primitive's plan keeps it: the hot path), its arguments bound once:
        ``prev = begin()`` numbers the operator and makes it current; the caller puts the
        previous operator back (``control._op = prev``) when it ends."""
        number = self._number

        def begin() -> Op | None:
            return self.make_current(number(key, what, fingerprint, needs_all))
        return begin

    def make_current(self, op: Op) -> Op | None:
        """Make ``op`` the current operator (returned: the previous one, which the caller
        puts back). Refused where another thread's operator runs: gpudist's state --
        numbering, pooled buffers, the backends' requests -- is one rank's, used by one
        thread at a time (two at once crashed MPI and gloo, or mixed two layers' outputs,
        in a fuzz)."""
        prev = self._op
        if prev is not None and self._thread != _ident():
            self._concurrent(op.what)
        self._op, self._thread = op, _ident()
        return prev

    def _concurrent(self, what: str) -> None:
        raise RuntimeError(
            f"gpudist called from two threads at once: rank {self.rank} began {what} on "
            f"thread {threading.current_thread().name} while another thread runs "
            f"{self._op.what if self._op else 'an operator'} (gpudist's calls must come "
            f"from one thread at a time: run them on one thread, or hold a lock around "
            f"each call, forward and backward)")

    def _number(self, key: tuple[int, ...], what: str, fingerprint: int, needs_all: bool
                ) -> Op:
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        hist = self._history
        hist[key] = (hist.get(key, 0) * 1000003 + fingerprint) & HISTORY_MASK
        op = _new_op((key, seq, what, fingerprint, needs_all))  # Op(...) without its
        # Python-level __new__
        past = self._past.get(key)
        if past is None:
            past = self._past[key] = [None] * HISTORY
        past[seq % HISTORY] = op
        return op

    def count(self, group: tuple[int, ...]) -> int:
        """How many operators this rank has run on ``group``."""
        return self._seq.get(group, 0)

    def history(self, group: tuple[int, ...]) -> int:
        """The hash of the operators this rank has run on ``group``, in order."""
        return self._history.get(group, 0)

    # -- the wait loop --------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], what: Label, timeout: float | None = None,
             block: Callable[[float], object] | None = None, spin: bool = False) -> None:
        """Return when ``done()``; meanwhile watch for aborts, mismatches and the timeout.

        ``block(s)`` blocks up to ``s`` seconds for progress (e.g. an Event); without it the
        loop sleeps with backoff, or, when ``spin`` (MPI needs its progress engine driven
        by ``done()``), polls yielding the core for ``spin_s`` (env ``GPUDIST_SPIN_S``; the
        first ``hot_spin_s`` without yielding, where each rank has a core) and then naps up
        to ``nap_max_s`` (``GPUDIST_NAP_MAX_S``) between polls. ``what`` (a string, or a
        function making it: only a slow wait needs the text) names the wait in errors.
        """
        if self.aborted is not None:
            self.ensure_alive()
        if done():
            return
        self.waits += 1
        total = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        next_abort, next_diag = t0 + ABORT_FIRST_CHECK_S, t0 + self.diag_after
        nap, published, ok, now = 0.0, False, False, t0
        # a spinning wait (MPI: data moves only while polled) polls for spin_s, then naps
        # up to nap_max_s; the others nap from the start, up to 1 ms
        spin_until, nap_max = (t0 + self.spin_s, self.nap_max_s) if spin else (t0, 1e-3)
        hot_until = t0 + self.hot_spin_s
        try:
            while True:
                if block is not None:
                    block(0.01)
                elif now < spin_until:  # drive the progress engine, yielding the core
                    if now >= hot_until:  # (a sched_yield costs a small message ~1 us)
                        os.sched_yield()
                else:  # a long wait: nap, so that a peer sharing this core can run
                    time.sleep(nap)
                    nap = min(nap_max, nap * 2 + 1e-5)
                if done():
                    ok = True
                    return
                now = time.monotonic()
                if now >= next_abort:  # the label's text is made only from here on
                    what = label_text(what)
                    self.poll_abort(what)
                    next_abort = now + ABORT_EVERY_S
                if now >= next_diag:
                    published = True
                    what = label_text(what)
                    self._diagnose(what, t0)
                    next_diag = now + 1.0
                if now - t0 >= total:
                    what = label_text(what)
                    err = CommTimeout(self._timeout_message(what, total))
                    self.abort(err, what)
                    raise err
        finally:
            if published and ok:  # a failed wait stays published (peers' messages name it)
                self._publish(None, t0)

    # -- diagnostics ----------------------------------------------------------------------
    def _publish(self, op: Op | None, since: float) -> None:
        if op is None:
            self._put_state({"idle": True})
        else:
            self._put_state({"group": list(op.group), "seq": op.seq, "what": op.what,
                             "fp": op.fingerprint, "needs_all": op.needs_all,
                             "waited": time.monotonic() - since, "counts": self._counts()})

    def task_done(self) -> None:
        """Publish that this rank's function of pool task ``self.task`` returned, with its
        operator counts and its last few operators per group (a peer still waiting for it
        there is told at its diagnosis)."""
        if self.task is None:
            return
        last = [[list(g), op.seq, op.fingerprint, op.what]
                for g, n in self._seq.items() for op in self._past[g]
                if op is not None and op.seq > n - TASK_DONE_OPS]
        self._put_state({"idle": True, "task_done": self.task, "counts": self._counts(),
                         "last": last})

    def _put_state(self, state: dict) -> None:
        """This rank's state for its peers' diagnostics (best effort)."""
        if self.store is None:
            return
        try:
            self.store.set(f"state/{self.rank}", json.dumps(state))
        except Exception:  # noqa: BLE001 - a diagnostic only
            pass

    def _counts(self) -> list:
        """How many operators this rank ran per group, as published."""
        return [[list(g), n] for g, n in self._seq.items()]

    @staticmethod
    def _their_counts(st: dict) -> dict[tuple[int, ...], int]:
        """A peer's published counts, by group."""
        return {tuple(g): n for g, n in st.get("counts", [])}

    def _finished_peer(self, r: int, st: dict, op: Op, what: str) -> None:
        """Peer ``r`` finished this pool task: a mismatch if it never reached ``op``, or
        ran another operator at its number."""
        theirs = self._their_counts(st)
        where = f"{op.what} (operator #{op.seq} of group {list(op.group)})"
        if theirs.get(op.group, 0) < op.seq:
            self._mismatch(what, f"rank {r} finished its task (the function returned) "
                                 f"without reaching {where}, which rank {self.rank} waits in")
        ran = next((x for x in st.get("last", []) if tuple(x[0]) == op.group
                    and x[1] == op.seq), None)
        if ran is not None and ran[2] != op.fingerprint:
            self._mismatch(what, f"rank {r} ran {ran[3]} as operator #{op.seq} of group "
                                 f"{list(op.group)} and finished its task (the function "
                                 f"returned), where rank {self.rank} waits in {op.what}")

    def _peer_states(self, ranks: Sequence[int]) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        for r in ranks:
            if r == self.rank:
                continue
            key = f"state/{r}"
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                out[r] = None
        return out

    def _diagnose(self, what: str, since: float) -> None:
        """Publish this wait; raise :class:`MismatchError` if a peer of the same group is
        waiting at the same point of the group's program in a different operator."""
        op = self._op
        if self.store is None or op is None:
            return
        self._publish(op, since)
        for r, st in self._peer_states(op.group).items():
            if st and self.task is not None and st.get("task_done") == self.task:
                self._finished_peer(r, st, op, what)
                continue
            if not st or "group" not in st:
                continue
            self._check_passed(r, st, what)
            same_group = tuple(st["group"]) == op.group
            if same_group and st["seq"] == op.seq and st["fp"] != op.fingerprint:
                self._mismatch(what, f"ranks disagree at operator #{op.seq} of group "
                                     f"{list(op.group)}: rank {self.rank} runs {op.what}, "
                                     f"rank {r} runs {st['what']}")
            if not same_group and self._deadlocked(op, st):
                self._mismatch(what, f"rank {self.rank} waits for rank {r} in {op.what} "
                                     f"(operator #{op.seq} of group {list(op.group)}), while "
                                     f"rank {r} waits in {st['what']} (operator #{st['seq']} "
                                     f"of group {st['group']}), which needs this rank, who has "
                                     f"not reached it")
        cycle = self._wait_cycle(op)
        if cycle:
            self._mismatch(what, "a deadlock: " + "; ".join(
                f"rank {x} waits for rank {y} in {w} (operator #{n} of group {list(g)})"
                for x, y, w, n, g in cycle) + " (operators of overlapping groups called in "
                "orders that cross)")

    def _check_passed(self, r: int, st: dict, what: str) -> None:
        """A peer waiting at an operator number this rank has passed, where this rank ran
        another operator (e.g. a rank checking a changed input with its peers while they
        went on into the data exchange, which completed without it). Passed includes the
        last operator this rank ran on that group (its count equals the peer's number): a
        data exchange that completed at once here (no neighbours) is often that one; not
        the operator this rank waits in."""
        g, seq = tuple(st["group"]), st["seq"]
        past = self._past.get(g)
        mine = past[seq % HISTORY] if past is not None and self._seq.get(g, 0) >= seq else None
        if mine is not None and mine is not self._op and mine.seq == seq \
                and mine.fingerprint != st["fp"]:  # (the current one: _diagnose's check)
            self._mismatch(what, f"rank {r} waits in {st['what']} (operator #{seq} of group "
                                 f"{list(g)}), where rank {self.rank} ran {mine.what}")

    def _wait_cycle(self, op: Op) -> list[tuple] | None:
        """A cycle of ranks, each blocked (past ``diag_after``) in a collective that waits
        for every member (not one marked "some": a broadcast's receiver waits for its
        root alone) and that the next has not reached, back to this rank: none can ever
        complete. [(rank, the rank it waits for, operator, number,
        group), ...] from this rank, or None. Reads the states of the ranks on the way."""
        if op.needs_all is not True:  # ("some": a member may wait for some alone)
            return None
        states: dict[int, dict | None] = {}
        counts: dict[int, dict] = {}

        def state(r: int) -> dict | None:
            if r not in states:
                states[r] = self._peer_states([r]).get(r)
            return states[r]

        def blocked_in(r: int):  # (group, seq, what, counts) of a rank blocked in a
            if r == self.rank:  # collective, or None
                return op.group, op.seq, op.what, dict(self._seq)
            st = state(r)
            if (not st or "group" not in st or st.get("needs_all") is not True
                    or st.get("waited", 0) < self.diag_after):
                return None
            if r not in counts:
                counts[r] = self._their_counts(st)
            return tuple(st["group"]), st["seq"], st["what"], counts[r]

        seen = {self.rank}  # (one set for the whole search: each rank is left once)

        def search(r: int, path: list) -> list | None:
            here = blocked_in(r)
            if here is None:
                return None
            g, seq, w, _ = here
            for q in g:
                if q == r:
                    continue
                there = blocked_in(q)
                if there is None or there[3].get(g, 0) >= seq or there[0] == g:
                    continue  # q is not blocked elsewhere, or reached this operator
                step = path + [(r, q, w, seq, g)]
                if q == self.rank:
                    return step
                if q not in seen:
                    seen.add(q)
                    found = search(q, step)
                    if found:
                        return found
            return None

        return search(self.rank, [])

    def _deadlocked(self, op: Op, st: dict) -> bool:
        """A peer blocked in a collective I have not reached, while it has not reached
        mine: neither can ever complete."""
        g = tuple(st["group"])
        if not st.get("needs_all") or self.rank not in g:
            return False
        if self._seq.get(g, 0) >= st["seq"]:
            return False  # I have been there
        theirs = self._their_counts(st)
        return theirs.get(op.group, 0) < op.seq and st.get("waited", 0) >= self.diag_after

    def _mismatch(self, what: str, text: str) -> None:
        self.poll_abort(what)  # a failure posted first wins (a peer whose task failed
        # still publishes its counts: read as "finished", they would name a wrong cause)
        err = MismatchError(
            f"{text} (programs that differ between ranks: a layer or partition skipped or "
            f"added on some ranks, or an input whose shape, spec, dtype or requires_grad "
            f"differs on some ranks only, e.g. torch.autocast or no_grad on some ranks, or a "
            f"layer changed on some ranks)")
        self.abort(err, what)
        raise err

    def _timeout_message(self, what: str, total: float) -> str:
        op = self._op
        msg = f"{what} did not complete within {total:.1f}s on rank {self.rank}"
        if op is None or self.store is None:
            return msg
        lines = []
        try:
            gone = set(self.gone())
        except Exception:  # noqa: BLE001 - the store may be gone too
            gone = set()
        for r, st in self._peer_states(op.group).items():
            if r in gone:
                lines.append(f"rank {r}: its process no longer runs (exited, crashed or "
                             f"killed)")
            elif not st or st.get("idle"):
                lines.append(f"rank {r}: not waiting in any gpudist operator (busy, stuck "
                             f"outside gpudist, or gone)")
            elif tuple(st.get("group", ())) == op.group and st.get("seq") == op.seq:
                lines.append(f"rank {r}: waiting in the same operator")
            else:
                lines.append(f"rank {r}: waiting in {st.get('what')} (operator #{st.get('seq')}"
                             f" of group {st.get('group')})")
        return (f"{msg} (operator #{op.seq} of group {list(op.group)}: {op.what}); "
                + "; ".join(lines))


def format_exception(exc: BaseException) -> str:
    """One line for an error posted to the world (type, message, innermost frame)."""
    tb = traceback.extract_tb(exc.__traceback__)
    at = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
