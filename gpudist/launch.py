"""Start N ranks on this machine and run functions on all of them.

* ``gloo`` (and ``nccl``): fork (or spawn) N processes that join through a ``FileStore``;
* ``mpi``: ``mpiexec -n N python -m gpudist.launch ...``, ranks joining with
  ``gpudist.init(backend="mpi")`` and connecting back here over a local socket.

A :class:`RankPool` is started once and runs many tasks: a task is a module-level
function (pickled by reference, so importable by the ranks) called on every rank; its
return values come back as a list indexed by rank. A task that fails on any rank raises
:class:`RankFailure` with every rank's error; one that does not finish in time, or whose
failure aborted the world, kills the pool (processes killed by pid / process group), and
the next :meth:`Cluster.pool` starts a fresh one. :func:`run` is the one-shot form (the
benches and examples use it); the test suite keeps pools in a :class:`Cluster`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

from .envvars import setting

DEFAULT_COMM_TIMEOUT_S = 60.0


def _comm_timeout(timeout: float | None) -> float:
    """A pool's world timeout: ``timeout``, else env ``GPUDIST_COMM_TIMEOUT`` (read when
    a pool starts, not at import: a bad value is an error of that call, not of
    ``import gpudist``), else 60 s."""
    return setting("GPUDIST_COMM_TIMEOUT", DEFAULT_COMM_TIMEOUT_S) if timeout is None \
        else timeout


@dataclass
class RankError:
    """What a rank raised: exception type name, message, traceback text."""

    type: str
    message: str
    traceback: str


class RankFailure(AssertionError):
    """A task failed on some ranks: ``errors`` maps rank -> :class:`RankError`."""

    def __init__(self, message: str, errors: dict[int, RankError] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (a venv with PyPI mpich), else on PATH."""
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.exists() else shutil.which("mpiexec")


# --------------------------------------------------------------------------- rank side
def _failure_scope():
    """A task runs in the control plane's failure scope, as a gpudist call does: what it
    raises on some ranks only (e.g. a local torch error in backward, outside any gpudist
    call) ends the world at once, as the excepthook does for an uncaught exception."""
    from contextlib import nullcontext

    from gpudist import runtime

    w = runtime._WORLD
    return w.control.scope("a task of the rank pool") if w is not None else nullcontext()


def serve(conn: Connection) -> None:
    """A rank's loop: run tasks until told to stop; report each result and whether the
    world is still usable (an aborted world ends the pool)."""
    import gpudist

    task = 0  # numbered alike on every rank: each task goes to all of them, in order
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        task += 1
        w = gpudist.runtime._WORLD
        if w is not None:
            w.control.task = task
        try:
            with _failure_scope():
                out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # report everything, keep serving
            out = ("err", RankError(type(e).__name__, str(e), traceback.format_exc()))
        w = gpudist.runtime._WORLD
        if w is not None and w.control.task == task and w.control.aborted is None:
            w.control.task_done()  # peers waiting for this rank in the task are told it
            # will not come (an aborted world has told them already, with the cause)
        alive = w is not None and w.control.aborted is None
        try:
            conn.send((*out, alive))
        except Exception as e:  # unpicklable result
            conn.send(("err", RankError(type(e).__name__, str(e), traceback.format_exc()),
                       alive))
        if not alive:
            break
    if gpudist.is_initialized() and gpudist.world().control.aborted is None:
        gpudist.finalize()


