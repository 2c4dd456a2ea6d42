"""Launch detection, decomposition, partitions, transports, timeouts, bad input."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import gpudist
from gpudist import Decomposition, Partition, ShapeError
from gpudist.primitives import distribute
from gpudist.runtime import detect_launch, first_host
from gpudist.transport.base import P2P

# ---------------------------------------------------------------- launch (no ranks needed)


def test_detect_torchrun():
    e = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                       "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (e.launcher, e.rank, e.size, e.local_rank, e.master_addr, e.master_port) == \
        ("torchrun", 3, 4, 1, "h", 1234)


def test_detect_mpich_and_openmpi():
    e = detect_launch({"PMI_RANK": "2", "PMI_SIZE": "6", "MPI_LOCALRANKID": "2"})
    assert (e.launcher, e.rank, e.size, e.local_rank) == ("mpi", 2, 6, 2)
    e = detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (e.launcher, e.rank, e.size, e.local_rank) == ("mpi", 1, 2, 1)


def test_detect_slurm_step():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16",
           "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42",
           "SLURM_STEP_NODELIST": "gpu[07-09,11]", "PMI_RANK": "5", "PMI_SIZE": "8"}
    e = detect_launch(env)
    assert (e.launcher, e.rank, e.size, e.local_rank, e.master_addr) == \
        ("slurm", 5, 8, 1, "gpu07")
    assert 20000 <= e.master_port < 40000
    # a batch script (no step) is not an N-task world
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "none"


def test_first_host():
    assert first_host("node1") == "node1"
    assert first_host("a[3-5],b1") == "a3"
    assert first_host("x[01,04]") == "x01"


def test_comm_timeout_from_the_environment():
    code = ("import gpudist; w = gpudist.init(); print(w.control.timeout); "
            "gpudist.finalize()")
    env = {**os.environ, "GPUDIST_COMM_TIMEOUT": "7.5"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK",
              "OMPI_COMM_WORLD_RANK"):  # a world of one, whatever ran this test
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "7.5", out.stdout


def test_no_launcher_is_world_of_one():
    e = detect_launch({})
    assert (e.launcher, e.rank, e.size) == ("none", 0, 1)


# ---------------------------------------------------------------- decomposition


@pytest.mark.parametrize("n,p", [(10, 3), (7, 7), (5, 1), (20, 6), (3, 4)])
def test_block_sizes_remainder_low(n, p):
    b = gpudist.block_sizes(n, p)
    assert sum(b) == n and max(b) - min(b) <= 1 and b == sorted(b, reverse=True)
    starts = gpudist.block_starts(n, p)
    assert all(gpudist.block_range(n, p, i) == (starts[i], starts[i] + b[i]) for i in range(p))


def test_decomposition_overlaps_cover_box():
    d = Decomposition((7, 10), (2, 3))
    assert d.local_shape((1, 2)) == (3, 3) and d.local_start((1, 2)) == (4, 7)
    box = (slice(2, 6), slice(1, 9))
    ov = list(d.overlaps(box))
    assert sum(torch.tensor(o.shape).prod().item() for o in ov) == 4 * 8
    for o in ov:
        st = d.local_start(o.coords)
        assert all(g.start - s == loc.start for g, s, loc in zip(o.glob, st, o.local))


def test_decomposition_rank_mismatch():
    with pytest.raises(ShapeError, match="3 dimensions but the partition has 2"):
        Decomposition((4, 4, 4), (2, 2))


# ---------------------------------------------------------------- partitions (multi-rank)


def _partition_facts(shape):
    w = gpudist.world()
    P = Partition.grid(shape)
    out = {"active": P.active, "coords": P.coords, "rank": P.index}
    S = P.sub([P.dim - 1])  # collective: every rank takes part
    T = P.transpose()
    if P.active:
        out["neighbors"] = [P.neighbors(a) for a in range(P.dim)]
        out["sub"] = (S.shape, S.ranks)
        out["t_coords"] = T.coords
    out["world"] = (w.rank, w.size)
    return out


@pytest.mark.parametrize("n,shape", [(1, (1,)), (2, (2,)), (3, (1, 3)), (4, (2, 2)),
                                     (6, (2, 3)), (6, (2, 2))])
def test_partition_grid(cluster, backend, n, shape):
    res = cluster.run(n, _partition_facts, shape, backend=backend)
    size = 1
    for s in shape:
        size *= s
    for r, f in enumerate(res):
        assert f["world"] == (r, n)
        assert f["active"] == (r < size)
        if r < size:
            assert f["rank"] == r
            c = f["coords"]
            assert Partition.__name__ and len(c) == len(shape)
            # neighbours are the ranks one step away in C order
            for a, (lo, hi) in enumerate(f["neighbors"]):
                stride = 1
                for s in shape[a + 1:]:
                    stride *= s
                assert lo == (r - stride if c[a] > 0 else None)
                assert hi == (r + stride if c[a] < shape[a] - 1 else None)
            assert f["t_coords"] == tuple(reversed(c))
            sub_shape, sub_ranks = f["sub"]
            assert sub_shape[-1] == shape[-1] and r in sub_ranks
        else:
            assert f["coords"] is None


def _too_small():
    Partition.grid((2, 2))


def test_world_too_small_raises_on_every_rank(cluster, backend):
    errs = cluster.run(3, _too_small, backend=backend, expect_error=True)
    assert all(e is not None and e.type == "PartitionError" for e in errs)
    assert "needs 4 ranks but the world has only 3" in errs[0].message


# ---------------------------------------------------------------- transport


def _transport_roundtrip(dtype):
    w = gpudist.world()
    t, r, n = w.transport, w.rank, w.size
    g = t.group(range(n))
    # broadcast
    x = torch.full((5, 3), float(r + 1), dtype=dtype)
    t.wait([t.broadcast(x, n - 1, g)])
    ok = [bool((x == n).all())]
    # reduce / all_reduce
    y = torch.full((4,), float(r + 1), dtype=dtype)
    t.wait([t.reduce(y, 0, g)])
    if r == 0:
        ok.append(bool((y == n * (n + 1) / 2).all()))
    z = torch.full((7,), float(r), dtype=dtype)
    t.wait([t.all_reduce(z, g)])
    ok.append(bool((z == n * (n - 1) / 2).all()))
    # all_gather
    out = torch.empty(n * 2, dtype=dtype)
    t.wait([t.all_gather(out, torch.full((2,), float(r), dtype=dtype), g)])
    ok.append(out.tolist() == [float(i) for i in range(n) for _ in range(2)])
    # uneven all-to-all: rank r sends (j+1) copies of r to rank j
    ins = torch.cat([torch.full((j + 1,), float(r), dtype=dtype) for j in range(n)])
    outs = torch.empty(n * (r + 1), dtype=dtype)
    t.wait([t.all_to_all(outs, ins, [r + 1] * n, [j + 1 for j in range(n)], g)])
    ok.append(outs.tolist() == [float(i) for i in range(n) for _ in range(r + 1)])
    # ring send/recv (batched, any order)
    send = torch.arange(6, dtype=dtype) + r
    recv = torch.empty(6, dtype=dtype)
    t.wait(t.batch_p2p([P2P("send", send, (r + 1) % n), P2P("recv", recv, (r - 1) % n)]))
    ok.append(bool((recv == torch.arange(6, dtype=dtype) + (r - 1) % n).all()))
    # a sub-group of the even ranks
    evens = list(range(0, n, 2))
    ge = t.group(evens)  # world-collective creation
    if r in evens and len(evens) > 1:
        e = torch.ones(3, dtype=dtype)
        t.wait([t.all_reduce(e, ge)])
        ok.append(bool((e == len(evens)).all()))
    t.barrier()
    return ok


@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transport_ops(cluster, backend, n, dtype):
    for r, ok in enumerate(cluster.run(n, _transport_roundtrip, dtype, backend=backend)):
        assert all(ok), f"rank {r}: {ok}"


def _missing_peer():
    w = gpudist.world()
    old = w.control.timeout
    w.control.timeout = 1.0
    try:
        if w.rank == 0:
            buf = torch.empty(3)  # rank 1 never sends on tag 999
            w.transport.wait(w.transport.batch_p2p([P2P("recv", buf, 1, 999)]))
        return "no error"
    finally:
        w.control.timeout = old


def _late_peer():
    w = gpudist.world()
    buf = torch.zeros(3)
    w.transport.barrier()  # both clocks start together
    if w.rank == 1:
        time.sleep(0.6)  # busy elsewhere: rank 0 waits all that time
        w.transport.wait(w.transport.batch_p2p([P2P("send", torch.ones(3), 0, 998)]))
        return None
    wall, cpu = time.perf_counter(), time.process_time()
    w.transport.wait(w.transport.batch_p2p([P2P("recv", buf, 1, 998)]))
    return time.perf_counter() - wall, time.process_time() - cpu, buf.tolist()


def test_long_wait_leaves_the_core(cluster, backend):
    """A wait for a peer that is busy elsewhere polls, then naps: it does not burn the core
    (a rank sharing it, often the very peer it waits for, would run at half speed)."""
    wall, cpu, got = cluster.run(2, _late_peer, backend=backend)[0]
    assert got == [1.0, 1.0, 1.0]
    assert wall > 0.5
    assert cpu < 0.5 * wall, (cpu, wall)


def _late_collective_peer(kind, block=None):
    """Rank 1 joins a collective 0.6 s late; rank 0 waits in it (gloo: torch's timed
    wait in slices, without the GIL, or naps between polls (``block``); MPI: polls, then
    naps)."""
    w = gpudist.world()
    if block is not None:
        was = w.transport.block_collectives
        w.transport.block_collectives = block
        try:
            return _late_collective_peer(kind)
        finally:
            w.transport.block_collectives = was
    g = w.transport.group(range(w.size))
    buf = torch.full((4,), float(w.rank + 1))
    w.transport.barrier()  # both clocks start together (a pool hands out a task to each
    # rank in turn: under load they began 0.25-0.35 s apart, and rank 0 waited < 0.5 s)
    if w.rank == 1:
        time.sleep(0.6)
    wall, cpu, waits = time.perf_counter(), time.process_time(), w.control.waits
    if kind == "broadcast":
        w.transport.wait([w.transport.broadcast(buf, 1, g)])
    else:
        w.transport.wait([w.transport.all_reduce(buf, g)])
    return (time.perf_counter() - wall, time.process_time() - cpu,
            w.control.waits - waits, buf.tolist())


def _check_late_collective(out, kind):
    want = [2.0] * 4 if kind == "broadcast" else [3.0] * 4
    assert out[1][3] == want and out[0][3] == want, out
    wall, cpu, waits, _ = out[0]
    assert wall > 0.5 and waits == 1, out[0]
    assert cpu < 0.5 * wall, (cpu, wall)


@pytest.mark.parametrize("kind", ["broadcast", "all_reduce"])
def test_late_peer_in_a_collective(cluster, backend, kind):
    """A collective whose peer comes late completes with the right data once it comes,
    and the wait meanwhile leaves the core."""
    _check_late_collective(cluster.run(2, _late_collective_peer, kind, backend=backend), kind)


@pytest.mark.parametrize("kind", ["broadcast", "all_reduce"])
@pytest.mark.parametrize("block", [True, False], ids=["block", "nap"])
def test_late_peer_in_a_gloo_collective_either_wait(cluster, kind, block):
    """The same with each of gloo's two ways of waiting for a collective."""
    _check_late_collective(cluster.run(2, _late_collective_peer, kind, block,
                                       backend="gloo"), kind)


