"""Distributed up-/down-sampling equals torch's ``nn.Upsample`` / ``F.interpolate`` (gathered,
float64, forward and input gradient): nearest, nearest-exact, linear/bilinear/trilinear with
both align_corners, bicubic, area; up (x2, x3, 1.7) and down (0.5, smaller size); 1-D to
3-D; uneven sizes; partitions on a subset of the world (inactive ranks); batch/channel
splits; MPI; adjoint test; two input shapes in a row; bad options raise on every rank.

Nearest modes: where torch's CPU forward uses its generic index rule, torch's backward
(always the ``nearest_idx`` rule) is not the adjoint of its forward. The reference gradient
of nearest modes is therefore the exact adjoint of torch's forward (found by running the
forward on the input's flat indices), and each case records whether torch's own gradient
agrees: it must for every case but the ones marked ``torch_bwd_differs``.

Many cases run per ``cluster.run`` call to keep the runtime low."""

import pytest
import torch

import gpudist.nn as gnn
from gpudist import HaloError, Partition, TensorSpec
from gpudist.decomposition import Decomposition
from gpudist.halo import HaloGeometry
from gpudist.nn.sampling import source_taps, uses_legacy_nearest
from gpudist.primitives import zero_volume
from gpudist.testing import adjoint_mismatch
from tests.conftest import HAS_MPI
from tests.test_pooling import _maxerr, _shapes_agree
from tests.util import block_of, gather, global_tensor

TOL = 1e-10
WORLD = 4


def _reference(G, dY, opts):
    """torch's output and the reference input gradient (see the module docstring), plus
    whether torch's own gradient equals that reference."""
    seq = torch.nn.Upsample(**opts)
    Gs = G.clone().requires_grad_(True)
    Y = seq(Gs)
    if 0 in Y.shape[2:]:  # area mode's empty output: torch's backward raises; the adjoint of
        return Y.detach(), torch.zeros_like(G), False  # a map to nothing is 0
    Y.backward(dY)
    if not opts.get("mode", "nearest").startswith("nearest"):
        return Y.detach(), Gs.grad, True
    src = seq(torch.arange(G.numel(), dtype=torch.float64).reshape(G.shape))
    dx = torch.zeros(G.numel(), dtype=dY.dtype).index_add_(0, src.flatten().long(), dY.flatten())
    dx = dx.reshape(G.shape)
    return Y.detach(), dx, _maxerr(dx, Gs.grad) < TOL


def _equivalence(pshape, ranks, gshape, opts, layer=None):
    """Forward + input gradient of the distributed layer vs torch on the global tensor;
    errors on the gathering root, shapes everywhere (zero-volume where inactive)."""
    P = Partition(ranks, pshape)
    layer = layer or gnn.DistributedUpsample(P, **opts)
    G = global_tensor(gshape, seed=1)
    x = block_of(G, P).requires_grad_(True)
    y = layer(x)
    Yshape = torch.nn.Upsample(**opts)(G).shape
    want = Decomposition(tuple(Yshape), P.shape).local_shape(P.coords) if P.active else \
        (0,) * y.dim()
    if not _shapes_agree(tuple(y.shape) == tuple(want)):
        return {"inactive_numel": 0, "shape": float("inf")}
    dY = global_tensor(Yshape, seed=2)
    y.backward(block_of(dY, P) if P.active else zero_volume(y.dim(), like=y))
    root = Partition([P.ranks[0]], (1,) * P.dim)
    yg = gather(y.detach(), P, Yshape, root)[0]
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    dxg = gather(dx, P, G.shape, root)[0]
    out = {"inactive_numel": 0 if P.active else y.numel() + dx.numel()}
    if root.active:
        Y, dx_ref, torch_agrees = _reference(G, dY, opts)
        out.update(y=_maxerr(yg, Y), dx=_maxerr(dxg, dx_ref), torch_bwd_agrees=torch_agrees)
    return out


