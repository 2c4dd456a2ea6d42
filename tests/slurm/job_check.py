"""A small gpudist job for launcher tests: run it under srun, mpiexec, torchrun (or alone).

    srun -n 4 python tests/slurm/job_check.py --backend gloo --expect-launcher slurm
    mpiexec -n 3 python tests/slurm/job_check.py --backend mpi --expect-launcher mpi
    torchrun --nproc_per_node 2 tests/slurm/job_check.py --expect-launcher torchrun

Every rank joins with ``gpudist.init()`` from the launcher's environment, checks its
rank / world size / local rank against the launcher's own variables (SLURM_PROCID...,
PMI_RANK..., RANK...), then checks through gpudist that the ranks form ONE world:
an all-gather of the ranks (must be 0..n-1), an all-reduce, a broadcast, and a neighbour
(halo-style) exchange on a :class:`gpudist.Partition` grid. It prints one JSON line per rank
(``"job_check": 1``) and exits 0 when every check passed, 1 when one failed or a
communication raised (a timeout included).

Failure injection: ``--fail-rank R --exit-code C`` makes rank R exit with C (after init, or
before it with ``--fail-at start``); ``--hang-rank R`` (or ``all``) makes rank R sleep
instead of communicating, so the others must time out (``--timeout``) or be killed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

T0 = time.monotonic()

# where each launcher puts (rank, size, local rank)
LAUNCHER_VARS = {
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
    "mpi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "ompi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
}
ENV_KEYS = sorted({k for v in LAUNCHER_VARS.values() for k in v} | {
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "PMI_LOCAL_RANK",
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"})


def emit(rec: dict) -> None:
    rec = {"job_check": 1, **rec, "elapsed_s": round(time.monotonic() - T0, 3)}
    sys.stdout.write(json.dumps(rec, sort_keys=True) + "\n")
    sys.stdout.flush()


def launcher_expectation(expect: str | None) -> tuple[int, int, int] | None:
    """(rank, size, local rank) as the expected launcher's variables say."""
    if expect is None or expect == "none":
        return None
    if expect == "mpi" and "OMPI_COMM_WORLD_RANK" in os.environ:
        expect = "ompi"
    r, s, lr = LAUNCHER_VARS[expect]
    local = os.environ.get(lr) or os.environ.get("PMI_LOCAL_RANK") or "0"
    if expect == "mpi" and lr not in os.environ and "PMI_LOCAL_RANK" not in os.environ:
        local = None  # PMI without a local rank: not checked
    return (int(os.environ[r]), int(os.environ[s]), None if local is None else int(local))