def _wait_facts():
    w = gpudist.world()
    return w.ranks_here, w.transport.block_collectives if w.backend == "gloo" else None


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_here_and_gloo_wait(cluster, n):
    """Every rank of a pool counts the pool's ranks on this host; a gloo collective's
    wait blocks where they fit the cores and naps where they do not."""
    from gpudist.runtime import _cores

    for here, block in cluster.run(n, _wait_facts):
        assert here == n
        assert block == (n <= _cores())


def _bound_ranks():
    """Each rank bound to core (rank mod cores), as srun --cpu-bind=cores binds them: the
    start exchange counts the cores the host's ranks run on together, not this rank's."""
    import os

    from gpudist.runtime import _cores, _start_exchange

    w = gpudist.world()
    mine = os.sched_getaffinity(0)
    cores = sorted(mine)
    try:
        os.sched_setaffinity(0, {cores[w.rank % len(cores)]})
        # (the periodic check's period agreed too: the shortest asked for, 0 = none)
        _, every, here, together = _start_exchange(w, False, 100 * w.rank)
        alone = _cores()
    finally:
        os.sched_setaffinity(0, mine)
    return here, together, alone, len(cores), every


@pytest.mark.parametrize("n", [2, 3])
def test_cores_of_bound_ranks(cluster, n):
    for here, together, alone, cores, every in cluster.run(n, _bound_ranks):
        assert here == n and alone == 1 and every == 100
        assert together == min(n, cores)