def _equivalence_cases(cases):
    return [_equivalence(*c[1:5]) for c in cases]


def _up(mode, align=None, **kw):
    opts = dict(mode=mode, **kw)
    if align is not None:
        opts["align_corners"] = align
    return opts


# id, partition, world ranks, global shape, torch.nn.Upsample options[, torch_bwd_differs]
CASES_1D = [
    ("1d-nearest-x2", (1, 1, 4), [0, 1, 2, 3], (2, 2, 23), _up("nearest", scale_factor=2)),
    ("1d-nearest-1.7", (1, 1, 3), [1, 2, 3], (1, 2, 19), _up("nearest", scale_factor=1.7)),
    ("1d-nearest-down", (1, 1, 4), [0, 1, 2, 3], (2, 1, 21), _up("nearest", scale_factor=0.5)),
    ("1d-nearest-size", (1, 1, 3), [0, 2, 3], (1, 2, 25), _up("nearest", size=9)),
    ("1d-nearest-2.01", (1, 1, 2), [0, 1], (1, 1, 12), _up("nearest", scale_factor=2.01), True),
    ("1d-exact-1.7", (1, 1, 4), [0, 1, 2, 3], (1, 2, 18), _up("nearest-exact", scale_factor=1.7)),
    ("1d-linear-x3-ac", (1, 1, 4), [0, 1, 2, 3], (1, 2, 17), _up("linear", True, scale_factor=3)),
    ("1d-linear-x3", (1, 1, 3), [1, 2, 3], (2, 1, 14), _up("linear", False, scale_factor=3)),
    ("1d-linear-1.7-ac", (1, 1, 2), [2, 3], (1, 2, 13), _up("linear", True, scale_factor=1.7)),
    ("1d-linear-1.7", (1, 1, 4), [0, 1, 2, 3], (1, 1, 22), _up("linear", False, scale_factor=1.7)),
    ("1d-linear-down", (1, 1, 4), [0, 1, 2, 3], (1, 2, 30), _up("linear", False, scale_factor=0.5)),
    ("1d-linear-down-ac", (1, 1, 3), [0, 1, 2], (2, 1, 27),
     _up("linear", True, scale_factor=0.5)),
    ("1d-linear-size-ac", (1, 1, 3), [0, 1, 3], (1, 2, 25), _up("linear", True, size=11)),
    ("1d-linear-size", (1, 1, 4), [0, 1, 2, 3], (1, 1, 26), _up("linear", False, size=15)),
    ("1d-linear-recompute", (1, 1, 3), [0, 1, 2], (1, 1, 19),
     _up("linear", False, scale_factor=1.7, recompute_scale_factor=True)),
    ("1d-area-size", (1, 1, 3), [1, 2, 3], (2, 2, 25), _up("area", size=9)),
    ("1d-area-up", (1, 1, 4), [0, 1, 2, 3], (1, 1, 13), _up("area", scale_factor=1.7)),
    ("1d-batch-split", (2, 1, 2), [0, 1, 2, 3], (3, 2, 14), _up("linear", False, scale_factor=2)),
    ("1d-empty-block", (1, 1, 4), [0, 1, 2, 3], (1, 2, 3), _up("linear", False, scale_factor=3)),
    ("1d-batch-0", (1, 1, 2), [0, 1], (0, 1, 5), _up("linear", False, scale_factor=2)),
]

