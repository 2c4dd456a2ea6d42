"""HaloExchange on 1, 2, 3, 4 and 6 ranks (gloo and MPI): forward equals slicing the global
tensor, local ops on the result equal the sequential op, adjoint test, errors, buffer reuse."""


import pytest
import torch
import torch.nn.functional as F

import gpudist
from gpudist import Decomposition, DistTensor, HaloError, Partition, TensorSpec, block_range
from gpudist.halo import HaloExchange, HaloGeometry, normalize_params
from gpudist.testing import adjoint_mismatch
from tests.conftest import HAS_MPI
from tests.util import assert_program_facts

try:
    import numba  # noqa: F401
    HAS_NUMBA = True
except ImportError:  # pragma: no cover
    HAS_NUMBA = False


def _global(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def _block(X, P):
    if not P.active:
        return X.new_zeros((0,) * X.dim())
    return X[Decomposition(tuple(X.shape), P.shape).global_slices(P.coords)].clone()


def _expected_ranges(gshape, pshape, coords, params):
    """Brute force, independent of HaloGeometry: per dim, the clipped input range the
    worker's (balanced) outputs read, and the padding before/after it."""
    k, s, p, d = normalize_params(len(gshape), *params)
    out = []
    for a, n in enumerate(gshape):
        m = (n + p[a][0] + p[a][1] - d[a] * (k[a] - 1) - 1) // s[a] + 1
        o0, o1 = block_range(m, pshape[a], coords[a])
        lo, hi = o0 * s[a] - p[a][0], (o1 - 1) * s[a] - p[a][0] + d[a] * (k[a] - 1) + 1
        out.append((max(lo, 0), min(hi, n), max(0, -lo), max(0, hi - n), (o0, o1)))
    return out


def _conv(x, w, stride, dilation):
    nd = x.dim() - 2
    f = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return f(x, w, stride=stride, dilation=dilation)


def _run_case(case, packer=None):
    """One configuration on every rank; returns facts for the test to assert."""
    gshape, pshape, params, conv = case
    P = Partition.grid(pshape)
    X = _global(gshape, seed=sum(gshape))
    x = _block(X, P)
    H = HaloExchange(P, *params, packer=packer)
    y = H(x)
    spec = TensorSpec(P, gshape, x.dtype)
    facts = {"active": P.active}
    if P.active:
        rng = _expected_ranges(gshape, pshape, P.coords, params)
        ref = X[tuple(slice(a, b) for a, b, *_ in rng)]
        facts["forward_equal"] = tuple(y.shape) == tuple(ref.shape) and torch.equal(y, ref)
        facts["changed"] = tuple(y.shape) != tuple(x.shape)  # halos added or extra trimmed
        facts["pads"] = H.local_plan(spec).pads == tuple((pl, pr) for _, _, pl, pr, _ in rng)
        if conv:  # the local op with padding 0 on the padded result == sequential op's slice
            k, s, p, d = normalize_params(len(gshape), *params)
            g = torch.Generator().manual_seed(5)
            w = torch.randn((2, gshape[1]) + k[2:], generator=g, dtype=torch.float64)
            full = F.pad(X, [v for a in reversed(p[2:]) for v in a])
            seq = _conv(full, w, s[2:], d[2:])
            Hp = HaloExchange(P, *params, pad_value=0.0, packer=packer)
            loc = _conv(Hp(x), w, s[2:], d[2:])
            osl = tuple(slice(*r[4]) for r in rng[2:])
            facts["conv_equal"] = torch.allclose(loc, seq[(slice(None), slice(None)) + osl],
                                                 rtol=1e-12, atol=1e-12)
    else:
        facts["inactive_zero_volume"] = y.numel() == 0
    facts["adjoint"] = adjoint_mismatch(lambda t: H(t), x, seed=3)
    return facts


def _run_cases(cases, packer=None):
    return [_run_case(c, packer) for c in cases]


# (global shape, partition shape, (kernel, stride, padding, dilation), check a local conv)
CASES = {
    1: [((1, 2, 9), (1, 1, 1), (3, 1, 1, 1), True),
        ((1, 1, 9), (1, 1, 1), (2, 2, 0, 1), True),           # trailing entry trimmed
        ((2, 1, 5, 6), (1, 1, 1, 1), (3, 2, (1, 0), 1), True)],
    2: [((2, 3, 11), (1, 1, 2), (3, 1, 1, 1), True),
        ((1, 1, 21), (1, 1, 2), (2, 2, 0, 1), True),           # halo left + extra right
        ((1, 2, 7, 9), (1, 1, 2, 1), (3, 1, 0, 2), True),
        ((7, 9), (2, 1), ((3, 1), 1, ((1, 1), (0, 0)), 1), False)],
    3: [((1, 2, 11), (1, 1, 3), (5, 1, 0, 1), True),           # paper: unbalanced halos
        ((1, 2, 11), (1, 1, 3), (5, 1, 2, 1), True),           # paper: uniform halos
        ((1, 1, 10), (1, 1, 3), (2, 2, 0, 1), True),           # paper figure: extra left
        ((1, 2, 7, 10), (1, 1, 1, 3), (3, 1, 2, 2), True)],
    4: [((1, 2, 9, 10), (1, 1, 2, 2), (3, 1, 1, 1), True),    # corners
        ((2, 1, 8, 11), (1, 1, 2, 2), ((2, 3), (2, 1), ((0, 0), (1, 1)), 1), True),
        ((1, 1, 12), (1, 1, 3), (3, 1, 1, 1), True),          # rank 3 inactive
        ((1, 1, 9, 8), (1, 1, 2, 2), (2, 2, 0, 1), True),     # max-pool style
        ((6, 7, 8), (2, 2, 1), ((3, 3, 3), (3, 2, 1), (1, 1, 1), 1), False)],  # 3-D kernel
    6: [((1, 1, 20), (1, 1, 6), (2, 2, 0, 1), True),          # the worked example
        ((1, 1, 10, 13), (1, 1, 2, 3), (3, 2, 1, 1), True),
        ((1, 1, 6, 5, 9), (1, 1, 2, 1, 3), (3, 1, 1, 1), True),
        ((7, 8, 9), (3, 2, 1), ((3, 3, 2), 1, (1, 1, 0), (1, 2, 1)), False),
        ((5, 9, 11), (1, 2, 3), (3, (1, 1, 2), 1, 1), False)],
}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_forward_slices_conv_and_adjoint(cluster, backend, n):
    res = cluster.run(n, _run_cases, CASES[n], backend=backend)
    for r, per_rank in enumerate(res):
        for case, f in zip(CASES[n], per_rank):
            assert f["adjoint"] < 1e-13, (r, case, f)
            if f["active"]:
                assert f["forward_equal"] and f["pads"], (r, case, f)
                if case[3]:
                    assert f["conv_equal"], (r, case, f)
            else:
                assert f["inactive_zero_volume"], (r, case)
    if n > 1:  # every multi-rank case really exchanges or trims on some worker
        for i, case in enumerate(CASES[n]):
            assert any(rr[i]["active"] and rr[i]["changed"] for rr in res), case


@pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")
def test_numba_packer_in_exchange(cluster):
    cases = CASES[4][:2] + CASES[4][3:]
    for per_rank in cluster.run(4, _run_cases, cases, "numba"):
        for case, f in zip(cases, per_rank):
            assert f["forward_equal"] and f["adjoint"] < 1e-13, (case, f)


def _float32_and_grad():
    P = Partition.grid((1, 1, 2, 2))
    X = _global((1, 2, 9, 10), 1, torch.float32)
    x = _block(X, P).requires_grad_(True)
    H = HaloExchange(P, 3, padding=1)
    y = H(x)
    # gradient of sum(y): each bulk entry counts once plus once per neighbour holding a copy
    y.sum().backward()
    counts = torch.zeros(9, 10)
    for c in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        rng = _expected_ranges((1, 2, 9, 10), (1, 1, 2, 2), (0, 0) + c, (3, 1, 1, 1))
        counts[slice(*rng[2][:2]), slice(*rng[3][:2])] += 1
    sl = Decomposition((9, 10), (2, 2)).global_slices(P.coords[2:])
    ok = torch.equal(x.grad, counts[sl].expand_as(x.grad))
    m = adjoint_mismatch(lambda t: H(t), x.detach(), seed=1)
    return ok, m, y.dtype == torch.float32


def test_float32_gradient_counts_copies(cluster, backend):
    for ok, m, is32 in cluster.run(4, _float32_and_grad, backend=backend):
        assert ok and is32 and m < 1e-5


def _beyond_neighbour(fixed):
    """A 5-wide kernel over blocks of 1-2 entries: halos from two workers away."""
    P = Partition.grid((1, 1, 4))
    X = _global((1, 1, 6), 0)
    x = _block(X, P)
    H = HaloExchange(P, 5, padding=2 if fixed else 0)
    y = H(DistTensor.from_local(x, P, (1, 1, 6))) if fixed else H(x)
    spec = TensorSpec(P, (1, 1, 6), X.dtype)
    hp = H.local_plan(spec) if P.active else None
    rng = _expected_ranges((1, 1, 6), P.shape, P.coords, (5, 1, 2 if fixed else 0, 1)) \
        if P.active else None
    if not P.active:
        ok = True
    elif rng[2][4][1] <= rng[2][4][0]:  # no outputs here: nothing needed
        ok = y.shape[2] == 0
    else:
        ok = torch.equal(y, X[tuple(slice(a, b) for a, b, *_ in rng)])
    hops = max((w.hops for w in hp.me), default=0) if hp else 0
    return ok, hops, adjoint_mismatch(lambda t: H(t), x, seed=4)


@pytest.mark.parametrize("fixed", [False, True])
def test_halo_beyond_neighbours(cluster, backend, fixed):
    n = 6 if fixed else 4  # with the shape in the spec, ranks outside the partition too
    res = cluster.run(n, _beyond_neighbour, fixed, backend=backend)
    assert all(ok and m < 1e-13 for ok, _, m in res), res
    assert max(h for _, h, _ in res) == 2  # really from two workers away


def _bad_blocks():
    P = Partition.grid((2,))
    x = torch.zeros(5 if P.index == 0 else 3)  # 5 + 3 is not a block split of 8
    HaloExchange(P, 3, padding=1)(x)


def test_non_block_local_shapes_raise_on_every_rank(cluster):
    errs = cluster.run(2, _bad_blocks, expect_error=True)
    assert all(e is not None and e.type == "ShapeError" for e in errs)
    assert "not a block decomposition" in errs[0].message
    # every rank's size along the dimension, and the split a tensor of that size has
    assert "ranks [0, 1] hold sizes [5, 3]" in errs[0].message, errs[0].message
    assert "split as [4, 4]" in errs[0].message, errs[0].message


def _bad_unsplit_dim():
    P = Partition.grid((1, 2))  # dim 0 is not split: a block of another size is named
    x = torch.zeros(4 if P.index == 1 else 3, 2)
    HaloExchange(P, 3, padding=1)(x)


def test_unsplit_dimension_of_another_size_is_named(cluster):
    errs = cluster.run(2, _bad_unsplit_dim, expect_error=True)
    assert all(e is not None and e.type == "ShapeError" for e in errs)
    assert "rank 1 holds a block of shape (4, 2)" in errs[0].message, errs[0].message
    assert "dimension 0 is not split" in errs[1].message, errs[1].message


def _reuse():
    P = Partition.grid((1, 2, 2))
    X = _global((2, 9, 10), 2)
    x = _block(X, P).requires_grad_(True)
    H = HaloExchange(P, (3, 3), padding=1)
    H(x).sum().backward()
    spec = TensorSpec(P, X.shape, X.dtype)
    plan = H.local_plan(spec)
    first = plan.buffer_ptrs()
    for _ in range(3):
        H(x).square().sum().backward()
    assert H.local_plan(spec) is plan  # cached per local shape: no new all-gather, same plan
    # the in-place form on a caller-held working buffer gives the same result
    W = torch.empty(plan.work_shape, dtype=x.dtype)
    plan.bulk(W).copy_(x.detach())
    returned_w = plan.exchange_(W) is W
    same = returned_w and torch.equal(plan.result(W), H(x).detach())
    return first, plan.buffer_ptrs(), same, len(plan.steps)


def test_buffers_allocated_once_and_reused(cluster, backend):
    for first, later, same, nsteps in cluster.run(4, _reuse, backend=backend):
        assert nsteps == 2 and len(first) == 2  # one buffer pair per exchanging dim
        assert first == later and same
        assert all(s != 0 and r != 0 for s, r in first.values())


def _single_rank_facts():
    # a trivial kernel is a copy; a geometry object drives the plan directly
    P = Partition.grid((1, 1, 1))
    x = torch.arange(2 * 3 * 9, dtype=torch.float64).view(2, 3, 9)
    y = HaloExchange(P)(x)
    facts = [torch.equal(y, x) and y.data_ptr() == x.data_ptr()]  # no copy where none needed
    geo = (HaloGeometry(2, 1), HaloGeometry(3, 1), HaloGeometry(9, 1, 2, 2))
    H = HaloExchange(P, geometry=geo)
    facts.append(torch.equal(H(x), x[..., :8]))  # k=2, s=2 on 9 entries: last one trimmed
    for make, err, text in [
        (lambda: HaloExchange(Partition.grid((1, 1)))(x), gpudist.ShapeError,
         "3 dimensions but the partition has 2"),
        (lambda: HaloExchange(P, 11)(DistTensor.from_local(x, P, (2, 3, 9))), HaloError,
         "kernel extent"),
    ]:
        try:
            make()
            facts.append(False)
        except err as e:
            facts.append(text in str(e))
    return facts


def test_geometry_constructor_and_single_rank_identity(cluster):
    (facts,) = cluster.run(1, _single_rank_facts)
    assert facts == [True] * 4


def _cuda_exchange():
    from gpudist.kernels import get_packer

    P = Partition.grid((1, 1, 2, 2))
    gshape, params = (2, 3, 9, 10), (3, 1, 1, 1)
    X = _global(gshape, 4)
    x = _block(X, P).cuda()
    H = HaloExchange(P, *params)
    y = H(x)
    rng = _expected_ranges(gshape, P.shape, P.coords, params)
    ref = X[tuple(slice(a, b) for a, b, *_ in rng)]
    ok = y.is_cuda and torch.equal(y.cpu(), ref)
    m = adjoint_mismatch(lambda t: H(t), x, seed=2)
    return ok, m, get_packer(x.device, x.dtype).name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_exchange_with_cuda_tensors(cluster):
    # ranks share one GPU: gloo moves the (packed, device-resident) faces through the host
    res = cluster.run(4, _cuda_exchange, backend="gloo-spawn")
    for ok, m, packer in res:
        assert ok and m < 1e-13, (ok, m, packer)


def _in_flight_body_raises(gshape, pshape):
    """A body that raises inside ``with InFlight``: the exchange still completes (the
    buffer holds the halos H gives) and the next exchange is right."""
    from contextlib import nullcontext

    from gpudist.halo.exchange import InFlight

    P = Partition.grid(pshape)
    X = _global(gshape, seed=3)
    x = _block(X, P)
    H = HaloExchange(P, 3, padding=1, pad_value=0.0)
    spec = TensorSpec(P, gshape, x.dtype)
    want = H(DistTensor(x, spec)).clone()
    plan = H.plan(spec)
    hp = plan.local
    W = torch.full(hp.work_shape, float("nan"), dtype=x.dtype)
    hp.fill_padding(W)
    hp.bulk(W).copy_(x)
    raised = False
    try:
        with InFlight(hp, W, False, H.numbered(plan), nullcontext()):
            raise ValueError("the body failed")
    except ValueError:
        raised = True
    again = H(DistTensor(x, spec))
    return raised, bool(torch.equal(hp.result(W), want)), bool(torch.equal(again, want))


@pytest.mark.parametrize("backend", ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    not HAS_MPI, reason="mpi4py or mpiexec not installed"))])
def test_in_flight_exchange_completes_when_the_body_raises(cluster, backend):
    res = cluster.run(4, _in_flight_body_raises, (1, 2, 7, 9), (1, 1, 2, 2), backend=backend)
    assert res == [(True, True, True)] * 4, res