@pytest.mark.parametrize("mode,here,cores,want", [
    (None, 2, 2, True), (None, 3, 2, False), ("auto", 4, 16, True), ("block", 4, 2, True),
    ("nap", 1, 16, False), (" NAP ", 1, 16, False)])
def test_gloo_wait_choice(monkeypatch, mode, here, cores, want):
    """GPUDIST_GLOO_WAIT: block, nap, or auto (block where this host's ranks fit its
    cores); a transport without the choice (MPI) is left alone."""
    from types import SimpleNamespace

    from gpudist import runtime

    if mode is None:
        monkeypatch.delenv("GPUDIST_GLOO_WAIT", raising=False)
    else:
        monkeypatch.setenv("GPUDIST_GLOO_WAIT", mode)
    monkeypatch.setattr(runtime, "_cores", lambda: cores)
    w = SimpleNamespace(ranks_here=here, cores_here=0,
                        transport=SimpleNamespace(block_collectives=None), control=None)
    runtime._choose_waits(w)
    assert w.transport.block_collectives is want
    other = SimpleNamespace(ranks_here=here, cores_here=0, transport=SimpleNamespace(),
                            control=None)
    runtime._choose_waits(other)
    assert not hasattr(other.transport, "block_collectives")


@pytest.mark.parametrize("env,here,cores,want", [
    (None, 2, 2, 5e-5), (None, 3, 2, 0.0), ("0.001", 4, 16, 0.001), ("0.001", 3, 2, 0.0),
    ("0", 1, 16, 0.0)])
