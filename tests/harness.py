"""Rank pools for multi-rank tests: started once per (backend, world size), reused by tests.

* gloo pools fork N workers (OMP_NUM_THREADS=1) that join a gloo group through a FileStore;
* MPI pools run ``mpiexec -n N python -m tests.mpi_worker`` whose ranks join with
  ``gpudist.init(backend="mpi")`` from the launcher's environment and connect back here.

A task is a module-level function (pickled by reference) run on every rank; its return
values come back as a list indexed by rank. A task that fails on any rank raises
:class:`RankFailure` with every rank's traceback; one that does not finish in time kills the
pool (it is restarted on next use) and raises :class:`TimeoutError`.
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
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMM_TIMEOUT_S = float(os.environ.get("GPUDIST_TEST_COMM_TIMEOUT", "60"))


@dataclass
class RankError:
    """What a rank raised: exception type name, message, traceback text."""

    type: str
    message: str
    traceback: str


class RankFailure(AssertionError):
    pass


def serve(conn: Connection) -> None:
    """Worker loop: run tasks until told to stop."""
    import gpudist

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # report everything, keep serving
            out = ("err", RankError(type(e).__name__, str(e), traceback.format_exc()))
        try:
            conn.send(out)
        except Exception as e:  # unpicklable result
            conn.send(("err", RankError(type(e).__name__, str(e), traceback.format_exc())))
    gpudist.finalize()


def _fork_main(rank: int, size: int, store_path: str, conn: Connection) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    import gpudist
    from gpudist import runtime

    torch.set_num_threads(1)
    runtime._WORLD = None  # never inherit the parent's world
    store = dist.FileStore(store_path, size)
    gpudist.init(backend="gloo", device="cpu", rank=rank, world_size=size, store=store,
                 timeout=COMM_TIMEOUT_S)
    serve(conn)
    os._exit(0)


class Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.conns: list[Connection] = []

    def run(self, fn, *args, timeout: float = 120.0, expect_error: bool = False, **kwargs):
        for c in self.conns:
            c.send((fn, args, kwargs))
        results: list = [None] * self.size
        pending = {c: i for i, c in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, left))
            if not ready:
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__qualname__} on {self.size} ranks: ranks {sorted(pending.values())} "
                    f"did not finish within {timeout}s (pool killed)"
                )
            for c in ready:
                i = pending.pop(c)
                try:
                    results[i] = c.recv()
                except EOFError:
                    self.close(kill=True)
                    raise RankFailure(f"rank {i} died running {fn.__qualname__}") from None
        errs = {i: r[1] for i, r in enumerate(results) if r[0] == "err"}
        if expect_error:
            return [r[1] if r[0] == "err" else None for r in results]
        if errs:
            text = "\n".join(f"--- rank {i}: {e.type}: {e.message}\n{e.traceback}"
                             for i, e in errs.items())
            raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errs)}:\n{text}")
        return [r[1] for r in results]

    @property
    def alive(self) -> bool:
        return bool(self.conns)

    def close(self, kill: bool = False) -> None:
        raise NotImplementedError


class ForkPool(Pool):
    """N forked gloo ranks."""

    def __init__(self, size: int, start: str = "fork") -> None:
        super().__init__(size)
        ctx = mp.get_context(start)  # "spawn" where the parent already holds a CUDA context
        self._dir = tempfile.mkdtemp(prefix="gpudist-pool-")
        store = os.path.join(self._dir, "store")
        self.procs = []
        for r in range(size):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_fork_main, args=(r, size, store, b), daemon=True)
            p.start()
            b.close()
            self.procs.append(p)
            self.conns.append(a)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join()
        self.conns = []
        shutil.rmtree(self._dir, ignore_errors=True)


def mpiexec() -> str | None:
    cand = Path(sys.executable).parent / "mpiexec"
    if cand.exists():
        return str(cand)
    return shutil.which("mpiexec")


class MPIPool(Pool):
    """``mpiexec -n N`` ranks running tests.mpi_worker, connected back over a socket."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        exe = mpiexec()
        if exe is None:
            raise RuntimeError("mpiexec not found")
        key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key, backlog=128)
        host, port = self.listener.address
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [exe, "-n", str(size), sys.executable, "-m", "tests.mpi_worker", host, str(port),
             key.hex()],
            cwd=ROOT, env=env, start_new_session=True,
        )
        conns: dict[int, Connection] = {}
        # never hang if mpiexec fails to start: the accept has a deadline
        self.listener._listener._socket.settimeout(float(os.environ.get(
            "GPUDIST_TEST_MPI_START_TIMEOUT", "120")))
        for _ in range(size):
            try:
                c = self.listener.accept()
            except OSError as e:
                if self.proc.poll() is None:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.listener.close()
                raise RuntimeError(f"mpiexec -n {size} did not start its ranks: {e}") from e
            conns[c.recv()] = c
        self.conns = [conns[i] for i in range(size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill = True
        if kill and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.conns = []
        self.listener.close()


class Cluster:
    """Pools by (backend, size), created on first use and kept for the session."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, int], Pool] = {}

    def pool(self, size: int, backend: str = "gloo") -> Pool:
        key = (backend, size)
        p = self.pools.get(key)
        if p is None or not p.alive:
            if backend == "mpi":
                p = MPIPool(size)  # kept alive: restarting mpiexec costs seconds
            elif backend == "gloo-spawn":
                p = ForkPool(size, start="spawn")
            else:
                p = ForkPool(size)
            self.pools[key] = p
        return p

    def run(self, size: int, fn, *args, backend: str = "gloo", **kwargs):
        return self.pool(size, backend).run(fn, *args, **kwargs)

    def discard(self, size: int, backend: str = "gloo") -> None:
        """Close a pool whose transport state a test has broken (e.g. after a timeout)."""
        p = self.pools.pop((backend, size), None)
        if p is not None and p.alive:
            p.close(kill=True)

    def close(self) -> None:
        for p in self.pools.values():
            if p.alive:
                p.close()
        self.pools.clear()