def parse_rank(v: str) -> int | str:
    return v if v == "all" else int(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "mpi", "nccl"])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, auto")
    p.add_argument("--timeout", type=float, default=60.0, help="gpudist timeout (s)")
    p.add_argument("--expect-launcher", choices=sorted(LAUNCHER_VARS) + ["none"],
                   help="check rank/size/local rank against this launcher's variables")
    p.add_argument("--expect-size", type=int, help="check the world size")
    p.add_argument("--fail-rank", type=int, help="this rank exits with --exit-code")
    p.add_argument("--fail-at", choices=["start", "collective"], default="collective",
                   help="fail before gpudist.init (start) or after it (default)")
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--hang-rank", type=parse_rank, help="this rank (or 'all') never communicates")
    a = p.parse_args(argv)

    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    host = socket.gethostname()
    env_rank = next((int(os.environ[v[0]]) for v in LAUNCHER_VARS.values()
                     if v[0] in os.environ), 0)
    if a.fail_rank is not None and a.fail_at == "start" and env_rank == a.fail_rank:
        emit({"status": "failing", "at": "start", "env_rank": env_rank, "env": env})
        return a.exit_code

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch deprecation notices
    import torch

    import gpudist
    from gpudist.transport.base import P2P

    torch.set_num_threads(1)
    launch = gpudist.detect_launch()
    rec: dict = {"host": host, "pid": os.getpid(), "env": env, "launcher": launch.launcher}
    errors: list[str] = []
    try:
        w = gpudist.init(backend=a.backend, device=a.device, timeout=a.timeout)
        rec.update(rank=w.rank, size=w.size, local_rank=w.local_rank, backend=w.backend,
                   device=str(w.device), init_s=round(time.monotonic() - T0, 3))
        if a.expect_launcher and launch.launcher != a.expect_launcher:
            errors.append(f"detect_launch says {launch.launcher!r}, expected "
                          f"{a.expect_launcher!r}")
        exp = launcher_expectation(a.expect_launcher)
        if exp is not None:
            r, s, lr = exp
            if (w.rank, w.size) != (r, s):
                errors.append(f"rank/size {w.rank}/{w.size} but the launcher says {r}/{s}")
            if lr is not None and w.local_rank != lr:
                errors.append(f"local rank {w.local_rank} but the launcher says {lr}")
        if a.expect_size is not None and w.size != a.expect_size:
            errors.append(f"world size {w.size}, expected {a.expect_size}")
        if w.backend == "mpi":
            from mpi4py import MPI

            c = MPI.COMM_WORLD
            rec["mpi"] = [c.Get_rank(), c.Get_size()]
            if (c.Get_rank(), c.Get_size()) != (w.rank, w.size):
                errors.append(f"MPI.COMM_WORLD is {c.Get_rank()}/{c.Get_size()}")

        if a.fail_rank == w.rank:
            emit({**rec, "status": "failing", "at": "collective"})
            os._exit(a.exit_code)
        if a.hang_rank == "all" or a.hang_rank == w.rank:
            emit({**rec, "status": "hanging"})
            while True:
                time.sleep(3600)

        n, me, dev, tr = w.size, w.rank, w.device, w.transport
        world_part = gpudist.Partition.grid((n,), world=w)
        g = world_part.group
        t1 = time.monotonic()
        if g is not None:  # n > 1
            # one world: every rank 0..n-1 exactly once
            ranks = torch.zeros(n, dtype=torch.int64, device=dev)
            tr.wait([tr.all_gather(ranks, torch.tensor([me], dtype=torch.int64, device=dev),
                                   g)])
            rec["gathered_ranks"] = ranks.tolist()
            if sorted(rec["gathered_ranks"]) != list(range(n)):
                errors.append(f"all-gather of ranks gave {rec['gathered_ranks']}")
            # all-reduce
            t = torch.full((3,), float(me + 1), dtype=torch.float64, device=dev)
            tr.wait([tr.all_reduce(t, g)])
            rec["allreduce"] = t[0].item()
            if not torch.all(t == n * (n + 1) / 2):
                errors.append(f"all-reduce gave {t.tolist()}, expected {n * (n + 1) / 2}")
            # broadcast from the last rank
            b = torch.full((2,), 1000.0 + me, dtype=torch.float64, device=dev)
            tr.wait([tr.broadcast(b, n - 1, g)])
            if not torch.all(b == 1000.0 + n - 1):
                errors.append(f"broadcast gave {b.tolist()}")
        else:
            rec.update(gathered_ranks=[me], allreduce=1.0)
        # neighbour exchange on a 2-D grid when the size allows (halo-style: send my world
        # rank to both neighbours on every axis, receive theirs)
        shape = (2, n // 2) if n >= 4 and n % 2 == 0 else (n,)
        part = gpudist.Partition.grid(shape, world=w)
        rec["grid"] = list(shape)
        rec["coords"] = list(part.coords)
        nbrs: dict[str, int | None] = {}
        ops, recvs = [], []
        for axis in range(part.dim):
            lo, hi = part.neighbors(axis)
            for side, peer in (("lo", lo), ("hi", hi)):
                nbrs[f"{axis}{side}"] = peer
                if peer is None:
                    continue
                out = torch.tensor([me], dtype=torch.int64, device=dev)
                inp = torch.full((1,), -1, dtype=torch.int64, device=dev)
                # what I send to my hi neighbour arrives at its lo side: tags pair up
                ops.append(P2P("send", out, peer, 2 * axis + (1 if side == "hi" else 0)))
                ops.append(P2P("recv", inp, peer, 2 * axis + (0 if side == "hi" else 1)))
                recvs.append((side, axis, peer, inp))
        tr.wait(tr.batch_p2p(ops))
        rec["neighbors"] = nbrs
        for side, axis, peer, inp in recvs:
            if inp.item() != peer:
                errors.append(f"axis {axis} {side} neighbour {peer} sent {inp.item()}")
        # expected neighbours from the coordinates alone
        for axis in range(part.dim):
            c = list(part.coords)
            for side, step in (("lo", -1), ("hi", 1)):
                c2 = c.copy()
                c2[axis] += step
                want = (c2[0] * shape[1] + c2[1] if len(shape) == 2 else c2[0]) \
                    if 0 <= c2[axis] < shape[axis] else None
                if nbrs[f"{axis}{side}"] != want:
                    errors.append(f"axis {axis} {side} neighbour {nbrs[f'{axis}{side}']}, "
                                  f"expected {want}")
        tr.barrier()
        rec["comm_s"] = round(time.monotonic() - t1, 3)
    except Exception as e:  # a timeout or a broken world: report it, exit non-zero at once
        emit({**rec, "status": "error", "error": f"{type(e).__name__}: {e}", "errors": errors})
        # gpudist posted the error to the world; give the peers a moment to report theirs
        # before the launcher kills them for our exit (srun --kill-on-bad-exit, mpiexec:
        # a peer polls the posted error every 20 ms, but the kill can come first)
        time.sleep(gpudist.runtime.EXIT_GRACE_S)
        os._exit(1)  # no finalizers: peers may be dead or stuck
    status = "ok" if not errors else "failed"
    emit({**rec, "status": status, "errors": errors})
    try:
        gpudist.finalize()
    except Exception as e:  # pragma: no cover - report, the checks already ran
        emit({**rec, "status": "error", "error": f"finalize: {type(e).__name__}: {e}"})
        os._exit(1)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