def test_hot_spin_choice(monkeypatch, env, here, cores, want):
    """A spinning wait polls without yielding first (GPUDIST_HOT_SPIN_S, 50 us) only
    where this host's ranks fit its cores."""
    from types import SimpleNamespace

    from gpudist import runtime
    from gpudist.control import Control

    if env is None:
        monkeypatch.delenv("GPUDIST_HOT_SPIN_S", raising=False)
    else:
        monkeypatch.setenv("GPUDIST_HOT_SPIN_S", env)
    monkeypatch.setattr(runtime, "_cores", lambda: cores)
    w = SimpleNamespace(ranks_here=here, cores_here=0, transport=SimpleNamespace(),
                        control=Control(None, 0, 1, 10.0))
    runtime._choose_waits(w)
    assert w.control.hot_spin_s == want


@pytest.mark.parametrize("hot", [0.0, 60.0])
def test_spinning_wait_yields_after_its_hot_spin(monkeypatch, hot):
    """Within ``hot_spin_s`` a spinning wait polls without yielding the core; after it
    (and with none) it yields between polls."""
    from gpudist import control as control_mod

    yields = []
    monkeypatch.setattr(control_mod.os, "sched_yield", lambda: yields.append(1))
    c = control_mod.Control(None, 0, 1, 10.0)
    c.hot_spin_s = hot
    polls = iter(range(50))
    c.wait(lambda: next(polls) >= 40, "a test wait", spin=True)
    assert len(yields) == (0 if hot else 40)


