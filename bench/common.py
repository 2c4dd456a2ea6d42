"""Launching ranks, timing, and writing results for the bench suites.

Launchers:

* ``fork`` (default for gloo/nccl): fork N ranks here (``OMP_NUM_THREADS=1``) that join
  through a gloo/nccl ``FileStore``;
* ``mpi`` (default for ``--backend mpi``): re-exec this command under
  ``.venv/bin/mpiexec -n N ... --launcher env``;
* ``env``: this process is already one rank of a job started by torchrun / mpiexec / srun;
  join from the environment (``gpudist.init``).

Timing: ``warmup`` untimed calls, then ``repeats`` timed calls, each preceded by a barrier;
each repeat's time is the max over ranks (the slowest rank defines the step), and the
reported time is the median of those (with p25/p75 as spread). Cases that are compared are
interleaved repeat by repeat so that machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KiB = 1024
MiB = 1024 * 1024


# --------------------------------------------------------------------------- CLI helpers
def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def add_common_args(p: argparse.ArgumentParser, ranks: int = 4) -> None:
    p.add_argument("--ranks", "-n", type=positive_int, default=ranks,
                   help="number of ranks (default %(default)s)")
    p.add_argument("--backend", choices=["gloo", "mpi", "nccl"], default="gloo")
    p.add_argument("--launcher", choices=["fork", "mpi", "env"], default=None,
                   help="fork (default for gloo/nccl), mpi (default for --backend mpi), "
                        "env (already started by torchrun/mpiexec/srun)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (nccl implies cuda)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=positive_int, default=15)
    p.add_argument("--out", default="results", help="output folder (default %(default)s)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (tests)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--huge-pages", action="store_true",
                   help="run with THP_MEM_ALLOC_ENABLE=1: torch's CPU allocator backs tensors "
                        "of 2 MiB and more with transparent huge pages (every buffer, "
                        "gpudist's and the references', alike)")


def device_of(args) -> str:
    return "cuda" if args.backend == "nccl" else args.device


# --------------------------------------------------------------------------- machine info
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # read once by torch's CPU allocator, at its start


def want_huge_pages(argv: Sequence[str]) -> None:
    """``--huge-pages``: set ``THP_MEM_ALLOC_ENABLE=1`` before torch starts (the ranks,
    forked or started by ``mpiexec``, inherit it); re-exec this command if torch has
    started already (the allocator reads the variable once)."""
    if "--huge-pages" not in argv or os.environ.get(HUGE_PAGES_ENV) == "1":
        return
    os.environ[HUGE_PAGES_ENV] = "1"
    if "torch" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", "bench", *argv])


def torch_uses_huge_pages() -> bool | None:
    """Whether torch's CPU allocator asks for transparent huge pages for large tensors in
    this process (a fresh 8 MiB tensor's memory: :func:`advised_huge_pages`)."""
    import torch

    t = torch.empty(8 * MiB, dtype=torch.uint8)
    return advised_huge_pages(t.data_ptr())


def advised_huge_pages(address: int) -> bool | None:
    """Whether the mapping holding ``address`` carries the ``hg`` flag (``MADV_HUGEPAGE``)
    in ``/proc/self/smaps``; None where that file is not there or does not list it."""
    try:
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if head.endswith(":"):
                    if inside and head == "VmFlags:":
                        return "hg" in line.split()
                    continue
                lo, _, hi = head.partition("-")
                inside = int(lo, 16) <= address < int(hi, 16)
    except (OSError, ValueError):
        return None
    return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), text.strip())