CASES_2D = [
    ("2d-nearest-x2", (1, 1, 2, 2), [0, 1, 2, 3], (2, 2, 11, 9), _up("nearest", scale_factor=2)),
    ("2d-nearest-3x1.7", (1, 1, 2, 1), [2, 3], (1, 2, 9, 14),
     _up("nearest", scale_factor=(3, 1.7))),
    ("2d-nearest-down", (1, 1, 1, 3), [0, 1, 2], (1, 1, 16, 23),
     _up("nearest", scale_factor=0.5)),
    ("2d-nearest-big-x2", (1, 1, 2, 2), [0, 1, 2, 3], (1, 1, 40, 50),  # output H+W > 128
     _up("nearest", scale_factor=2)),
    ("2d-nearest-big-1.7", (1, 1, 2, 2), [0, 1, 2, 3], (1, 1, 45, 41),  # output H+W > 128
     _up("nearest", scale_factor=1.7)),
    ("2d-exact-size", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 13, 11),
     _up("nearest-exact", size=(7, 19))),
    ("2d-bilinear-x2", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 13, 10),
     _up("bilinear", False, scale_factor=2)),
    ("2d-bilinear-x2-ac", (1, 1, 2, 2), [0, 1, 2, 3], (2, 1, 9, 12),
     _up("bilinear", True, scale_factor=2)),
    ("2d-bilinear-1.7-ac", (1, 1, 1, 3), [1, 2, 3], (2, 1, 9, 16),
     _up("bilinear", True, scale_factor=1.7)),
    ("2d-bilinear-x3-1.7", (1, 1, 3, 1), [0, 1, 3], (1, 1, 11, 8),
     _up("bilinear", False, scale_factor=(3, 1.7))),
    ("2d-bilinear-down", (1, 1, 3, 1), [0, 1, 3], (1, 2, 20, 11),
     _up("bilinear", False, scale_factor=(0.5, 0.75))),
    ("2d-bilinear-size-ac", (1, 1, 2, 2), [0, 1, 2, 3], (1, 1, 15, 12),
     _up("bilinear", True, size=(7, 5))),
    ("2d-bilinear-down-ac", (1, 1, 2, 1), [1, 3], (1, 2, 18, 9),
     _up("bilinear", True, scale_factor=0.5)),
    ("2d-bicubic-x2", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 12, 10),
     _up("bicubic", False, scale_factor=2)),
    ("2d-bicubic-down-ac", (1, 1, 1, 2), [0, 3], (1, 1, 11, 17),
     _up("bicubic", True, scale_factor=0.6)),
    ("2d-area-size", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 13, 11), _up("area", size=(5, 4))),
    # torch's area mode gives an empty output where a size comes to 0 (the other modes
    # refuse), but its backward raises: gpudist's gradient is the adjoint's, 0
    ("2d-area-empty-out", (1, 1, 2, 2), [0, 1, 2, 3], (2, 1, 1, 9),
     _up("area", scale_factor=(0.5, 1.5)), True),
    ("2d-channel-split", (1, 2, 2, 1), [0, 1, 2, 3], (1, 4, 10, 9),
     _up("bilinear", False, scale_factor=2)),
    ("2d-batch-only", (4, 1, 1, 1), [0, 1, 2, 3], (5, 2, 9, 7),  # F.interpolate per block
     _up("bilinear", True, scale_factor=1.7)),
]

CASES_3D = [
    ("3d-nearest-x2", (1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 5, 4, 7),
     _up("nearest", scale_factor=2)),
    ("3d-nearest-down", (1, 1, 1, 3, 1), [1, 2, 3], (1, 1, 6, 13, 5),
     _up("nearest", scale_factor=(0.5, 0.5, 1.7))),
    ("3d-exact-size", (1, 1, 1, 2, 2), [0, 1, 2, 3], (1, 1, 5, 9, 8),
     _up("nearest-exact", size=(3, 14, 5))),
    ("3d-trilinear-x2", (1, 1, 2, 2, 1), [0, 1, 2, 3], (1, 1, 6, 5, 4),
     _up("trilinear", False, scale_factor=2)),
    ("3d-trilinear-mixed-ac", (1, 1, 1, 1, 3), [0, 1, 2], (1, 2, 4, 6, 11),
     _up("trilinear", True, scale_factor=(1.7, 0.5, 3))),
    ("3d-trilinear-size", (1, 1, 1, 2, 2), [0, 1, 2, 3], (1, 1, 5, 9, 8),
     _up("trilinear", False, size=(3, 5, 4))),
    ("3d-trilinear-size-ac", (1, 1, 2, 1, 1), [2, 3], (2, 1, 7, 4, 5),
     _up("trilinear", True, size=(4, 6, 3))),
    ("3d-area-size", (1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 7, 5, 9), _up("area", size=(4, 5, 6))),
    ("3d-area-size-0", (1, 1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 5, 6, 4),
     _up("area", size=(3, 0, 4)), True),
]