def _finalize_late_peer():
    import gpudist
    from gpudist import runtime

    w = gpudist.world()
    barrier = runtime._last_barrier
    if w.rank == 1:  # as if still inside the last barrier (polling the store) for 0.5 s
        def late(world):
            barrier(world)
            time.sleep(0.5)
        runtime._last_barrier = late
    t = time.perf_counter()
    try:
        gpudist.finalize()
    finally:
        runtime._last_barrier = barrier
    return time.perf_counter() - t


def test_store_server_leaves_last(cluster, backend):
    """Rank 0 (the control store's server under MPI and mpiexec) leaves only after its peers
    have left the last barrier: a peer polling a store gone makes torch print a C++ stack
    trace."""
    took = cluster.run(2, _finalize_late_peer, backend=backend)
    cluster.discard(2, backend)  # the world is finalized
    assert took[0] >= 0.45, took
    assert took[1] >= 0.45, took


def _call_after_finalize():
    import gpudist.nn as gnn
    from gpudist import DistTensor

    P = Partition.grid((1, 1, 2))
    torch.manual_seed(0)
    conv = gnn.DistributedConv1d(P, 2, 2, 3, padding=1)
    x = DistTensor.from_local(torch.randn(1, 2, 4), P, (1, 2, 8))
    conv(x)
    root = Partition([1], (1, 1, 1))
    gpudist.finalize()
    out = []
    for build_new in (False, True):  # the old layer; a new primitive (distribute builds one)
        try:
            conv(x) if not build_new else distribute(
                torch.zeros(1, 2, 8) if root.active else torch.zeros(0), root, P,
                global_shape=(1, 2, 8))
        except gpudist.WorldFinalized as e:
            out.append(str(e))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_call_after_finalize_says_so(cluster, backend):
    """A layer called after finalize() raises WorldFinalized (it was the backend's error:
    gloo's 'Group ... is not registered', MPI's 'Null MPI_Request')."""
    out = cluster.run(2, _call_after_finalize, backend=backend)
    cluster.discard(2, backend)
    assert all(len(o) == 2 and all("finalize() was called" in t for t in o) for o in out), out


def test_missing_peer_times_out(cluster, backend):
    errs = cluster.run(2, _missing_peer, backend=backend, expect_error=True)
    cluster.discard(2, backend)  # a timed-out gloo pair is closed for good
    assert errs[0] is not None and errs[0].type == "CommTimeout", errs[0]
    assert errs[1] is None


def _backend_timeouts():
    import torch.distributed as dist

    w = gpudist.world()
    group = w.transport.group([0, 1])
    cpu = torch.device("cpu")
    sub = group.handle._get_backend(cpu).options._timeout if group.handle else None
    return (w.control.timeout,
            dist.distributed_c10d._get_default_group()._get_backend(cpu).options._timeout,
            sub)


def test_gloo_times_out_after_the_world(cluster):
    """gloo's own timeout comes after the world's, so that a silent peer ends in the
    control plane's CommTimeout naming it, not in gloo's "Timed out waiting ... for recv
    operation", which names no rank (with the two equal, gloo's won 3 runs of 16 of a
    peer's silent-peer test)."""
    res = cluster.run(3, _backend_timeouts)
    assert [sub is None for _, _, sub in res] == [False, False, True], res
    for world_s, default, sub in res:
        assert default.total_seconds() >= world_s + 2, (world_s, default)
        assert sub in (None, default), (sub, default)