def machine_info(backend: str | None = None) -> dict:
    import torch

    info = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "backend": backend,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "thp_mode": _thp_mode(),
        "torch_huge_pages": torch_uses_huge_pages(),
    }
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        info["git_commit"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    # Only when this run already uses MPI: importing mpi4py.MPI calls MPI_Init, and on one
    # rank alone under a PMI launcher (srun --mpi=pmi2) that waits for peers that have exited.
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None:
        info["mpi4py"] = sys.modules["mpi4py"].__version__
        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --------------------------------------------------------------------------- timing
def peak_memory_mib(world) -> float:
    """This rank's peak memory in MiB: CUDA's max allocated on a GPU, else the process's
    peak resident set (``ru_maxrss``: whole-process, all cases so far, coarse)."""
    if world.device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_BARRIER_COMMS: dict[int, object] = {}  # id(world) -> the timing barriers' communicator


def world_barrier(world) -> None:
    """A barrier over the world's default communicator (outside timing)."""
    if world.size > 1:
        if world.backend == "mpi":
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier()


class Timer:
    """Barrier / max-over-ranks / synchronize helpers for one rank."""

    def __init__(self, world, warmup: int, repeats: int) -> None:
        self.world = world
        self.warmup = warmup
        self.repeats = repeats
        self.cuda = world.device.type == "cuda"

    def barrier(self) -> None:
        """A barrier on a communicator of its own (made at the first barrier, on every
        rank alike), used by nothing timed, so that no case runs on the communicator the
        barrier just woke (gloo, 2 ranks, a 64 KiB all-reduce right after a barrier on
        its own group took 320-326 us, on another group 376-383; with the barrier on a
        third group 343-377 against 370-379). In the bench itself, where the cases
        rotate, the change moved no gloo or MPI ratio beyond its noise."""
        w = self.world
        if w.size == 1:
            return
        comm = _BARRIER_COMMS.get(id(w))  # one per world, for every Timer of the process
        if w.backend == "mpi":
            from mpi4py import MPI

            if comm is None:
                comm = _BARRIER_COMMS[id(w)] = MPI.COMM_WORLD.Dup()
            comm.Barrier()
        else:
            import torch.distributed as dist

            if comm is None:
                comm = _BARRIER_COMMS[id(w)] = dist.new_group(list(range(w.size)),
                                                             backend="gloo")
            dist.barrier(group=comm)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def max_over_ranks(self, values: list[float]) -> list[float]:
        if self.world.size == 1:
            return values
        if self.world.backend == "mpi":
            import numpy as np
            from mpi4py import MPI

            a = np.asarray(values, dtype=np.float64)
            out = np.empty_like(a)
            MPI.COMM_WORLD.Allreduce(a, out, op=MPI.MAX)
            return out.tolist()
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64,
                         device=self.world.device if self.world.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def time(self, fns: dict[str, Callable[[], object]]) -> dict[str, dict]:
        """Time each callable (interleaved); {name: stats} with times in seconds."""
        for _ in range(self.warmup):
            for fn in fns.values():
                self.barrier()
                fn()
                self.sync()
        raw: dict[str, list[float]] = {k: [] for k in fns}
        names = list(fns)
        for i in range(self.repeats):
            # each repeat starts with a different case: the first one after a barrier and
            # the previous case's buffers measured 20-40 us slower (1 MiB, MPI), an order
            # effect that a fixed order would charge to one case only
            for k in names[i % len(names):] + names[:i % len(names)]:
                fn = fns[k]
                self.barrier()
                t0 = time.perf_counter()
                fn()
                self.sync()
                raw[k].append(time.perf_counter() - t0)
        return {k: stats(self.max_over_ranks(v)) for k, v in raw.items()}


def stats(ts: Sequence[float]) -> dict:
    """Median, quartiles and extremes of one case's times; ``samples``: the times in
    repeat order (the same repeat index of two cases ran side by side: :func:`paired`)."""
    s = sorted(ts)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median_s": statistics.median(s), "p25_s": q[0], "p75_s": q[2],
            "min_s": s[0], "max_s": s[-1], "n": len(s), "samples": list(ts)}


def paired(a: dict, b: dict) -> dict:
    """The ratio of case ``a`` to case ``b`` (:func:`stats` results of one
    :meth:`Timer.time` call) as the median of the per-repeat ratios, with a
    distribution-free ~95 % confidence interval of that median (order statistics).

    Each repeat times both cases back to back, so a repeat's ratio cancels what the machine
    was doing then (other jobs, frequency changes) that the ratio of the two medians does
    not; the interval says whether a ratio is above or below a target, or cannot tell."""
    r = sorted(x / y for x, y in zip(a["samples"], b["samples"]) if y > 0)
    n = len(r)
    if n == 0:
        return {"paired": float("nan"), "paired_lo": float("nan"), "paired_hi": float("nan")}
    half = 0.98 * math.sqrt(n)  # 1.96 sigma of Binomial(n, 1/2)
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return {"paired": statistics.median(r), "paired_lo": r[lo], "paired_hi": r[hi]}


