"""Helpers shared by multi-rank tests (run inside rank pools)."""

import math
import os
from contextlib import contextmanager

import torch

from gpudist import Decomposition, Partition
from gpudist.primitives import zero_volume


@contextmanager
def forced_staging():
    """Inside: every tensor through this rank's transport's staging buffers (the path CUDA
    tensors take over gloo and a host-only MPI); the previous setting and empty buffers
    after."""
    import gpudist

    tr = gpudist.world().transport
    was = tr.stage_all
    tr.stage_all = True
    try:
        yield tr
    finally:
        tr.stage_all = was
        tr.staging.clear()


@contextmanager
def without_periodic_check():
    """Inside: this rank's periodic call check off (for tests that count operators,
    metadata exchanges or allocations: its exchange every ``check_every`` operators of a
    group would land in their window by the chance of the pool's history)."""
    import gpudist
    from gpudist.runtime import NEVER

    w = gpudist.world()
    every, w.check_every = w.check_every, NEVER
    try:
        yield w
    finally:
        w.check_every = every


@contextmanager
def counted_meta_exchanges():
    """Inside: a list that gets an entry per metadata exchange this rank's transport
    makes (the periodic call check off)."""
    with without_periodic_check() as w:
        calls, orig = [], w.transport.meta_all_gather
        w.transport.meta_all_gather = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
        try:
            yield calls
        finally:
            del w.transport.meta_all_gather


def global_tensor(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def block_of(G: torch.Tensor, P: Partition) -> torch.Tensor:
    """This rank's block of the global tensor G under P (zero-volume if inactive)."""
    if not P.active:
        return zero_volume(G.dim(), like=G)
    sl = Decomposition(tuple(G.shape), P.shape).global_slices(P.coords)
    return G[sl].clone()


def gather(t: torch.Tensor, P: Partition, gshape, root: Partition | None = None):
    """The global tensor whose block ``t`` is (this rank's block over ``P``) on the root
    worker (P's first), zero-volume elsewhere; returns (tensor, root partition)."""
    from gpudist import DistTensor
    from gpudist.primitives import Repartition

    root = root or Partition([P.ranks[0]], (1,) * P.dim)
    x = DistTensor.from_local(t.detach(), P, tuple(gshape))
    return Repartition(P, root)(x).local, root


def assert_raised_everywhere(errs, kind: str, text: str) -> None:
    """Every rank's error (from ``cluster.run(..., expect_error=True)``) is ``kind`` and
    names ``text``."""
    assert all(e is not None and e.type == kind and text in e.message for e in errs), errs


def maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|: equal infinities (and NaN against NaN) count as 0, NaN against a
    number as inf (a plain difference would give NaN, and ``NaN > tol`` is false)."""
    if not a.numel():
        return 0.0
    same = (a == b) | (a.isnan() & b.isnan())
    d = (a - b).abs()  # real, also for complex tensors
    d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
    return float(torch.nan_to_num(d, nan=math.inf).max())


def global_checkpoint_roundtrip(build, path: str, prepare=None):
    """Layers from ``build(1)`` with perturbed parameters (then ``prepare(layers)``) ->
    global state dicts -> ``torch.save`` (rank 0) -> fresh layers ``build(2)`` load them.
    Returns (first layers, second layers, the loaded dicts, the second layers' global
    state dicts, whether every parameter of this rank came back equal)."""
    from gpudist.runtime import require_world

    world = require_world(None)
    a = build(1)
    with torch.no_grad():
        for layer in a.values():
            for p in layer.parameters():
                p.add_(torch.rand(p.shape, dtype=p.dtype))  # not the initial values
    if prepare is not None:  # e.g. a forward that moves running statistics
        prepare(a)
    sd = {k: layer.global_state_dict() for k, layer in a.items()}
    if world.rank == 0:
        torch.save(sd, path)
    world.transport.barrier()
    loaded = torch.load(path)
    b = build(2)
    for k, layer in b.items():
        layer.load_global_state_dict(loaded[k])
    sd2 = {k: layer.global_state_dict() for k, layer in b.items()}
    same = all(torch.equal(p, q) for k in a for p, q in
               zip(a[k].parameters(), b[k].parameters()))
    return a, b, loaded, sd2, same


def assert_program_facts(facts: dict, backend: str, made_key: str, n_facts) -> None:
    """A rank's facts about a transport program: made (persistent) on MPI unless
    GPUDIST_MPI_PERSISTENT=0 turned it off, as the rank's transport expected; then
    ``n_facts(made)`` more facts, every one true."""
    made = facts.pop(made_key)
    assert made == facts.pop("expected") and made == (backend == "mpi") or \
        os.environ.get("GPUDIST_MPI_PERSISTENT") == "0" and not made, facts
    assert len(facts) == n_facts(made) and all(facts.values()), facts