def _check(cases, results):
    roots = 0
    for case, per_rank in zip(cases, zip(*results)):
        for r in per_rank:
            assert r.pop("inactive_numel") == 0, case[0]
            if r:
                roots += 1
                differs = len(case) > 5 and case[5]
                assert r.pop("torch_bwd_agrees") is not differs, (case[0], "torch gradient")
            assert all(v < TOL for v in r.values()), (case[0], r)
    assert roots == len(cases)  # exactly one rank compared each case


@pytest.mark.parametrize("cases", [CASES_1D, CASES_2D, CASES_3D], ids=["1d", "2d", "3d"])
def test_upsample_equivalence(cluster, cases):
    _check(cases, cluster.run(WORLD, _equivalence_cases, cases))


def test_cases_cover_both_nearest_rules():
    """The 2-D nearest cases exercise both of torch's index rules (see sampling.py)."""
    legacy = set()
    for _, _, _, gshape, opts, *_ in CASES_2D:
        if opts["mode"] == "nearest":
            out = torch.nn.Upsample(**opts)(torch.zeros(gshape)).shape[2:]
            legacy.add(uses_legacy_nearest(out))
    assert legacy == {True, False}
    # torch's scale_factor rule: 1/scale_factor, not L/M (here 1/1.7 != 13/22)
    a = source_taps("linear", 13, 22, False, 1.7).weight
    b = source_taps("linear", 13, 22, False, None).weight
    assert not torch.equal(a, b)


@pytest.mark.skipif(not HAS_MPI, reason="mpi4py or mpiexec not installed")
def test_upsample_equivalence_mpi(cluster):
    cases = [CASES_1D[6], CASES_1D[15], CASES_2D[0], CASES_2D[8], CASES_2D[13], CASES_3D[4]]
    _check(cases, cluster.run(WORLD, _equivalence_cases, cases, backend="mpi"))


def _adjoints(cases):
    out = []
    for _, pshape, ranks, gshape, opts, *_ in cases:
        P = Partition(ranks, pshape)
        layer = gnn.DistributedUpsample(P, **opts)
        x = block_of(global_tensor(gshape, seed=3), P)
        out.append(adjoint_mismatch(layer, x, seed=4))
    return out


def test_upsample_adjoint(cluster):
    """Interpolation is linear: <A x, y> = <x, A* y> with A* the autograd backward (index_add
    of the weighted taps, then the halo exchange's adjoint)."""
    cases = [CASES_1D[4], CASES_1D[11], CASES_1D[15], CASES_2D[4], CASES_2D[8], CASES_2D[14],
             CASES_3D[4]]
    for per_case in zip(*cluster.run(WORLD, _adjoints, cases)):
        assert len(set(per_case)) == 1  # the same value on every rank
        assert per_case[0] < 1e-13, per_case