def progress(world, total: int, desc: str, disable: bool = False):
    """tqdm bar on rank 0 (a no-op object elsewhere)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    if tqdm is None or world.rank != 0 or disable:
        class _Null:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _Null()
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- output
def write_results(out_dir: str | Path, name: str, rows: list[dict],
                  meta: dict) -> tuple[Path, Path]:
    """``<out>/<name>.json`` (meta + rows) and ``<out>/<name>.csv`` (rows)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, cpath = out / f"{name}.json", out / f"{name}.csv"
    jpath.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in r.items()})
    return jpath, cpath


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def print_table(rows: list[dict], cols: Sequence[str]) -> None:
    cols = [c for c in cols if any(c in r for r in rows)]
    cells = [[str(_fmt(r.get(c, ""))) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))


# --------------------------------------------------------------------------- launching
SuiteFn = Callable[[argparse.Namespace, object], list[dict]]


def _suite_task(fn: SuiteFn, args) -> list[dict] | None:
    """One rank of a :mod:`gpudist.launch` pool: run the suite, rows from rank 0."""
    import gpudist

    world = gpudist.world()
    rows = fn(args, world)
    world_barrier(world)
    if world.rank != 0:
        return None
    info = machine_info(world.backend)
    return [dict(r, _meta=info) for r in rows] if rows else rows


def _launch(fn: SuiteFn, args, n: int, backend: str) -> list[dict]:
    from gpudist import launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kw = {"device": device_of(args), "comm_timeout": args.timeout,
          "threads": int(os.environ.get("OMP_NUM_THREADS", "1"))}
    if backend == "mpi":
        kw["pythonpath"] = [str(ROOT)]
    return launch.run(_suite_task, n, fn, args, backend=backend, timeout=args.timeout, **kw)[0]


def _env_main(fn: SuiteFn, args) -> list[dict] | None:
    """This process is one rank of a job started by torchrun / mpiexec / srun."""
    import torch

    import gpudist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gpudist.init(backend=args.backend, device=device_of(args), timeout=args.timeout)
    try:
        return _suite_task(fn, args)
    finally:
        gpudist.finalize()


def run_suite(name: str, fn: SuiteFn, args, argv: list[str],
              rank_counts: Sequence[int] | None = None,
              columns: Sequence[str] = ()) -> list[dict] | None:
    """Run ``fn(args, world)`` on each rank count, merge rank 0's rows, write JSON + CSV.

    Returns the rows on the process that wrote them (None elsewhere).
    """
    launcher = args.launcher or ("mpi" if args.backend == "mpi" else "fork")
    counts = list(rank_counts or [args.ranks])
    if device_of(args) == "cuda":
        import torch

        if not torch.cuda.is_available():  # (the ranks would die in their first CUDA call)
            raise SystemExit(f"bench {name}: --device cuda (or --backend nccl) but this "
                             f"torch sees no CUDA device ({torch.__version__})")
    if launcher == "env":
        rows = _env_main(fn, args)
        if rows is None:  # not rank 0
            return None
    else:
        rows = []
        for n in counts:
            a = argparse.Namespace(**vars(args))
            a.ranks = n
            rows += _launch(fn, a, n, "mpi" if launcher == "mpi" else args.backend)
    metas = [r.pop("_meta") for r in rows if "_meta" in r]
    meta = metas[0] if metas else machine_info(args.backend)
    meta.update({"suite": name, "argv": [sys.executable, "-m", "bench", name, *argv],
                 "ranks": counts, "launcher": launcher, "warmup": args.warmup,
                 "repeats": args.repeats})
    tag = f"_{args.tag}" if args.tag else ""
    fname = f"{name}_{args.backend}_{max(counts)}r{tag}"
    jpath, cpath = write_results(args.out, fname, rows, meta)
    if columns:
        print_table(rows, columns)
    print(f"wrote {jpath} and {cpath}")
    return rows


class RawBackend:
    """The backend a bench compares against, called directly: mpi4py's COMM_WORLD or
    ``torch.distributed`` (subclasses add the raw calls they time)."""

    def __init__(self, world) -> None:
        self.mpi = world.backend == "mpi"
        if self.mpi:
            from mpi4py import MPI

            self.MPI, self.comm = MPI, MPI.COMM_WORLD
        else:
            import torch.distributed as dist

            self.dist = dist
