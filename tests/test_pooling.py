"""Distributed pooling equals torch's pooling (gathered, float64, forward and input gradient)
with torch's options: ceil_mode, count_include_pad, divisor_override, stride/padding/dilation,
1-D to 3-D, uneven sizes, partitions on a subset of the world (inactive ranks), batch
partitions; adjoint test of average pooling; bad options raise on every rank.

Many cases run per ``cluster.run`` call (one task per world size) to keep the runtime low."""

import pytest
import torch

import gpudist.nn as gnn
from gpudist import Partition
from gpudist.decomposition import Decomposition
from gpudist.nn.pooling import pool_output_length
from gpudist.primitives import zero_volume
from gpudist.runtime import require_world
from gpudist.testing import adjoint_mismatch
from tests.conftest import HAS_MPI
from tests.util import block_of, gather, global_tensor

TOL = 1e-10
WORLD = 4


def _layers(kind, nd, P, opts):
    name = {"max": "MaxPool", "avg": "AvgPool"}[kind]
    return getattr(gnn, f"Distributed{name}{nd}d")(P, **opts), \
        getattr(torch.nn, f"{name}{nd}d")(**opts)


def _maxerr(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def _shapes_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (an all-reduce over the world), so a wrong local
    output shape fails the case at once instead of hanging the gather."""
    w = require_world(None)
    t = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    if w.size > 1:
        w.transport.wait([w.transport.all_reduce(t, w.transport.group(range(w.size)))])
    return float(t) == 0.0


def _equivalence(kind, nd, pshape, ranks, gshape, opts, edge_split=True, ties=False):
    """Forward + input gradient of the distributed layer vs torch's on the global tensor;
    max errors on the gathering root, shapes everywhere (zero-volume where inactive).
    ``ties``: the input rounded (equal maxima in windows); "edge": whether this worker
    took the edge split (max pooling)."""
    P = Partition(ranks, pshape)
    layer, seq = _layers(kind, nd, P, opts)
    layer.edge_split = edge_split
    G = global_tensor(gshape, seed=1)
    if ties:
        G = (G * 2).round()
    x = block_of(G, P).requires_grad_(True)
    y = layer(x)
    Gs = G.clone().requires_grad_(True)
    Y = seq(Gs)
    want = Decomposition(tuple(Y.shape), P.shape).local_shape(P.coords) if P.active else \
        (0,) * y.dim()
    if not _shapes_agree(tuple(y.shape) == tuple(want)):
        return {"inactive_numel": 0, "shape": float("inf")}
    dY = global_tensor(Y.shape, seed=2)
    y.backward(block_of(dY, P) if P.active else zero_volume(y.dim(), like=y))
    Y.backward(dY)
    root = Partition([P.ranks[0]], (1,) * P.dim)
    yg = gather(y.detach(), P, Y.shape, root)[0]
    dx = x.grad if x.grad is not None else torch.zeros_like(x)
    dxg = gather(dx, P, G.shape, root)[0]
    out = {"inactive_numel": 0 if P.active else y.numel() + dx.numel()}
    if root.active:
        out["y"] = _maxerr(yg, Y.detach())
        out["dx"] = _maxerr(dxg, Gs.grad)
    plans = list(layer._plans.values())
    out["edge"] = P.active and len(plans) == 1 and getattr(plans[0], "edges", None) is not None
    return out


def _equivalence_cases(cases):
    return [_equivalence(*c[1:]) for c in cases]


# id, kind, nd, partition, world ranks, global shape, options (as torch's constructor)
MAX_CASES = [
    ("1d-ceil", "max", 1, (1, 1, 4), [0, 1, 2, 3], (2, 2, 24),
     dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("1d-ceil-dil", "max", 1, (1, 1, 3), [1, 2, 3], (1, 2, 19),
     dict(kernel_size=3, stride=3, padding=1, dilation=2, ceil_mode=True)),
    ("1d-ceil-rule", "max", 1, (1, 1, 3), [0, 1, 2], (2, 1, 11),
     dict(kernel_size=2, stride=2, padding=1, ceil_mode=True)),
    ("2d-ceil-dil", "max", 2, (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 14, 11),
     dict(kernel_size=3, stride=2, padding=1, dilation=2, ceil_mode=True)),
    ("2d-floor", "max", 2, (1, 1, 3, 1), [1, 2, 3], (2, 2, 17, 10),
     dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))),
    ("2d-batch-ceil", "max", 2, (2, 1, 2, 1), [0, 1, 2, 3], (3, 2, 13, 8),
     dict(kernel_size=2, ceil_mode=True)),
    ("3d-ceil", "max", 3, (1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 9, 7, 13),
     dict(kernel_size=(2, 3, 3), stride=(2, 2, 3), padding=(1, 0, 1), ceil_mode=True)),
]

AVG_CASES = [
    ("1d-ceil-excl", "avg", 1, (1, 1, 3), [0, 2, 3], (2, 2, 17),
     dict(kernel_size=4, stride=3, padding=2, ceil_mode=True, count_include_pad=False)),
    ("1d-ceil-rule-excl", "avg", 1, (1, 1, 3), [0, 1, 2], (2, 1, 11),
     dict(kernel_size=2, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("1d-incl", "avg", 1, (1, 1, 4), [0, 1, 2, 3], (1, 2, 23),
     dict(kernel_size=3, stride=2, padding=1)),
    ("2d-ceil-incl", "avg", 2, (1, 1, 2, 2), [0, 1, 2, 3], (2, 1, 16, 13),
     dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("2d-excl", "avg", 2, (1, 1, 2, 2), [0, 1, 2, 3], (2, 2, 13, 10),
     dict(kernel_size=(3, 2), stride=2, padding=1, count_include_pad=False)),
    ("2d-override", "avg", 2, (1, 1, 1, 3), [1, 2, 3], (1, 2, 12, 11),
     dict(kernel_size=3, stride=2, padding=1, divisor_override=7)),
    ("3d-ceil-excl-override", "avg", 3, (1, 1, 2, 2, 1), [0, 1, 2, 3], (1, 2, 9, 8, 7),
     dict(kernel_size=(3, 2, 3), stride=(2, 2, 3), padding=(1, 1, 0), ceil_mode=True,
          count_include_pad=False, divisor_override=5)),
    ("3d-ceil-excl", "avg", 3, (1, 1, 1, 1, 3), [0, 1, 3], (2, 1, 6, 9, 14),
     dict(kernel_size=(2, 3, 3), stride=2, padding=1, ceil_mode=True,
          count_include_pad=False)),
]


def _check(cases, results):
    roots = 0
    for case, per_rank in zip(cases, zip(*results)):
        for r in per_rank:
            assert r.pop("inactive_numel") == 0, case[0]
            r.pop("edge")
            assert all(v < TOL for v in r.values()), (case[0], r)
            roots += bool(r)
    assert roots == len(cases)  # exactly one rank compared each case


def test_cases_exercise_ceil_mode():
    """Every ceil_mode case adds an output in some dim, or hits torch's rule that the last
    window must start inside the input or left padding (then ceil adds nothing)."""
    for _, kind, nd, _, _, gshape, opts in MAX_CASES + AVG_CASES:
        if not opts.get("ceil_mode"):
            continue
        k, s = opts["kernel_size"], opts.get("stride", opts["kernel_size"])
        p, d = opts.get("padding", 0), opts.get("dilation", 1)
        per = [tuple(v) if isinstance(v, tuple) else (v,) * nd for v in (k, s, p, d)]
        adds = rule = False
        for L, (ka, sa, pa, da) in zip(gshape[2:], zip(*per)):
            m_floor = pool_output_length(L, ka, sa, pa, da, False)
            adds |= pool_output_length(L, ka, sa, pa, da, True) > m_floor
            m = (L + 2 * pa - da * (ka - 1) - 1 + sa - 1) // sa + 1
            rule |= (m - 1) * sa >= L + pa
        assert adds or rule, (kind, gshape, opts)
    shapes = [torch.nn.MaxPool1d(2, 2, 1, ceil_mode=c)(torch.zeros(1, 1, 11)).shape[-1]
              for c in (False, True)]
    assert shapes == [6, 6]  # the "rule" cases above: ceil would give 7 without it


@pytest.mark.parametrize("cases", [MAX_CASES, AVG_CASES], ids=["max", "avg"])
def test_pool_equivalence(cluster, cases):
    _check(cases, cluster.run(WORLD, _equivalence_cases, cases))


@pytest.mark.skipif(not HAS_MPI, reason="mpi4py or mpiexec not installed")
def test_pool_equivalence_mpi(cluster):
    cases = MAX_CASES + AVG_CASES
    _check(cases, cluster.run(WORLD, _equivalence_cases, cases, backend="mpi"))


def _adjoints(cases):
    out = []
    for _, kind, nd, pshape, ranks, gshape, opts in cases:
        P = Partition(ranks, pshape)
        layer, _ = _layers(kind, nd, P, opts)
        x = block_of(global_tensor(gshape, seed=3), P)
        out.append(adjoint_mismatch(layer, x, seed=4))
    return out


def test_avg_pool_adjoint(cluster):
    """Average pooling is linear: <A x, y> = <x, A* y> with A* the autograd backward."""
    cases = [c for c in AVG_CASES if c[0] in ("1d-ceil-excl", "2d-ceil-incl", "2d-override",
                                              "3d-ceil-excl-override")]
    for per_case in zip(*cluster.run(WORLD, _adjoints, cases)):
        assert len(set(per_case)) == 1  # the same value on every rank
        assert per_case[0] < 1e-13, per_case


BAD = [
    ("MaxPool2d", dict(kernel_size=3, padding=2), "padding"),
    ("MaxPool1d", dict(kernel_size=2, padding=2, dilation=3), "padding"),
    ("AvgPool3d", dict(kernel_size=(3, 3, 2), padding=(1, 1, 2)), "padding"),
    ("MaxPool2d", dict(kernel_size=2, return_indices=True), "return_indices"),
    ("AvgPool2d", dict(kernel_size=2, divisor_override=0), "divisor_override"),
    ("MaxPool1d", dict(kernel_size=2, stride=0), "stride"),
    ("AvgPool2d", dict(kernel_size=(2, 2, 2)), "kernel_size"),
]


def _bad_options():
    """Construct each bad layer on a partition of world ranks 1, 2 (the others inactive)."""
    out = []
    for name, opts, _ in BAD:
        P = Partition([1, 2], (1, 1, 2) + (1,) * (int(name[-2]) - 1))
        try:
            getattr(gnn, f"Distributed{name}")(P, **opts)
            out.append(None)
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    return out


def test_bad_options_raise_on_every_rank(cluster):
    for per_rank in cluster.run(WORLD, _bad_options):
        for (name, opts, word), err in zip(BAD, per_rank):
            assert err is not None, (name, opts)
            assert err[0] == "ValueError" and word in err[1], (name, opts, err)
    for name, opts, word in BAD:  # torch rejects the same options (indices: unsupported)
        if word != "return_indices":
            x = torch.zeros((1, 1) + (8,) * int(name[-2]))
            with pytest.raises((ValueError, RuntimeError)):
                getattr(torch.nn, name)(**opts)(x)


def _padding_only_windows():
    """Max pool where some windows read padding only (dilation 2 over a length-1 input):
    torch's own max pool reports an index outside the input there (and its backward writes
    out of bounds); gpudist puts the padding into its buffer instead. Reference: torch on
    the input explicitly padded with -inf (every index in range)."""
    P = Partition([1, 2, 0], (1, 3, 1))
    G = global_tensor((3, 2, 1))
    x = block_of(G, P).requires_grad_(True)
    y = gnn.DistributedMaxPool1d(P, 2, 3, 1, dilation=2)(x)
    dY = global_tensor((3, 2, 1), seed=5)
    if y.requires_grad:
        y.backward(block_of(dY, P))
    Gs = G.clone().requires_grad_(True)
    Y = torch.nn.functional.max_pool1d(
        torch.nn.functional.pad(Gs, (1, 1), value=float("-inf")), 2, 3, 0, 2)
    Y.backward(dY)
    yg, root = gather(y, P, (3, 2, 1))
    dxg, _ = gather(x.grad, P, (3, 2, 1))
    return root.active, (bool(torch.equal(yg, Y.detach())) and bool(torch.equal(dxg, Gs.grad))
                         if root.active else None)


def test_max_pool_windows_of_padding_only(cluster):
    res = cluster.run(3, _padding_only_windows)
    assert [ok for active, ok in res if active] == [True], res


# max pooling where the block's own grid agrees: torch's pool of the block plus edge strips
# (gpudist.nn.pooling_edges). Expected "edge": True where every active worker takes the
# split, None where some do, False where none can (torch's padding limit, with dilation);
# ``ties`` rounds the input so windows hold equal maxima (torch keeps the first)
EDGE_CASES = [
    ("edge-2d-3s2p1", (1, 1, 2, 2), [0, 1, 2, 3], (2, 3, 16, 12),
     dict(kernel_size=3, stride=2, padding=1), True, False),
    ("edge-2d-ties", (1, 1, 2, 2), [0, 1, 2, 3], (2, 2, 16, 12),
     dict(kernel_size=3, stride=2, padding=1), True, True),
    ("edge-2d-5s1p2", (1, 1, 1, 4), [0, 1, 2, 3], (1, 2, 7, 24),
     dict(kernel_size=5, stride=1, padding=2), True, False),
    ("edge-2d-dil", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 20, 18),
     dict(kernel_size=3, stride=1, padding=1, dilation=2), False, False),
    ("edge-2d-uneven", (1, 1, 3, 1), [1, 2, 3], (2, 2, 17, 10),
     dict(kernel_size=3, stride=2, padding=1), True, False),
    ("edge-2d-ceil", (1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 15, 13),
     dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), None, False),
    # the block's own pool would have windows of padding only (dilation 2): torch reports
    # an index outside the block there and its backward writes out of bounds (the fuzz
    # test's seed 55 crashed a rank with "double free"); those workers must copy
    ("edge-padding-only", (1, 1, 3, 1), [1, 2, 3], (3, 3, 5, 10),
     dict(kernel_size=2, stride=1, padding=1, dilation=2), None, False),
    ("edge-3d", (1, 1, 2, 1, 2), [0, 1, 2, 3], (1, 2, 8, 6, 12),
     dict(kernel_size=3, stride=2, padding=1), True, False),
    ("edge-2d-batch", (2, 1, 1, 2), [0, 1, 2, 3], (2, 2, 8, 12),
     dict(kernel_size=3, stride=2, padding=1), True, False),
]


def _edge_pool_cases(cases):
    out = []
    for _, pshape, ranks, gshape, opts, _, ties in cases:
        nd = len(pshape) - 2
        r = {}
        for split in (True, False):
            res = _equivalence("max", nd, pshape, ranks, gshape, opts, split, ties)
            r.update({f"{k}-{split}": v for k, v in res.items()})
        out.append(r)
    return out


@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    not HAS_MPI, reason="mpi4py or mpiexec not installed"))])
def test_max_pool_edge_split_equals_torch(cluster, backend):
    """The edge split (and the whole-buffer path) equal torch, forward and gradient (ties
    included); workers whose grids agree take it, the others pool the whole buffer."""
    res = cluster.run(WORLD, _edge_pool_cases, EDGE_CASES, backend=backend)
    for i, case in enumerate(EDGE_CASES):
        per_rank = [r[i] for r in res]
        edge = [per_rank[rank]["edge-True"] for rank in case[2]]
        want = {True: {True}, None: {True, False}, False: {False}}[case[5]]
        assert set(edge) == want, (case[0], edge)
        compared = [r for r in per_rank if "y-True" in r]
        assert len(compared) == 1, case[0]
        assert all(v < TOL for k, v in compared[0].items() if k.startswith(("y-", "dx-"))), \
            (case[0], compared[0])
        assert all(r["inactive_numel-True"] == r["inactive_numel-False"] == 0
                   for r in per_rank), case[0]


def _integer_max_pools():
    """Integer max pooling where windows reach into the global padding (padding,
    ceil_mode), edge split and whole buffer: equal to torch's (a fuzz found int64 with
    ceil_mode raising a bare overflow error on the ranks holding data: the -inf fill)."""
    from gpudist import DistTensor

    out = []
    for dt in (torch.int64, torch.int32, torch.int8, torch.uint8):
        for pshape, ranks, g, opts in [
                ((1, 1, 2, 2), [0, 1, 2, 3], (2, 2, 9, 7), dict(kernel_size=3, stride=2,
                                                                 padding=1)),
                ((1, 1, 2, 2), [0, 1, 2, 3], (1, 2, 9, 7), dict(kernel_size=2,
                                                                 ceil_mode=True)),
                ((2, 1, 1, 1), [0, 1], (2, 1, 5, 5), dict(kernel_size=2, ceil_mode=True))]:
            P = Partition(ranks, pshape)
            G = ((torch.arange(torch.Size(g).numel()) * 7 % 23) - 11).reshape(g)
            G = (G.abs() if dt == torch.uint8 else G).to(dt)
            want = torch.nn.functional.max_pool2d(G, **opts)
            for split in (True, False):
                layer = gnn.DistributedMaxPool2d(P, **opts)
                layer.edge_split = split
                x = G[Decomposition(g, P.shape).global_slices(P.coords)].clone() \
                    if P.active else torch.zeros(0, dtype=dt)
                y = layer(DistTensor.from_local(x, P, g))
                mine = want[Decomposition(tuple(want.shape), P.shape).global_slices(
                    P.coords)] if P.active else None
                out.append(y.local.dtype == dt and (mine is None
                                                    or torch.equal(y.local, mine)))
    return out


def test_integer_max_pool_with_padding_equals_torch(cluster):
    res = cluster.run(WORLD, _integer_max_pools)
    assert all(all(r) for r in res) and len(res[0]) == 24, res


def _refused_inputs():
    """Inputs torch's op refuses, on a depth split over two ranks (one block empty where
    the global depth is 1): an error on every rank, not torch's on the ranks with data."""
    from gpudist import DistTensor

    out = []
    P = Partition([0, 1], (1, 1, 2, 1, 1))
    cases = [("avg3-short", lambda: gnn.DistributedAvgPool3d(P, (3, 1, 1), 1, (1, 0, 0)),
              (1, 1, 2, 2, 2), torch.float64),
             ("avg3-short-empty", lambda: gnn.DistributedAvgPool3d(P, (3, 1, 1), 1, (1, 0, 0)),
              (1, 1, 1, 2, 2), torch.float64),
             ("avg3-half", lambda: gnn.DistributedAvgPool3d(P, 2), (1, 1, 1, 4, 4),
              torch.float16),
             ("max1-int", lambda: gnn.DistributedMaxPool1d(Partition([0, 1], (1, 1, 2)), 2),
              (1, 1, 1), torch.int64),
             ("upsample-int", lambda: gnn.DistributedUpsample(
                 Partition([0, 1], (2, 1, 1, 1)), scale_factor=2.0, mode="bilinear"),
              (1, 1, 2, 3), torch.int64)]
    for name, make, g, dt in cases:
        layer = make()
        G = torch.arange(torch.Size(g).numel()).reshape(g).to(dt)
        x = G[Decomposition(g, layer.P_x.shape).global_slices(layer.P_x.coords)].clone()
        try:
            layer(DistTensor.from_local(x, layer.P_x, g))
            out.append((name, None))
        except Exception as e:
            out.append((name, f"{type(e).__name__}: {e}"))
    return out


def test_inputs_torch_refuses_raise_on_every_rank(cluster):
    """A fuzz found these raising torch's error on the ranks holding data only (3-D
    average pooling of an input shorter than the kernel, which torch refuses whatever the
    padding; dtypes torch's kernel lacks, e.g. float16 3-D average pooling on the CPU)."""
    for per_rank in cluster.run(2, _refused_inputs):
        for name, err in per_rank:
            want = "ShapeError" if "short" in name else "DeviceError"
            assert err is not None and err.startswith(want), (name, err)
    with pytest.raises(RuntimeError):  # torch refuses each too
        torch.nn.AvgPool3d((3, 1, 1), 1, (1, 0, 0))(torch.zeros(1, 1, 2, 2, 2))
    with pytest.raises(NotImplementedError):
        torch.nn.MaxPool1d(2)(torch.zeros(1, 1, 4, dtype=torch.int64))
    with pytest.raises(NotImplementedError):
        torch.nn.Upsample(scale_factor=2.0, mode="bilinear")(
            torch.zeros(1, 1, 2, 3, dtype=torch.int64))