def _unsplit_nearest():
    """No spatial split, nearest, scale 4/3 on length 2: torch's forward reads entry 0 twice,
    its backward hands back the identity; the layer's gradient must be the adjoint."""
    P = Partition([0], (1, 1, 1))
    layer = gnn.DistributedUpsample(P, scale_factor=4 / 3, mode="nearest")
    x = torch.tensor([[[1.0, 2.0]]], dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.backward(torch.tensor([[[10.0, 100.0]]], dtype=torch.float64))
    return y.detach().tolist(), x.grad.tolist(), adjoint_mismatch(layer, x.detach(), seed=4)


def test_nearest_gradient_is_the_adjoint_without_a_spatial_split(cluster):
    y, dx, mismatch = cluster.run(1, _unsplit_nearest)[0]
    assert y == [[[1.0, 1.0]]]
    assert dx == [[[110.0, 0.0]]]
    assert mismatch < 1e-13


def _two_shapes():
    """One layer, two global input shapes in a row (a new plan per shape), then the first
    again (the cached plan)."""
    pshape, ranks = (1, 1, 2, 2), [0, 1, 2, 3]
    opts = _up("bilinear", False, scale_factor=1.7)
    P = Partition(ranks, pshape)
    layer = gnn.DistributedUpsample(P, **opts)
    return [_equivalence(pshape, ranks, g, opts, layer) for g in
            ((1, 2, 13, 10), (2, 1, 9, 17), (1, 2, 13, 10))] + [{"inactive_numel": 0,
                                                                 "plans": len(layer._plans) - 2}]


def test_two_input_shapes_in_a_row(cluster):
    for r in cluster.run(WORLD, _two_shapes):
        assert r[-1]["plans"] == 0
        for c in r:
            c.pop("inactive_numel")
            c.pop("torch_bwd_agrees", None)
            assert all(v < TOL for v in c.values()), r


BAD = [
    (1, dict(size=8, scale_factor=2), "ValueError", "size or scale_factor"),
    (2, dict(mode="nearest"), "ValueError", "size or scale_factor"),
    (1, dict(scale_factor=2, mode="bilinear"), "ValueError", "mode"),
    (2, dict(scale_factor=2, mode="linear"), "ValueError", "mode"),
    (3, dict(scale_factor=2, mode="bicubic"), "ValueError", "mode"),
    (2, dict(scale_factor=2, mode="cubic"), "ValueError", "mode"),
    (2, dict(scale_factor=2, mode="nearest", align_corners=True), "ValueError", "align_corners"),
    (1, dict(scale_factor=2, mode="area", align_corners=False), "ValueError", "align_corners"),
    (2, dict(size=(4, 5, 6)), "ValueError", "size"),
    (3, dict(scale_factor=(2, 2)), "ValueError", "scale_factor"),
    (2, dict(scale_factor=(2.0,)), "ValueError", "scale_factor"),  # (torch refuses a
    (2, dict(size=(4,)), "ValueError", "size"),  # 1-tuple for 2 dims; pooling takes it)
    (1, dict(scale_factor=-2.0), "ValueError", "scale_factor"),
    (2, dict(size=0), "ValueError", "size"),
    (1, dict(size=4, recompute_scale_factor=True), "ValueError", "recompute_scale_factor"),
    (0, dict(scale_factor=2), "PartitionError", "partition"),
]


def _error_of(fn, *args, **kwargs):
    """(exception type name, message) of ``fn(*args, **kwargs)``, None if it returns."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _bad_options():
    """Construct each bad layer on a partition of world ranks 1, 2 (the others inactive);
    ``nd == 0``: a 2-D partition (no spatial dim)."""
    shape = {0: (1, 2), 1: (1, 1, 2), 2: (1, 1, 2, 1), 3: (1, 1, 2, 1, 1)}
    return [_error_of(gnn.DistributedUpsample, Partition([1, 2], shape[nd]), **opts)
            for nd, opts, _, _ in BAD]


def test_bad_options_raise_on_every_rank(cluster):
    for per_rank in cluster.run(WORLD, _bad_options):
        for (nd, opts, err_type, word), err in zip(BAD, per_rank):
            assert err is not None, (nd, opts)
            assert err[0] == err_type and word in err[1], (nd, opts, err)
    for nd, opts, _, _ in BAD:  # torch rejects the same options
        if nd:
            x = torch.zeros((1, 1) + (8,) * nd)
            with pytest.raises((ValueError, RuntimeError, NotImplementedError, TypeError)):
                torch.nn.Upsample(**opts)(x)


def test_input_beyond_the_neighbours(cluster):
    """align_corners down-sampling of 12 entries to 2 over 4 workers: worker 1's output
    reads entry 11, owned by worker 3 (two workers away)."""
    case = ((1, 1, 4), [0, 1, 2, 3], (1, 1, 12),
            _up("linear", True, size=2))
    res = cluster.run(WORLD, _equivalence, *case)
    assert res[0]["y"] < TOL and res[0]["dx"] < TOL, res[0]


def _float32_cases():
    """float32 inputs (index math in float32, their opmath) over 2 ranks vs torch."""
    out = []
    for nd, opts in [(1, _up("linear", False, scale_factor=1.7)),
                     (2, _up("nearest", scale_factor=(1.7, 0.45))),
                     (2, _up("bicubic", True, size=(9, 31))),
                     (3, _up("nearest-exact", scale_factor=(2, 0.5, 1.3)))]:
        P = Partition.grid((1, 1) + (1,) * (nd - 1) + (2,))
        G = global_tensor((2, 3) + (11,) * nd, seed=5, dtype=torch.float32)
        y = gnn.DistributedUpsample(P, **opts)(block_of(G, P))
        Y = torch.nn.Upsample(**opts)(G)
        root = Partition([0], (1,) * P.dim)
        yg = gather(y, P, Y.shape, root)[0]
        if root.active:
            out.append((yg.dtype == torch.float32, _maxerr(yg, Y)))
    return out


def test_float32_matches_torch(cluster):
    for ok, err in cluster.run(2, _float32_cases)[0]:
        assert ok and err < 1e-5, err


def test_geometry_from_intervals_equals_kernel_geometry():
    """Explicit intervals taken from a kernel geometry (no padding) give the same workers."""
    for n, P, k, s, d in [(20, 6, 2, 2, 1), (11, 3, 5, 1, 1), (17, 4, 3, 2, 2), (3, 4, 1, 1, 1)]:
        ref = HaloGeometry(n, P, k, s, d)
        geo = HaloGeometry.from_intervals(n, [w.outputs for w in ref.per_worker],
                                          [w.needed for w in ref.per_worker])
        assert geo.per_worker == ref.per_worker and geo.output_size == ref.output_size
        assert geo != ref and "from_intervals" in repr(geo)


def test_geometry_from_intervals_errors():
    with pytest.raises(HaloError, match="tile"):
        HaloGeometry.from_intervals(10, [(0, 4), (5, 8)], [(0, 5), (5, 10)])
    with pytest.raises(HaloError, match="outside"):
        HaloGeometry.from_intervals(10, [(0, 4), (4, 8)], [(0, 5), (5, 11)])
    # worker 1 needs entry 11, owned by worker 3: received from it directly
    g = HaloGeometry.from_intervals(12, [(0, 1), (1, 2), (2, 2), (2, 2)],
                                    [(0, 1), (11, 12), (0, 0), (0, 0)])
    assert g.worker(1).recv_from == ((3, (11, 12)),) and g.worker(3).send_to == ((1, (11, 12)),)


def _fast_and_slow_paths():
    """Linear modes with integer ratios run torch's kernel on the halo-extended block and
    crop (the fast path); other ratios use the per-dimension taps. Both equal torch."""
    P = Partition([0, 1, 2, 3], (1, 1, 2, 2))
    out = {}
    for name, opts in (("fast", _up("bilinear", False, scale_factor=2)),
                       ("fast_size", _up("bilinear", False, size=(26, 30))),
                       ("slow", _up("bilinear", False, scale_factor=1.7))):
        layer = gnn.DistributedUpsample(P, **opts)
        g = (2, 3, 13, 15)
        out[f"{name}_used"] = layer.plan(TensorSpec(P, g, torch.float64)).fast is not None
        errs = _equivalence((1, 1, 2, 2), [0, 1, 2, 3], g, opts, layer=layer)
        out.update({f"{name}_{k}": v for k, v in errs.items() if k in ("y", "dx")})
    return out


def test_fast_path_equals_torch(cluster):
    res = cluster.run(4, _fast_and_slow_paths)
    assert all(r["fast_used"] and r["fast_size_used"] and not r["slow_used"] for r in res)
    for key in ("fast_y", "fast_dx", "fast_size_y", "fast_size_dx", "slow_y", "slow_dx"):
        assert res[0][key] < 1e-10, (key, res[0][key])


# linear modes by integer scales with outputs aligned to the blocks: torch's kernel on the
# block plus the edge strips (gpudist.nn.sampling_edges); "edge" says which workers take it
EDGE_CASES = [
    ("edge-2d-x2", (1, 1, 2, 2), [0, 1, 2, 3], (2, 3, 8, 10), _up("bilinear", False,
                                                                 scale_factor=2)),
    ("edge-2d-x3", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 12, 10), _up("bilinear", False,
                                                                  scale_factor=3)),
    ("edge-2d-x4-x2", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 16, 12),
     _up("bilinear", False, scale_factor=(4, 2))),
    ("edge-2d-row", (1, 1, 1, 4), [0, 1, 2, 3], (1, 1, 6, 8), _up("bilinear", False,
                                                                 scale_factor=3)),
    ("edge-2d-batch", (2, 1, 1, 2), [0, 1, 2, 3], (2, 2, 8, 8), _up("bilinear", False,
                                                                   scale_factor=2)),
    ("edge-2d-subset", (1, 1, 1, 3), [1, 2, 3], (1, 2, 5, 9), _up("bilinear", False,
                                                                 scale_factor=2)),
    ("edge-1d-x2", (1, 1, 4), [0, 1, 2, 3], (2, 3, 12), _up("linear", False, scale_factor=2)),
    ("edge-3d-x2", (1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 6, 5, 8),
     _up("trilinear", False, scale_factor=2)),
    # not aligned everywhere (9 -> 27 over 4): some workers crop, some take the edges
    ("edge-mixed", (1, 1, 1, 4), [0, 1, 2, 3], (1, 1, 6, 9), _up("bilinear", False,
                                                                scale_factor=3)),
]


def _edge_cases(cases):
    out = []
    for _, pshape, ranks, gshape, opts in cases:
        P = Partition(ranks, pshape)
        r = {}
        for split in (True, False):
            layer = gnn.DistributedUpsample(P, **opts)
            layer.edge_split = split
            res = _equivalence(pshape, ranks, gshape, opts, layer)
            res.pop("torch_bwd_agrees", None)
            r.update({f"{k}-{split}": v for k, v in res.items()})
            if split:
                plans = list(layer._plans.values())  # the one plan of this input
                r["edge"] = P.active and len(plans) == 1 and plans[0].edges is not None
                x = block_of(global_tensor(gshape, seed=3), P)
                r["adjoint"] = adjoint_mismatch(layer, x, seed=4)
        out.append(r)
    return out


@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    not HAS_MPI, reason="mpi4py or mpiexec not installed"))])
def test_upsample_edge_split_equals_torch(cluster, backend):
    """The edge split (and the crop path it replaces) equal torch, forward and gradient, and
    its hand-written backward is the adjoint; aligned workers take it, others crop."""
    res = cluster.run(WORLD, _edge_cases, EDGE_CASES, backend=backend)
    for i, case in enumerate(EDGE_CASES):
        per_rank = [r[i] for r in res]
        edge = {rank: per_rank[rank]["edge"] for rank in case[2]}
        if case[0] == "edge-mixed":
            assert set(edge.values()) == {True, False}, (case[0], edge)
        else:
            assert all(edge.values()), (case[0], edge)
        for r in per_rank:
            assert r["adjoint"] < 1e-13, (case[0], r)
            for k, v in r.items():
                if k.startswith(("y-", "dx-", "shape-", "inactive_numel-")):
                    assert v < TOL, (case[0], k, r)
        assert sum("y-True" in r for r in per_rank) == 1  # one rank compared the case
