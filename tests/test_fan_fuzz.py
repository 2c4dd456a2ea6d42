"""Seeded randomized Broadcast / SumReduce between random partitions.

Each configuration draws a world size (2-6), a destination grid (1-3 dimensions) on a
random ordered subset of the ranks, a source grid that broadcasts to it (each extent equal
or 1; read transposed sometimes, in 2-D) on another random subset (overlapping it or
not), and checks on every rank: Broadcast gives each destination worker its source
block, SumReduce back gives each source worker the sum of its fan (and leaves its input
alone), both pass the adjoint test. Ranks take several roles at once (root of one fan,
member of another), which is what the fans' communicators and the sums' trees (run
together on a rank in two roles) must get right. Every other configuration runs twice
with 3-10 other block shapes in between (a cache holds 8). On gloo and on MPI.

``GPUDIST_FAN_FUZZ_N`` (default 16) and ``GPUDIST_FAN_FUZZ_SEED`` (default 12; with it the
test caught the reduce programs' shared cache of 2026-11-24, a hang; the programs are
gone since) choose them.
"""

import os
import random

import pytest
import torch

import gpudist
from gpudist import Partition
from gpudist.primitives import Broadcast, SumReduce
from gpudist.testing import adjoint_mismatch
from tests.conftest import BACKENDS
from tests.util import global_tensor

N = int(os.environ.get("GPUDIST_FAN_FUZZ_N", "16"))
SEED = int(os.environ.get("GPUDIST_FAN_FUZZ_SEED", "12"))


def _draw(rng: random.Random) -> dict:
    n = rng.randint(2, 6)
    d = rng.randint(1, 3)
    dst, left = [], n
    for _ in range(d):
        k = rng.choice([x for x in range(1, left + 1) if left // x >= 1])
        dst.append(k)
        left //= k
    view = [s if rng.random() < 0.5 else 1 for s in dst]
    transpose = d == 2 and rng.random() < 0.3
    src = view[::-1] if transpose else view
    p_dst = 1
    for s in dst:
        p_dst *= s
    p_src = 1
    for s in src:
        p_src *= s
    dst_ranks = rng.sample(range(n), p_dst)
    # often the sources among the destinations: ranks with two roles
    pool = dst_ranks if p_src <= p_dst and rng.random() < 0.6 else list(range(n))
    return {"n": n, "dst": tuple(dst), "dst_ranks": dst_ranks,
            "src": tuple(src), "src_ranks": rng.sample(pool, p_src),
            "transpose": transpose, "rows": rng.randint(1, 4), "cols": rng.randint(1, 5),
            "others": rng.randint(3, 10)}


CASES = [_draw(random.Random(SEED * 1000 + i)) for i in range(N)]


def _block(P: Partition, shape, seed: int) -> torch.Tensor:
    if not P.active:
        return torch.zeros((0,) * len(shape), dtype=torch.float64)
    return global_tensor(shape, seed=seed + 100 * P.index)


def _one(cfg: dict, Ps: Partition, Pd: Partition, B: Broadcast, S: SumReduce, shape
         ) -> list[str]:
    """Broadcast then SumReduce for one configuration and block shape: what went wrong."""
    t = cfg["transpose"]
    Pv = Ps.transpose() if t else Ps
    me = gpudist.world().rank
    bad = []
    x = _block(Ps, shape, 1)
    y = B(x)
    if Pd.active:
        src = Pv.world_rank_of(tuple(c if s > 1 else 0 for c, s in zip(Pd.coords, Pv.shape)))
        if not torch.equal(y, global_tensor(shape, seed=1 + 100 * Ps.ranks.index(src))):
            bad.append("broadcast value")
    elif y.numel():
        bad.append("broadcast gave an inactive rank data")
    before = y.clone()
    s = S(y)
    if not torch.equal(y, before):
        bad.append("sumreduce changed its input")
    if Ps.active:
        fan = [r for i, r in enumerate(Pd.ranks) if Pv.world_rank_of(tuple(
            c if sz > 1 else 0 for c, sz in zip(Pd.coords_of(i), Pv.shape))) == me]
        if not torch.allclose(s, len(fan) * x, rtol=0, atol=1e-12):
            bad.append(f"sumreduce value (fan of {len(fan)})")
    if adjoint_mismatch(B, x) > 1e-13:
        bad.append("broadcast adjoint")
    z = y.detach() if Pd.active else torch.zeros((0,) * len(shape), dtype=torch.float64)
    if adjoint_mismatch(S, z) > 1e-13:
        bad.append("sumreduce adjoint")
    return bad


def _run(cfgs: list[dict]) -> list[tuple[int, list[str]]]:
    out = []
    for i, cfg in enumerate(cfgs):
        base = (cfg["rows"], cfg["cols"])
        shapes = [base]
        if i % 2:  # the base shape again after 3-10 others (a cache holds 8)
            shapes += [(base[0] + k, base[1]) for k in range(1, 1 + cfg["others"])] + [base]
        Ps = Partition(cfg["src_ranks"], cfg["src"])
        Pd = Partition(cfg["dst_ranks"], cfg["dst"])
        B = Broadcast(Ps, Pd, transpose_src=cfg["transpose"])  # kept: their plans and
        S = SumReduce(Pd, Ps, transpose_dst=cfg["transpose"])  # pooled buffers too
        bad = []
        for shape in shapes:
            bad += _one(cfg, Ps, Pd, B, S, shape)
        out.append((i, sorted(set(bad))))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_fans_between_random_partitions(cluster, backend):
    by_n: dict[int, list[dict]] = {}
    for cfg in CASES:
        by_n.setdefault(cfg["n"], []).append(cfg)
    for n, cfgs in sorted(by_n.items()):
        for rank, res in enumerate(cluster.run(n, _run, cfgs, backend=backend,
                                               timeout=120)):
            for i, bad in res:
                assert not bad, (rank, cfgs[i], bad)