def _programs():
    """A transport's prepared point-to-point batch (MPI: persistent requests) between two
    ranks, started several times: data right each time, also when a start comes before
    the previous one completed (then a fresh batch goes out), and freed when asked."""
    from gpudist.transport.base import P2P, P2PProgram

    w = gpudist.world()
    tr, peer = w.transport, 1 - w.rank
    send, recv = torch.empty(5), torch.empty(5)
    prog = tr.p2p_program([P2P("recv", recv, peer, 7), P2P("send", send, peer, 7)])
    facts = {"persistent": type(prog) is not P2PProgram,
             "expected": getattr(tr, "persistent", False)}
    got = []
    for k in range(3):
        send.fill_(10 * k + w.rank)
        tr.wait(prog.start(), "program")
        got.append(recv.tolist() == [10.0 * k + peer] * 5)
    facts["repeated"] = all(got)
    send.fill_(100 + w.rank)
    first = prog.start()
    second = prog.start()  # the first is still live: posted as a new batch
    tr.wait(first + second, "program twice")
    facts["overlapping"] = recv.tolist() == [100.0 + peer] * 5
    send.fill_(200 + w.rank)
    tr.wait(prog.start(), "program after")
    facts["after"] = recv.tolist() == [200.0 + peer] * 5
    if facts["persistent"]:
        prog.free()
        facts["freed"] = all(r == tr.MPI.REQUEST_NULL for r in prog.requests.reqs)
        staged, tr.stage_all = tr.stage_all, True  # what MPI cannot take as it is
        try:
            facts["staged_is_plain"] = type(tr.p2p_program(
                [P2P("send", send, peer, 8)])) is P2PProgram
        finally:
            tr.stage_all = staged
    return facts


def test_p2p_program_repeats_and_overlaps(cluster, backend):
    for facts in cluster.run(2, _programs, backend=backend):
        assert_program_facts(facts, backend, "persistent", lambda made: 5 if made else 3)