@pytest.mark.parametrize("launcher", ["torchrun", "env", "mpiexec", "program-group"])
def test_join_again_after_finalize(launcher, tmp_path):
    """init -> collective -> finalize, three times in one job: each world works. With
    the default group the program's own (made before init), finalize leaves it working
    (a fuzz found it destroyed) and gpudist's world data moves on a group of its own (a
    user's all-reduce on the default group could pair with gpudist's)."""
    from tests.harness import ROOT, mpiexec

    script = str(ROOT / "tests" / "rejoin_script.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), REJOIN_BACKEND="gloo",
               REJOIN_PROGRAM_GROUP="1" if launcher == "program-group" else "0")
    if launcher in ("torchrun", "program-group"):
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                   "--standalone", "--nproc_per_node", "2", script],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
    elif launcher == "mpiexec":
        if mpiexec() is None:
            pytest.skip("mpiexec not installed")
        procs = [subprocess.Popen([mpiexec(), "-n", "2", sys.executable, script], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
    else:  # the variables a batch script sets itself; rank 0 serves the store
        base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, script], cwd=ROOT,
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:  # (a launcher asked to stop ends its ranks; killed, it would orphan them)
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-3000:]
    for r in range(2):
        for i in range(3):
            assert f"rank {r} world {i} gloo [2.0, 2.0]" in text, text[-3000:]
            if launcher == "program-group":
                assert f"rank {r} program group {i} {2.0 * i}" in text, text[-3000:]


