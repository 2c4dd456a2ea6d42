"""Joining the job: launcher detection, device and backend choice, init/finalize.

``init()`` reads the environment of ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR),
``mpiexec``/``mpirun`` (MPICH/Hydra ``PMI_*``, Open MPI ``OMPI_COMM_WORLD_*``) or Slurm
``srun`` (``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS``/``SLURM_LOCALID``, master = first host
of the node list), or runs as a world of one. The resulting :class:`World` is the process
group: the only process-wide state gpudist keeps.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import GpudistError, LaunchError
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


@dataclass
class World:
    """The job: this rank, the world size, the transport, and the default device."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    transport: Transport
    launch: LaunchEnv

    @property
    def timeout(self) -> float:
        return self.transport.timeout


_WORLD: World | None = None  # the process group; set by init(), cleared by finalize()


def world() -> World:
    """The world joined by :func:`init` (joins a world of one if none yet)."""
    if _WORLD is None:
        return init()
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is not None and str(device) != "auto":
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
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


def init(
    backend: str = "auto",
    device: str | torch.device | None = None,
    timeout: float = 120.0,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store=None,
) -> World:
    """Join the job and return the :class:`World`.

    ``backend``: "auto" (NCCL for CUDA, gloo for CPU, MPI under mpiexec when torch has no
    rendezvous address), "nccl", "gloo" or "mpi". ``rank``/``world_size``/``store`` override
    the launcher (used by the test harness). ``timeout`` bounds every wait, in seconds.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    import torch.distributed as dist

    launch = detect_launch()
    if rank is not None:
        launch = LaunchEnv("explicit", rank, int(world_size or 1), rank, None, None)
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
    if backend not in ("nccl", "gloo", "mpi"):
        raise LaunchError(f"unknown backend {backend!r}; use auto, nccl, gloo or mpi")

    if backend == "mpi":
        from .transport.mpi import MPITransport

        transport: Transport = MPITransport(timeout=timeout)
        if transport.size != launch.size and launch.launcher != "none":
            raise LaunchError(
                f"MPI world has {transport.size} ranks but the launcher said {launch.size}"
            )
        launch = LaunchEnv(launch.launcher, transport.rank, transport.size,
                           launch.local_rank, None, None)
    else:
        from .transport.torch_dist import TorchDistTransport

        if not dist.is_initialized():
            td = datetime.timedelta(seconds=timeout)
            if store is None and launch.size == 1:
                store = dist.HashStore()
            if store is None:
                addr, port = launch.master_addr, launch.master_port
                if addr is None and launch.launcher == "mpi" and _mpi_available():
                    from mpi4py import MPI

                    addr, port = MPI.COMM_WORLD.bcast(
                        (socket.gethostname(), _free_port()) if launch.rank == 0 else None
                    )
                addr, port = addr or "127.0.0.1", port or 29500
                store = dist.TCPStore(addr, port, launch.size, launch.rank == 0, timeout=td)
            dist.init_process_group(
                backend, store=store, rank=launch.rank, world_size=launch.size, timeout=td
            )
        transport = TorchDistTransport(timeout=timeout)
    _WORLD = World(launch.rank, launch.size, launch.local_rank, dev, backend, transport, launch)
    return _WORLD


def finalize() -> None:
    """Leave the job: drop cached groups and destroy the process group."""
    global _WORLD
    if _WORLD is None:
        return
    w, _WORLD = _WORLD, None
    w.transport.finalize()
    if w.backend != "mpi":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def require_world(w: World | None) -> World:
    if w is not None:
        return w
    if _WORLD is None:
        raise GpudistError("gpudist.init() has not been called")
    return _WORLD