def _fork_main(rank: int, size: int, store_path: str, conn: Connection, backend: str,
               device: str, timeout: float, threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    import gpudist
    from gpudist import runtime

    torch.set_num_threads(threads)
    runtime.reset()  # never inherit the parent's world
    code = 0
    try:
        store = dist.FileStore(store_path, size)
        gpudist.init(backend=backend, device=device, rank=rank, world_size=size, store=store,
                     timeout=timeout)
        # tasks come once every rank is past init: a task failing on one rank must not
        # abort a peer still in init (seen in CI: rank 0 died of rank 1's task error in
        # init's settings exchange)
        conn.send("ready")
        serve(conn)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry of an ``mpiexec`` rank: ``python -m gpudist.launch HOST PORT KEY DEVICE
    TIMEOUT``."""
    host, port, key, device, timeout = (argv or sys.argv[1:])[:5]
    import torch

    import gpudist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    w = gpudist.init(backend="mpi", device=device, timeout=float(timeout))
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    conn.send(w.rank)
    serve(conn)
    if not gpudist.is_initialized():  # finalized cleanly: skip the interpreter's slow
        # teardown (torch's modules; 1-4 s a pool on 2 cores), as a forked rank does
        from mpi4py import MPI

        sys.stdout.flush()
        sys.stderr.flush()
        if not MPI.Is_finalized():
            MPI.Finalize()
        os._exit(0)


# --------------------------------------------------------------------------- pools
class RankPool:
    """N ranks waiting for tasks (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.conns: list[Connection] = []
        self._stopping = False

    def run(self, fn: Callable, *args, timeout: float = 300.0, expect_error: bool = False,
            **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results by rank.

        ``expect_error``: return each rank's :class:`RankError` (None where it succeeded)
        instead of raising.
        """
        if not self.conns:
            raise RankFailure("the rank pool is closed")
        self._check_sendable(fn)
        self._await_ready(timeout)
        for c in self.conns:
            c.send((fn, args, kwargs))
        results = self._receive_all(timeout, f"running {fn.__qualname__}")
        if not all(r[2] for r in results):  # an aborted world cannot run another task
            self.close(kill=True)
        errs = {i: r[1] for i, r in enumerate(results) if r[0] == "err"}
        if expect_error:
            return [r[1] if r[0] == "err" else None for r in results]
        if errs:
            text = "\n".join(f"--- rank {i}: {e.type}: {e.message}\n{e.traceback}"
                             for i, e in errs.items())
            raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errs)}:\n{text}", errs)
        return [r[1] for r in results]

    def _receive_all(self, timeout: float, doing: str) -> list:
        """One message from every rank, by rank, within ``timeout`` seconds; a rank that
        dies or is late kills the pool (``doing`` names what the ranks were doing)."""
        results: list = [None] * self.size
        pending = {c: i for i, c in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                raise TimeoutError(f"{self.size} ranks {doing}: ranks {sorted(pending.values())}"
                                   f" did not finish within {timeout}s (pool killed)")
            for c in ready:
                i = pending.pop(c)
                try:
                    results[i] = c.recv()
                except (EOFError, OSError):
                    self.close(kill=True)
                    raise RankFailure(f"rank {i} died {doing}") from None
        return results

    @property
    def alive(self) -> bool:
        return bool(self.conns)

    def _say_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass

    def close(self, kill: bool = False) -> None:
        raise NotImplementedError

    def _check_sendable(self, fn: Callable) -> None:
        """Functions go to the ranks by name; a pool whose ranks are not forks of this
        process finds them only in an importable module."""

    def _await_ready(self, timeout: float) -> None:
        """Wait (once) until every rank has started its world."""


class ForkPool(RankPool):
    """N ranks forked (or spawned) here, joined by gloo (or NCCL) through a FileStore."""

    def __init__(self, size: int, backend: str = "gloo", device: str = "cpu",
                 start: str = "fork", timeout: float | None = None,
                 threads: int = 1) -> None:
        super().__init__(size)
        timeout = _comm_timeout(timeout)
        ctx = mp.get_context(start)  # "spawn" for ranks that use CUDA (_start_method)
        if start == "fork":  # forked ranks share this import: torch.optim's first
            import torch._dynamo  # noqa: F401  (optimizer imports it, 1.4 s a rank)
        self._dir = tempfile.mkdtemp(prefix="gpudist-pool-")
        store = os.path.join(self._dir, "store")
        self.procs = []
        for r in range(size):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_fork_main,
                            args=(r, size, store, b, backend, device, timeout, threads),
                            daemon=True)
            p.start()
            b.close()
            self.procs.append(p)
            self.conns.append(a)
        self._ready = False

    def _await_ready(self, timeout: float) -> None:
        if self._ready:
            return
        self._receive_all(timeout, "starting its world (gpudist.init)")
        self._ready = True

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self, kill: bool = False) -> None:
        if not kill:
            self._say_stop()
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()
        self.conns = []
        shutil.rmtree(self._dir, ignore_errors=True)


class MPIPool(RankPool):
    """``mpiexec -n N`` ranks running :func:`worker_main`, connected back over a socket."""

    def __init__(self, size: int, device: str = "cpu", timeout: float | None = None,
                 threads: int = 1, pythonpath: Sequence[str] = (),
                 start_timeout: float = 120.0, connect: bool = True) -> None:
        """``connect=False``: start the ranks and return; :meth:`connect` waits for them
        (a pool runs tasks only once connected)."""
        super().__init__(size)
        timeout = _comm_timeout(timeout)
        exe = mpiexec()
        if exe is None:
            raise RankFailure("mpiexec not found (pip install mpich mpi4py)")
        key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key, backlog=max(128, size))
        host, port = self.listener.address
        path = [*pythonpath, os.getcwd(), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(p for p in path if p))
        self.proc = subprocess.Popen(
            [exe, "-n", str(size), sys.executable, "-m", "gpudist.launch", host, str(port),
             key.hex(), device, str(timeout)], env=env, start_new_session=True)
        # never hang if mpiexec fails to start: the accept has a deadline
        self.listener._listener._socket.settimeout(start_timeout)
        self._connected = False
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait until every rank has connected back (once)."""
        if self._connected:
            return
        self._connected = True
        conns: dict[int, Connection] = {}
        for _ in range(self.size):
            try:
                c = self.listener.accept()
            except OSError as e:
                self._kill()
                self.listener.close()
                raise RankFailure(f"mpiexec -n {self.size} did not start its ranks: {e}"
                                  ) from e
            conns[c.recv()] = c
        self.conns = [conns[i] for i in range(self.size)]

    def _check_sendable(self, fn: Callable) -> None:
        if getattr(fn, "__module__", None) == "__main__":
            raise RankFailure(
                f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__: ranks started "
                f"by mpiexec import the functions they run by module name, so define it in "
                f"a module (importable on PYTHONPATH, e.g. through pythonpath=[...])")

    def _kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self, kill: bool = False) -> None:
        if not self._connected:  # never used: nobody to tell
            kill = True
        if not kill:
            self._say_stop()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill = True
        if kill:
            self._kill()
        self.conns = []
        self.listener.close()


def start_pool(size: int, backend: str = "gloo", **kw) -> RankPool:
    """A pool of ``size`` ranks on ``backend``: "gloo", "nccl", "mpi", or "gloo-spawn" /
    "nccl-spawn" (spawned instead of forked). Ranks that use CUDA are always spawned."""
    if backend == "mpi":
        return MPIPool(size, **kw)
    kw.pop("pythonpath", None)
    if backend.endswith("-spawn"):
        return ForkPool(size, backend[:-len("-spawn")], start="spawn", **kw)
    return ForkPool(size, backend, start=_start_method(backend, kw.get("device", "cpu")),
                    **kw)


def _start_method(backend: str, device: str | None) -> str:
    """"spawn" for ranks that use CUDA (NCCL, a CUDA device, or "auto"/None where a GPU is
    present), else "fork". A forked child cannot use CUDA once this process has touched
    it, and ``torch.cuda.is_available()`` is enough for that while
    ``torch.cuda.is_initialized()`` still says False (seen on an H200: the GPU bench forked,
    and every rank died in its first CUDA call)."""
    import torch

    if backend == "nccl" or str(device).startswith("cuda"):
        return "spawn"
    if device is None or str(device) == "auto":
        return "spawn" if torch.cuda.is_available() else "fork"
    return "fork"


class Cluster:
    """Pools by (backend, size), started on first use and kept until :meth:`close`.

    An MPI pool started a second time (its world ended by a test that aborts it on
    purpose) gets a spare started beside it, ready for the next time (an MPI pool takes
    1-3 s to start; a forked one milliseconds)."""

    def __init__(self, **pool_kw) -> None:
        self.pools: dict[tuple[str, int], RankPool] = {}
        self.spares: dict[tuple[str, int], MPIPool] = {}
        self.starts: dict[tuple[str, int], int] = {}
        self.pool_kw = pool_kw

    def pool(self, size: int, backend: str = "gloo") -> RankPool:
        key = (backend, size)
        p = self.pools.get(key)
        if p is None or not p.alive:
            spare = self.spares.pop(key, None)
            if spare is not None:
                spare.connect()
                p = spare
            else:
                p = start_pool(size, backend, **self.pool_kw)
            self.pools[key] = p
            self.starts[key] = self.starts.get(key, 0) + 1
            if backend == "mpi" and self.starts[key] > 1:
                self.spares[key] = MPIPool(size, connect=False, **self.pool_kw)
        return p

    def run(self, size: int, fn: Callable, *args, backend: str = "gloo", **kwargs) -> list:
        return self.pool(size, backend).run(fn, *args, **kwargs)

    def discard(self, size: int, backend: str = "gloo") -> None:
        """Kill a pool (e.g. after a test that aborts its world on purpose)."""
        p = self.pools.pop((backend, size), None)
        if p is not None and p.alive:
            p.close(kill=True)

    def close(self) -> None:
        """Stop every pool: all are told to stop first, so their ranks wind down together
        (an MPI pool's MPI_Finalize and interpreter exit take 1-4 s)."""
        live = [p for p in self.pools.values() if p.alive]
        for p in live:
            p._say_stop()
        for p in [*live, *self.spares.values()]:
            p.close()
        self.pools.clear()
        self.spares.clear()


def run(fn: Callable, size: int, *args, backend: str = "gloo", timeout: float = 3600.0,
        **kwargs) -> list:
    """Start ``size`` ranks, run ``fn(*args, **kwargs)`` on each, stop them; the results by
    rank. Pool options (``device``, ``threads``, ``pythonpath`` for MPI, the communication
    ``comm_timeout``) go in ``kwargs`` under those names."""
    pool_kw = {k: kwargs.pop(k) for k in ("device", "threads", "pythonpath") if k in kwargs}
    if "comm_timeout" in kwargs:
        pool_kw["timeout"] = kwargs.pop("comm_timeout")
    pool = start_pool(size, backend, **pool_kw)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if pool.alive:
            pool.close()


if __name__ == "__main__":  # run the module by its real name, so results pickle by it
    from gpudist.launch import worker_main as _main

    _main()