def test_join_after_an_aborted_world_is_refused():
    """After a world aborted by one rank's error: init() again is a LaunchError at once
    on every rank (it reused the dead process group, and the next collective waited the
    whole timeout; fuzz-found)."""
    from tests.harness import ROOT

    script = str(ROOT / "tests" / "rejoin_after_abort.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), REJOIN_BACKEND="gloo")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    for r in range(2):
        assert f"rank {r} refused: gpudist.init(): this process's last world was aborted" \
            in out, out[-3000:]
    assert "joined again" not in out and time.monotonic() - t0 < 60, out[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- settings from the environment
def test_environment_settings_are_checked(monkeypatch):
    """GPUDIST_* values: the accepted forms, and a LaunchError naming the variable for
    others ('off' turned the call check on; 'abc' was a bare ValueError at import)."""
    from gpudist.envvars import flag, number
    from gpudist.errors import LaunchError

    for raw, want in (("1", True), ("Yes", True), ("on", True), ("off", False),
                      ("FALSE", False), ("0", False), ("", False)):
        monkeypatch.setenv("GPUDIST_X", raw)
        assert flag("GPUDIST_X", not want) is want, raw
    monkeypatch.delenv("GPUDIST_X")
    assert flag("GPUDIST_X", True) is True and number("GPUDIST_X", 2.5) == 2.5
    for raw in ("maybe", "2"):
        monkeypatch.setenv("GPUDIST_X", raw)
        with pytest.raises(LaunchError, match="GPUDIST_X"):
            flag("GPUDIST_X", False)
    monkeypatch.setenv("GPUDIST_X", "0.5")
    assert number("GPUDIST_X", 1.0) == 0.5
    for raw, kw in (("abc", {}), ("-1", {}), ("nan", {}), ("0", {"strict": True}),
                    ("0", {"minimum": 1, "integer": True}), ("1.5", {"integer": True})):
        monkeypatch.setenv("GPUDIST_X", raw)
        with pytest.raises(LaunchError, match=f"GPUDIST_X='{raw}'"):
            number("GPUDIST_X", 1.0, **kw)


_BAD_SETTINGS = [("GPUDIST_DIAG_AFTER", "abc"), ("GPUDIST_COMM_TIMEOUT", "0"),
                 ("GPUDIST_PLAN_CACHE", "0"), ("GPUDIST_FORCE_STAGING", "maybe"),
                 ("GPUDIST_SPIN_S", "-1"), ("GPUDIST_PACKER", "bogus"),
                 ("GPUDIST_GLOO_WAIT", "spin"), ("GPUDIST_COMM_TIMEOUT", "1e300"),
                 ("GPUDIST_COMM_TIMEOUT", "0.0001"), ("GPUDIST_EXIT_TEARDOWN_S", "99999999999"),
                 ("GPUDIST_NAP_MAX_S", "1e6"), ("GPUDIST_CHECK_EVERY", "-1"),
                 ("GPUDIST_CHECK_EVERY", "2.5")]


def test_a_bad_setting_is_named_at_init():
    """In one fresh process, imported with bad values set (nothing is read at import: three
    were, which ended the importing rank alone): each bad value alone is a LaunchError
    naming it, before anything is joined (the transports' and the control plane's were
    read after the process group existed); then an 'off' switch is off."""
    code = """
import json, os
import torch.distributed as dist
import gpudist
cases = json.loads(os.environ.pop("CASES"))
for var, _ in cases:
    os.environ.pop(var, None)
for var, value in cases:
    os.environ[var] = value
    try:
        print("joined", var, value, gpudist.init())
    except gpudist.LaunchError as e:
        print("refused", var, value, "|", e, "| joined:", dist.is_initialized())
    del os.environ[var]
os.environ["GPUDIST_CHECK_CALLS"] = "off"
os.environ["GPUDIST_CHECK_EVERY"] = "0"
w = gpudist.init()
never = w.check_every == gpudist.runtime.NEVER
w.check_every = 8
w.check_every = 0  # (set on the world: 0 is never too, not a modulo by zero)
print("every", never and w.check_every == gpudist.runtime.NEVER)
print("check", w.check_calls)
"""
    env = dict(os.environ, CASES=json.dumps(_BAD_SETTINGS), **dict(_BAD_SETTINGS))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.rstrip().endswith("every True\ncheck False"), out
    lines = p.stdout.splitlines()
    for var, value in _BAD_SETTINGS:
        line = next((ln for ln in lines if ln.startswith(f"refused {var} {value} |")), None)
        assert line is not None, (var, value, out)
        assert f"| environment variable {var}" in line and line.endswith("joined: False"), line


def test_init_again_with_another_backend_is_refused():
    """A joined world is returned by init(); asking for another backend (or an unknown
    one) is a LaunchError, not the joined world silently."""
    p = subprocess.run([sys.executable, "-c", """
import gpudist
from gpudist.errors import LaunchError
w = gpudist.init(backend="gloo")
assert gpudist.init() is w and gpudist.init(backend="gloo") is w
for b in ("mpi", "nosuch"):
    try:
        gpudist.init(backend=b)
    except LaunchError as e:
        print("refused", b, str(e)[:60])
"""], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "refused mpi" in p.stdout and "refused nosuch" in p.stdout, p.stdout


def test_timed_wait_slices():
    """gloo's timed wait: a slice that times out returns at once (the control plane's loop
    checks, then waits again); one that fails leaving the work pending naps first (the
    loop must not spin until its timeout); a completed work returns."""
    from types import SimpleNamespace

    from gpudist.transport.torch_dist import _timed_wait

    def work(err, completed=False):
        def wait(timeout):
            if err:
                raise RuntimeError(err)
            return True
        return SimpleNamespace(wait=wait, is_completed=lambda: completed)

    for err, completed, slow in (("Operation timed out!", False, False),
                                 ("Connection closed by peer", False, True),
                                 ("Connection closed by peer", True, False), (None, True, False)):
        block = _timed_wait(work(err, completed))
        t = time.perf_counter()
        for _ in range(20):
            block(0.01)
        took = time.perf_counter() - t
        assert (took >= 0.015) == slow, (err, completed, took)


def _reduce_scatter_dtypes():
    """The transport's reduce-scatter over a group of ranks 1..n-1 (gloo: an all-to-all of
    the chunks summed on arrival), for several dtypes: each member's slot of the sum, its
    input left as it was."""
    w = gpudist.world()
    members = list(range(1, w.size))
    g = w.transport.group(members)
    if w.rank not in members:
        return True
    k, me = len(members), members.index(w.rank)
    ok = True
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int32, torch.bool):
        gen = torch.Generator().manual_seed(7)
        every = [(torch.rand(k * 5, generator=gen) * 4).to(dtype) for _ in members]
        inp = every[me].clone()
        out = torch.empty(5, dtype=dtype)
        w.transport.wait([w.transport.reduce_scatter(out, inp, g)])
        want = every[0].clone()
        for e in every[1:]:
            want = want + e if dtype != torch.bool else want | e
        ok = ok and torch.equal(inp, every[me]) and torch.allclose(
            out.double(), want[me * 5:(me + 1) * 5].double(), atol=1e-2)
    return ok


def test_transport_reduce_scatter_dtypes_and_subgroup(cluster, backend):
    assert all(cluster.run(4, _reduce_scatter_dtypes, backend=backend))


def _reduce_scatters_in_flight(staged):
    """Two reduce-scatters over one group started before one wait (inputs of one shape,
    then of two shapes with one count): each its own sum. ``staged``: through host
    staging buffers, as device tensors a backend cannot take go."""
    w = gpudist.world()
    tr, n = w.transport, w.size
    g = tr.group(range(n))
    was, tr.stage_all = tr.stage_all, staged
    got = []
    try:
        for shape_b in ((n, 6), (2 * n, 3)):
            a = torch.full((n, 6), 1.0 + w.rank, dtype=torch.float64)
            b = torch.full(shape_b, 100.0 + 10 * w.rank, dtype=torch.float64)
            oa, ob = torch.empty(6, dtype=torch.float64), torch.empty(6, dtype=torch.float64)
            tr.wait([tr.reduce_scatter(oa, a, g), tr.reduce_scatter(ob, b, g)])
            got.append((oa.tolist(), ob.tolist()))
    finally:
        tr.stage_all = was
    return got


_IN_FLIGHT_WANT = ([6.0] * 6, [330.0] * 6)  # 3 ranks: 1 + 2 + 3, 100 + 110 + 120


def test_reduce_scatters_in_flight_keep_their_own_chunks(cluster, backend):
    """gloo's reduce-scatter stages the chunks it receives: two calls in flight shared one
    buffer, and the first summed the second's chunks (randomized check, round O)."""
    for got in cluster.run(3, _reduce_scatters_in_flight, False, backend=backend):
        assert got == [_IN_FLIGHT_WANT, _IN_FLIGHT_WANT], got


def test_staged_reduce_scatters_in_flight(cluster, backend):
    """The same through host staging (device tensors on gloo or a host-only MPI): the
    staged inputs of two calls in flight shared one buffer too (the review of round O)."""
    for got in cluster.run(3, _reduce_scatters_in_flight, True, backend=backend):
        assert got == [_IN_FLIGHT_WANT, _IN_FLIGHT_WANT], got


def _staged_broadcasts_in_flight():
    """Two broadcasts from rank 1 of equal-shaped tensors, both started before one wait,
    through host staging: each receiver gets each its own."""
    w = gpudist.world()
    tr = w.transport
    g = tr.group(range(w.size))
    was, tr.stage_all = tr.stage_all, True
    try:
        a = torch.full((5,), 1.0 if w.rank == 1 else -1.0)
        b = torch.full((5,), 2.0 if w.rank == 1 else -1.0)
        tr.wait([tr.broadcast(a, 1, g), tr.broadcast(b, 1, g)])
        return a.tolist(), b.tolist()
    finally:
        tr.stage_all = was


def test_staged_collectives_in_flight_keep_their_own_buffers(cluster, backend):
    """Host staging kept one buffer per use, group and shape, so two equal collectives in
    flight shared it (the review of round O): now one per operation in flight."""
    for a, b in cluster.run(3, _staged_broadcasts_in_flight, backend=backend):
        assert a == [1.0] * 5 and b == [2.0] * 5, (a, b)


def test_exit_naps_while_process_groups_live(monkeypatch):
    """gpudist's exit handler naps where process groups are alive (a gloo worker thread
    can then drop a finished collective while the GIL can still be taken: without it,
    SIGABRT at exit in ~3 % of runs of an aborted world's program under torchrun), and
    not where none are."""
    import torch.distributed as dist

    from gpudist import runtime

    naps = []
    monkeypatch.setattr(runtime, "_WORLD", None)
    monkeypatch.setattr(runtime.time, "sleep", naps.append)
    for live in (True, False):
        monkeypatch.setattr(dist, "is_initialized", lambda live=live: live)
        runtime._at_exit()
    assert naps == [runtime.GLOO_SETTLE_S] and runtime.GLOO_SETTLE_S >= 0.05, naps
