"""Joining the job: launcher detection, device and backend choice, init/finalize.

``init()`` reads the environment of ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR),
``mpiexec``/``mpirun`` (MPICH/Hydra ``PMI_*``, Open MPI ``OMPI_COMM_WORLD_*``) or Slurm
``srun`` (``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``/``SLURM_LOCALID``, master = first host
of the node list), or runs as a world of one. The resulting :class:`World` is the process
group: the only process-wide state gpudist keeps.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .control import HOT_SPIN_S, Control
from .envvars import check_all, setting
from .errors import DeviceError, GpudistError, LaunchError
from .transport.base import Transport


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher told it."""

    launcher: str  # "torchrun" | "mpi" | "slurm" | "none"
    rank: int
    size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def _int(env: Mapping[str, str], *keys: str, default: int | None = None) -> int | None:
    for k in keys:
        if env.get(k, "") != "":
            return int(env[k])
    return default


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _srun_started(env: Mapping[str, str], rank_key: str, size_key: str) -> bool:
    """Whether srun itself started this task (its PMI rank/size are the step's task rank/size).

    ``mpiexec`` inside an allocation starts its proxies with srun (a step of one task per
    node), so there every rank sees SLURM_STEP_ID and SLURM_PROCID=0: the rank must come
    from PMI. Under ``srun --mpi=pmi2`` PMI and the step agree, and Slurm's view is used.
    """
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return False
    step_size = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    pmi_size = env.get(size_key) or env.get("PMI_SIZE")
    return env.get(rank_key) == env["SLURM_PROCID"] and (pmi_size is None or pmi_size == step_size)


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables (first match: torchrun, MPI, Slurm step, none)."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT")
    addr = env.get("MASTER_ADDR") or None
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                         _int(env, "LOCAL_RANK", default=0), addr, port)
    if "OMPI_COMM_WORLD_RANK" in env:
        return LaunchEnv("mpi", int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=0), addr, port)
    if "PMI_RANK" in env and "PMI_SIZE" in env and not _srun_started(env, "PMI_RANK", "PMI_SIZE"):
        return LaunchEnv("mpi", int(env["PMI_RANK"]), int(env["PMI_SIZE"]),
                         _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK", default=0), addr, port)
    if "PMIX_RANK" in env and not _srun_started(env, "PMIX_RANK", "PMIX_SIZE"):
        size = _int(env, "PMIX_SIZE", "PMI_SIZE", default=1)
        return LaunchEnv("mpi", int(env["PMIX_RANK"]), size,
                         _int(env, "PMIX_LOCAL_RANK", default=0), addr, port)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1)
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        if port is None:
            job = _int(env, "SLURM_JOB_ID", default=0) or 0
            step = _int(env, "SLURM_STEP_ID", default=0) or 0
            port = 20000 + (job * 16 + step) % 20000
        return LaunchEnv("slurm", int(env["SLURM_PROCID"]), size,
                         _int(env, "SLURM_LOCALID", default=0), addr or first_host(nodes), port)
    return LaunchEnv("none", 0, 1, 0, addr, port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# the call check of a group's operators every this many (GPUDIST_CHECK_EVERY): one small
# metadata exchange per 1024 calls, about 0.1-0.5 us a call on a CPU host; NEVER: off
CHECK_EVERY = 1024
NEVER = 1 << 62


@dataclass
class World:
    """The job: this rank, the world size, the transport, the control plane, the default
    device, and how big the per-layer plan caches may grow."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    transport: Transport
    launch: LaunchEnv
    control: Control
    cache_size: int = 8
    uids: dict = field(default_factory=dict)
    check_calls: bool = False  # GPUDIST_CHECK_CALLS: compare every call (meta.check_call)
    # the period of the call check of every group's operators (GPUDIST_CHECK_EVERY; a
    # program that skips or adds an operator on some ranks is found within this many
    # operators of the group where nothing else finds it; NEVER: off)
    check_every: int = CHECK_EVERY
    ranks_here: int = 1  # the world's ranks on this host (this one included)
    cores_here: int = 0  # the cores they may run on together (0: not known; this rank's)
    exit_teardown_s: int = 10  # GPUDIST_EXIT_TEARDOWN_S (read by init: see _excepthook)

    def __setattr__(self, name: str, value) -> None:
        if name == "check_every" and value <= 0:  # 0 (or less): never, as the setting's
            value = NEVER
        object.__setattr__(self, name, value)

    @property
    def timeout(self) -> float:
        return self.transport.timeout

    def data_path(self, device: torch.device | str | None = None) -> str:
        """How this world moves tensors of ``device``: straight from device memory, or
        through host staging buffers (gloo point-to-point with CUDA tensors, MPI that is
        not CUDA-aware; GPUDIST_MPI_CUDA_AWARE=0/1 overrides the MPI check)."""
        dev = torch.device(device) if device is not None else self.device
        tr = self.transport
        probe = torch.empty(0, device=dev) if dev.type != "cuda" or torch.cuda.is_available() \
            else torch.empty(0)
        native = tr.native(probe) if hasattr(tr, "native") else True
        return (f"{self.backend} ({tr.name}), {dev.type} tensors: "
                f"{'device pointers to the backend' if native else 'staged through host buffers'}")

    def next_uid(self, key: object) -> int:
        """Numbers the objects made for ``key`` (e.g. a partition) in creation order: the
        same numbers on every rank that makes them, e.g. to give each halo exchange its
        own message tags."""
        self.uids[key] = self.uids.get(key, 0) + 1
        return self.uids[key]


_WORLD: World | None = None  # the process group; set by init(), cleared by finalize()
# The launcher's store (a TCPStore client, or rank 0's server), kept for a world joined
# again after finalize() (rank 0 could not serve the port twice), and the worlds joined
# over it: each one's keys under a prefix of its own (a world joined again met the last
# one's keys and hung connecting to its closed ports). Every rank joins the same worlds.
_STORE: tuple[object, object] | None = None  # (launcher address, store)
_JOINED = 0
# the error that aborted this process's last world: its process group cannot be torn down
# (a collective may be left in flight) nor reused, so no other world can be joined here
_ABORTED: str | None = None


def world() -> World:
    """The world joined by :func:`init` (joins a world of one if none yet)."""
    if _WORLD is None:
        return init()
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None


def reset() -> None:
    """Forget the world without talking to anyone (a forked child must not use its
    parent's world; after an abort nothing collective is possible)."""
    global _WORLD, _STORE, _ABORTED
    _WORLD = _STORE = _ABORTED = None  # (a forked child must not use its parent's store;
    # _JOINED stays: children inherit the same count, so they agree on the next prefix)
    _uninstall_excepthook()


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is not None and str(device) != "auto":
        d = torch.device(device)
        if d.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"gpudist.init(device={str(device)!r}): no CUDA GPU is usable "
                              f"here (torch {torch.__version__}, built with CUDA "
                              f"{torch.version.cuda}); use device='cpu' or 'auto'")
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        if d.type == "cuda" and d.index >= torch.cuda.device_count():
            raise DeviceError(f"gpudist.init(device={str(device)!r}): this machine has "
                              f"{torch.cuda.device_count()} CUDA GPU(s)")
        return d
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


DEFAULT_TIMEOUT_S = 120.0


def init(
    backend: str = "auto",
    device: str | torch.device | None = None,
    timeout: float | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store=None,
) -> World:
    """Join the job and return the :class:`World`.

    ``backend``: "auto" (NCCL for CUDA, gloo for CPU, MPI under mpiexec when torch has no
    rendezvous address), "nccl", "gloo" or "mpi". ``rank``/``world_size``/``store`` override
    the launcher (used by the test harness). ``timeout`` bounds every wait, in seconds
    (default: env ``GPUDIST_COMM_TIMEOUT``, else 120).
    """
    global _WORLD
    if backend not in ("auto", "nccl", "gloo", "mpi"):
        raise LaunchError(f"unknown backend {backend!r}; use auto, nccl, gloo or mpi")
    if _WORLD is not None:
        if backend not in ("auto", _WORLD.backend):
            raise LaunchError(
                f"gpudist.init(backend={backend!r}): this process has joined a "
                f"{_WORLD.backend} world already; call gpudist.finalize() first")
        return _WORLD
    if _ABORTED is not None:
        raise LaunchError(
            f"gpudist.init(): this process's last world was aborted ({_ABORTED}); its "
            f"process group can neither be reused nor torn down safely, so no new world can "
            f"be joined in this process: start the job again")
    launch = detect_launch()
    mpi_job = launch.launcher == "mpi" and launch.size > 1 and rank is None
    try:  # until the control plane exists, a failure on some ranks of an mpiexec job (a
        # setting refused, a device or a rendezvous that fails) leaves the others in MPI's
        # start-up or the rendezvous, with no timeout: it ends the job
        check_all()  # every setting read before anything is joined: a bad one raises here
        if timeout is None:
            timeout = setting("GPUDIST_COMM_TIMEOUT", DEFAULT_TIMEOUT_S)
        cache = setting("GPUDIST_PLAN_CACHE", 8)
        check_calls = setting("GPUDIST_CHECK_CALLS", False)
        every = setting("GPUDIST_CHECK_EVERY", CHECK_EVERY)
        teardown = setting("GPUDIST_EXIT_TEARDOWN_S", EXIT_TEARDOWN_S)
        if rank is not None:
            launch = LaunchEnv("explicit", rank, int(world_size or 1), rank, None, None)
        dev, backend, launch, transport, control = _join(backend, device, launch, store,
                                                         timeout)
    except Exception as e:
        if mpi_job:
            _abort_mpi_job(e)
        raise
    _WORLD = World(launch.rank, launch.size, launch.local_rank, dev, backend, transport,
                   launch, control, max(1, cache))
    (_WORLD.check_calls, _WORLD.check_every, _WORLD.ranks_here,
     _WORLD.cores_here) = _start_exchange(_WORLD, check_calls, every)
    _WORLD.exit_teardown_s = teardown
    _choose_waits(_WORLD)
    if launch.size > 1:
        _install_excepthook()
        atexit.register(_at_exit)
    return _WORLD


def _join(backend: str, device, launch: LaunchEnv, store, timeout: float
          ) -> tuple[torch.device, str, LaunchEnv, Transport, Control]:
    """:func:`init`'s joining: the device, the backend, its transport and the control
    plane (its store)."""
    import torch.distributed as dist

    dev = _pick_device(device, launch.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "auto":
        if dev.type == "cuda" and launch.size > 1:
            backend = "nccl"
        elif launch.launcher == "mpi" and launch.master_addr is None and _mpi_available():
            backend = "mpi"
        else:
            backend = "gloo"

    if backend == "mpi":
        from .transport.mpi import MPITransport

        transport: Transport = MPITransport(timeout=timeout)
        if transport.size != launch.size and launch.launcher != "none":
            raise LaunchError(
                f"MPI world has {transport.size} ranks but the launcher said {launch.size}"
            )
        launch = LaunchEnv(launch.launcher, transport.rank, transport.size,
                           launch.local_rank, None, None)
        control_store = _mpi_store(transport, timeout) if transport.size > 1 else None
        server = 0
    else:
        from .transport.torch_dist import TorchDistTransport, backend_timeout

        td = datetime.timedelta(seconds=timeout)
        server = None  # (a store of the program's, a file, the launcher's agent)
        if dist.is_initialized():  # the program joined already: reuse its store
            launch = LaunchEnv(launch.launcher, dist.get_rank(), dist.get_world_size(),
                               launch.local_rank, launch.master_addr, launch.master_port)
            store = store or _default_store()
        elif store is None:
            store = dist.HashStore() if launch.size == 1 else _launcher_store(launch, td)
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                server = 0  # (_rendezvous_store: rank 0 serves it)
        made = not dist.is_initialized()  # (else the program's: finalize leaves it)
        if made:
            dist.init_process_group(backend, store=store, rank=launch.rank,
                                    world_size=launch.size, timeout=backend_timeout(timeout))
        transport = TorchDistTransport(timeout=timeout, owns_default_group=made)
        control_store = (dist.PrefixStore("gpudist", store)
                         if launch.size > 1 and store is not None else None)
    control = Control(control_store, launch.rank, launch.size, timeout)
    control.store_server = server
    control.register_process()
    transport.control = control
    return dev, backend, launch, transport, control


MASK_WORDS = 16  # the cores a rank may run on, as bits of 16 int64 words (cores 0-1023)


def _affinity_words() -> list[int]:
    """This process's CPU affinity as :data:`MASK_WORDS` words of bits (63 a word, so
    that each is a non-negative int64)."""
    words = [0] * MASK_WORDS
    for c in _cpus():
        if c < 63 * MASK_WORDS:
            words[c // 63] |= 1 << (c % 63)
    return words


def _start_exchange(w: World, flag: bool, every: int) -> tuple[bool, int, int, int]:
    """(whether ``flag`` is set on any rank, the shortest period ``every`` any rank asked
    for (:data:`NEVER` where all said 0), how many ranks run on this host, on how many
    cores together): one world-collective exchange at init, so that a setting read from
    one rank's environment holds on every rank. Ranks bound to a core each (srun
    --cpu-bind=cores, Open MPI's default binding) see one core in their own affinity, but
    the union of the host's ranks' affinities counts them all."""
    if w.size == 1:
        return flag, every or NEVER, 1, _cores()
    tr = w.transport
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    k = 3 + MASK_WORDS
    out = torch.empty(k * w.size, dtype=torch.int64)
    row = torch.tensor([int(flag), host, every or NEVER] + _affinity_words(),
                       dtype=torch.int64)
    tr.wait([tr.meta_all_gather(out, row, tr.group(range(w.size)))],
            "the settings exchange of gpudist.init")
    rows = out.view(w.size, k)
    here = rows[:, 1] == host
    union = [0] * MASK_WORDS
    for r in rows[here].tolist():
        union = [a | b for a, b in zip(union, r[3:])]
    cores = sum(bin(x).count("1") for x in union)
    return bool(rows[:, 0].any()), int(rows[:, 2].min()), int(here.sum()), cores


def _cpus() -> set[int] | range:
    """The cores this process may run on."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return range(os.cpu_count() or 1)


def _cores() -> int:
    """How many cores this process may run on."""
    return len(_cpus())


def _choose_waits(w: World) -> None:
    """How this rank waits, by whether this host's ranks fit the cores they may run on
    together (the union of their affinities, :func:`_start_exchange`).

    A gloo collective (``GPUDIST_GLOO_WAIT``): ``block`` in torch's timed wait (wakes the
    moment gloo is done: fastest where each rank has a core of its own), ``nap`` between
    polls (leaves the core to a rank that shares it: faster when ranks outnumber cores),
    ``auto`` (default): block where the ranks fit (bench/RESULTS.md, 2026-11-27 morning).

    A spinning wait (MPI) polls its first ``GPUDIST_HOT_SPIN_S`` (50 us) without yielding
    the core where the ranks fit (no peer of this host needs it; a small broadcast or
    all-reduce ends 0.6-2.5 us sooner), yielding from the start where they do not."""
    fits = w.ranks_here <= (w.cores_here or _cores())
    mode = setting("GPUDIST_GLOO_WAIT", "auto")
    block = mode == "block" or (mode == "auto" and fits)
    if hasattr(w.transport, "block_collectives"):
        w.transport.block_collectives = block
    if w.control is not None:
        w.control.hot_spin_s = setting("GPUDIST_HOT_SPIN_S", HOT_SPIN_S) if fits else 0.0


def _abort_mpi_job(err: Exception) -> None:
    """A setting refused, or joining failed, on some ranks of an mpiexec job: say so and end
    the whole job, as an uncaught error does under MPI (the other ranks are waiting in
    MPI's start-up or the rendezvous, with no timeout)."""
    print(f"gpudist: {type(err).__name__}: {err}; ending the MPI job", file=sys.stderr,
          flush=True)
    from .transport.mpi import _mpi

    _mpi().COMM_WORLD.Abort(1)


def _launcher_store(launch: LaunchEnv, td: datetime.timedelta):
    """The launcher's store (made at the first world, kept for the next ones), under a
    prefix of this world's own."""
    import torch.distributed as dist

    global _STORE, _JOINED
    where = (launch.launcher, launch.master_addr, launch.master_port, launch.size)
    if _STORE is None or _STORE[0] != where:
        _STORE = (where, _rendezvous_store(launch, td))
    _JOINED += 1
    return dist.PrefixStore(f"gpudist/world{_JOINED}", _STORE[1])


def _rendezvous_store(launch: LaunchEnv, td: datetime.timedelta):
    """The TCP store of the launcher: under torchrun the elastic agent's (a client of it,
    as torch's own ``env://`` does), otherwise one rank 0 serves."""
    import torch.distributed as dist

    addr, port = launch.master_addr, launch.master_port
    if addr is None and launch.launcher == "mpi" and _mpi_available():
        from .transport.mpi import _mpi

        MPI = _mpi()

        addr, port = MPI.COMM_WORLD.bcast(
            (socket.gethostname(), _free_port()) if launch.rank == 0 else None
        )
    addr, port = addr or "127.0.0.1", port or 29500
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        tcp = dist.TCPStore(addr, port, launch.size, False, timeout=td)
        return dist.PrefixStore(f"/worker/attempt_{attempt}", tcp)
    return dist.TCPStore(addr, port, launch.size, launch.rank == 0, timeout=td)


def _default_store():
    """The store of a process group the program initialized itself (None if unknown)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def _mpi_store(transport: Transport, timeout: float):
    """A TCP store rank 0 serves for the control plane of an MPI world."""
    import torch.distributed as dist

    comm = transport.comm  # type: ignore[attr-defined]
    hosts = comm.allgather(socket.gethostname())
    host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    td = datetime.timedelta(seconds=timeout)
    if transport.rank == 0:
        st = dist.TCPStore(host, 0, transport.size, True, timeout=td, wait_for_workers=False)
        comm.bcast(st.port, root=0)
    else:
        port = comm.bcast(None, root=0)
        st = dist.TCPStore(host, port, transport.size, False, timeout=td)
    return dist.PrefixStore("gpudist", st)


# -- failures that nobody catches ------------------------------------------------------
_PREV_HOOK = None
EXIT_GRACE_S = 1.0
# seconds the interpreter's teardown (exit handlers included) may take after an uncaught
# error before SIGALRM ends the process (env GPUDIST_EXIT_TEARDOWN_S, read by init as every
# setting: read at ``import gpudist`` a bad value ended one rank of a job before init could
# say so on every rank; read in the handler, a value changed after init broke the handler)
EXIT_TEARDOWN_S = 10


def _excepthook(kind, value, tb) -> None:
    """Print the error, post it to the world (peers raise RemoteError at once) and end
    the process: under MPI abort the job (a rank left in MPI_Finalize would wait for its
    peers forever); under torch.distributed let Python exit as usual (exit handlers run,
    files are flushed) but without destroying the process groups (a gloo group's
    destructor joins its threads, and one in a collective left in flight waits the
    backend's whole timeout: a mismatch found while ranks wait ended the job 2 minutes
    later). Open files are flushed first, and a teardown still running after
    ``EXIT_TEARDOWN_S`` (e.g. an exit handler of the user's that waits) is ended by
    SIGALRM (env ``GPUDIST_EXIT_TEARDOWN_S``, default 10). Not in an interactive session,
    which goes on after the error."""
    (_PREV_HOOK or sys.__excepthook__)(kind, value, tb)
    w = _WORLD
    if w is None:
        return
    w.control.abort(value, "an uncaught exception")
    if w.size == 1 or sys.flags.interactive or hasattr(sys, "ps1"):
        return
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(EXIT_GRACE_S)  # let the peers print their RemoteError first
    if w.backend == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action ends the process
        signal.alarm(max(1, w.exit_teardown_s))
    w.transport.release_in_flight()
    w.transport.abandon()  # no teardown that waits for a collective left in flight
    _flush_open_files()  # before a teardown that may not reach their finalizers


def _flush_open_files() -> None:
    """Flush every open Python file object (what the interpreter's teardown would do)."""
    import gc
    import io

    for o in gc.get_objects():
        try:  # (isinstance itself raises for a dead weakref.proxy: torch.compile leaves some)
            if isinstance(o, io.IOBase) and not o.closed:
                o.flush()
        except Exception:
            pass


GLOO_SETTLE_S = 0.2  # (0.05 s lost the race under load: 4 busy processes a core)
# the longest the control store's server (MPI's rank 0) stays, leaving an aborted world,
# for its peers to read the failure (Control.linger)
LINGER_S = 5.0


def _at_exit() -> None:
    """A rank leaving without :func:`finalize` ends the world: its peers would otherwise
    wait for it until the timeout. Then, where process groups are still alive (no
    finalize, or one after an abort, which keeps them), a short nap: a gloo worker thread
    that has just finished a collective drops its reference to the work a moment later;
    if that is the last one and the interpreter's exit has begun, destroying the work's
    tensors needs the GIL, which ends the thread inside a C++ destructor ("terminate
    called without an active exception", SIGABRT; 1 run in 5-60 of a torchrun program
    that caught an aborted world's errors and exited normally, seen with gdb). While the
    exit handlers run, the GIL can still be taken."""
    w = _WORLD
    if w is not None and w.control.aborted is None:
        w.control.abort(RuntimeError(f"rank {w.rank} exited without gpudist.finalize()"),
                        "interpreter exit")
    if w is not None:
        w.transport.release_in_flight()
        w.control.linger(LINGER_S)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(GLOO_SETTLE_S)


def _install_excepthook() -> None:
    global _PREV_HOOK
    if sys.excepthook is not _excepthook:
        _PREV_HOOK = sys.excepthook
        sys.excepthook = _excepthook


def _uninstall_excepthook() -> None:
    global _PREV_HOOK
    if sys.excepthook is _excepthook:
        sys.excepthook = _PREV_HOOK or sys.__excepthook__
    _PREV_HOOK = None


def finalize() -> None:
    """Leave the job: a last barrier (so no rank tears down while a peer still talks to
    it), then drop cached groups and destroy the process group. After an abort, only the
    local state is dropped (nothing collective can complete)."""
    global _WORLD
    if _WORLD is None:
        return
    w, _WORLD = _WORLD, None
    _uninstall_excepthook()
    if w.control.aborted is not None:
        global _ABORTED
        _ABORTED = str(w.control.aborted)[:300]
        w.transport.release_in_flight()
        w.control.linger(LINGER_S)
        return
    try:
        if w.size > 1:
            _last_barrier(w)
            _leave_last(w)
    finally:
        w.transport.finalize()
        w.control.close()
        if w.backend != "mpi" and w.transport.owns_default_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _last_barrier(w: World) -> None:
    """The barrier of :func:`finalize`, checked (:func:`gpudist.meta.barrier`): a rank
    that finalizes while its peers run an operator makes every rank raise a MismatchError
    naming ``gpudist.finalize``."""
    from .meta import barrier

    barrier(w.transport.group(range(w.size)), "gpudist.finalize", w)


LEAVE_WAIT_S = 5.0


def _leave_last(w: World) -> None:
    """Rank 0 (the control store's server under MPI and mpiexec) leaves after its peers
    have left the last barrier: a peer still in it may poll the store, and a store gone
    makes torch print a C++ stack trace there. Bounded by ``LEAVE_WAIT_S``."""
    st = w.control.store
    if st is None:
        return
    try:
        if w.rank != 0:
            st.add("left", 1)
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while st.add("left", 0) < w.size - 1 and time.monotonic() < deadline:
            time.sleep(1e-3)
        st.delete_key("left")  # a later world on the same store counts afresh
    except Exception:  # the store is gone already: nothing left to protect
        pass


def require_world(w: World | None) -> World:
    if w is not None:
        return w
    if _WORLD is None:
        raise GpudistError("gpudist.init() has not been called")
    return _WORLD
