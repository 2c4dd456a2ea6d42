"""Halo geometry: the worked example, the paper's examples, a brute-force property check, CLI."""

import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gpudist import HaloError, block_range
from gpudist.halo import HaloGeometry, halo_spec, normalize_params, worker_spec
from gpudist.halo.__main__ import main as cli_main


def _facts(geo):
    return [(w.n_outputs, w.n_inputs, w.left_halo, w.right_halo, w.left_extra, w.right_extra,
             w.pad_left, w.pad_right) for w in geo.per_worker]


# ---------------------------------------------------------------- worked and paper examples


def test_worked_example_pool_k2_s2_n20_p6():
    g = HaloGeometry(20, 6, kernel=2, stride=2)
    assert g.output_size == 10
    assert [w.n_outputs for w in g.per_worker] == [2, 2, 2, 2, 1, 1]
    assert [w.n_inputs for w in g.per_worker] == [4, 4, 3, 3, 3, 3]
    w3 = g.worker(3)
    assert w3.bulk == (11, 14) and w3.outputs == (6, 8)
    assert w3.needed == (12, 16)  # needs 12..15
    assert (w3.left_extra, w3.left_halo, w3.right_halo, w3.right_extra) == (1, 0, 2, 0)
    # the paper's reading of the other workers: 0,1 nothing; 2 right halo; 4: 2 extra + halo 1;
    # 5: one extra on the left
    assert (g.worker(2).left_halo, g.worker(2).right_halo) == (0, 1)
    assert (g.worker(4).left_extra, g.worker(4).right_halo) == (2, 1)
    assert (g.worker(5).left_extra, g.worker(5).left_halo, g.worker(5).right_halo) == (1, 0, 0)
    assert not g.worker(0).exchanges and not g.worker(1).exchanges


def test_paper_centered_k5_pad2_uniform_halos():
    g = HaloGeometry(11, 3, kernel=5, padding=(2, 2))
    assert g.output_size == 11
    assert _facts(g) == [(4, 4, 0, 2, 0, 0, 2, 0), (4, 4, 2, 2, 0, 0, 0, 0),
                         (3, 3, 2, 0, 0, 0, 0, 2)]
    # worker 1 reads 2..9, worker 2 reads 6..12 (two padding entries on the right)
    assert g.worker(1).reads == (2, 9) and g.worker(2).reads == (6, 12)


def test_paper_centered_k5_no_padding_unbalanced():
    g = HaloGeometry(11, 3, kernel=5)
    assert g.output_size == 7
    # first and last workers: large one-sided halos; middle: small two-sided
    assert _facts(g) == [(3, 4, 0, 3, 0, 0, 0, 0), (2, 4, 1, 1, 0, 0, 0, 0),
                         (2, 3, 3, 0, 0, 0, 0, 0)]


def test_paper_small_pooling_k2_s2():
    # as stated in the text, n=11: the last worker's trailing entry is extra
    g = HaloGeometry(11, 3, kernel=2, stride=2)
    assert g.output_size == 5
    assert _facts(g) == [(2, 4, 0, 0, 0, 0, 0, 0), (2, 4, 0, 0, 0, 0, 0, 0),
                         (1, 3, 0, 0, 0, 1, 0, 0)]
    # the paper's figure draws n=10 (inputs 0..3 | 4..6 | 7..9): worker 1 has a right halo of
    # 1, worker 2 no halo but its first entry must be removed
    g = HaloGeometry(10, 3, kernel=2, stride=2)
    assert _facts(g) == [(2, 4, 0, 0, 0, 0, 0, 0), (2, 3, 0, 1, 0, 0, 0, 0),
                         (1, 3, 0, 0, 1, 0, 0, 0)]


def test_send_ranges_match_neighbour_halos():
    g = HaloGeometry(20, 6, kernel=2, stride=2)
    for i in range(5):
        assert g.worker(i).send_right == g.worker(i + 1).halo_left
        assert g.worker(i + 1).send_left == g.worker(i).halo_right
    assert g.worker(2).send_right == (11, 11) and g.worker(3).send_left == (11, 12)


# ---------------------------------------------------------------- errors


def test_halo_beyond_the_neighbours_comes_from_further_workers():
    # worker 0 of 4 needs a right halo of 3 entries; worker 1 owns only 2: one from worker 2
    w0 = HaloGeometry(6, 4, kernel=5).worker(0)
    assert w0.right_halo == 3 and w0.recv_from == ((1, (2, 4)), (2, (4, 5))) and w0.hops == 2
    assert halo_spec((2, 3, 6), (1, 1, 4), 5)[2].worker(0).hops == 2
    with pytest.raises(HaloError, match="kernel extent"):
        HaloGeometry(3, 1, kernel=3, dilation=2)
    with pytest.raises(HaloError, match="invalid"):
        HaloGeometry(5, 1, kernel=0)


def test_zero_bulk_worker_is_skipped_over():
    HaloGeometry(3, 4, kernel=1)  # worker 3 owns nothing and computes nothing: fine
    g = HaloGeometry(4, 6, kernel=3, padding=2)  # worker 5 needs index 3 past empty worker 4
    assert dict(g.worker(5).recv_from) == {3: (3, 4)} and g.worker(4).n_inputs == 0
    g = HaloGeometry(3, 4, kernel=3, padding=1)  # worker 3: no outputs, no inputs
    assert (g.worker(3).n_outputs, g.worker(3).n_inputs, g.worker(3).exchanges) == (0, 0, False)


# ---------------------------------------------------------------- brute force


def _reference_locals(n, P, k, s, d, pl, pr, seed):
    """Global op vs each worker's local op on [pad | needed | pad] with padding 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, n, generator=g, dtype=torch.float64)
    w = torch.randn(1, 1, k, generator=g, dtype=torch.float64)
    ref = F.conv1d(F.pad(x, (pl, pr)), w, stride=s, dilation=d)
    return x, w, ref


def _check(n, P, k, s, d, pl, pr, seed):
    span = d * (k - 1) + 1
    if n + pl + pr < span:
        with pytest.raises(HaloError):
            HaloGeometry(n, P, k, s, d, (pl, pr))
        return "small"
    m = (n + pl + pr - span) // s + 1
    bulks = [block_range(n, P, i) for i in range(P)]
    outs = [block_range(m, P, i) for i in range(P)]
    reads = [sorted({j * s - pl + t * d for j in range(*o) for t in range(k)}) for o in outs]
    # the local tensor is contiguous: every worker needs the hull of its reads, clipped
    inside = [list(range(max(rd[0], 0), min(rd[-1] + 1, n))) if rd else [] for rd in reads]
    # brute force: whether every needed index lies in its own or a direct neighbour's bulk
    near = True
    for i, rd in enumerate(inside):
        if rd:
            lo = bulks[i - 1][0] if i > 0 else bulks[i][0]
            hi = bulks[i + 1][1] if i + 1 < P else bulks[i][1]
            near &= lo <= rd[0] and rd[-1] < hi
    geo = HaloGeometry(n, P, k, s, d, (pl, pr))
    hops = max(w.hops for w in geo.per_worker)
    assert (hops <= 1) == near, (n, P, k, s, d, pl, pr, hops)
    assert geo.output_size == m
    x, w, ref = _reference_locals(n, P, k, s, d, pl, pr, seed)
    for i, wk in enumerate(geo.per_worker):
        assert wk.outputs == outs[i] and wk.bulk == bulks[i]
        if not reads[i]:
            assert wk.local_length == 0 and wk.n_outputs == 0
            continue
        # the needed range is the clipped hull of the reads; padding counts the rest
        if inside[i]:
            assert wk.needed == (inside[i][0], inside[i][-1] + 1)
        else:
            assert wk.local_length == 0
        assert wk.pad_left == len(range(reads[i][0], min(reads[i][-1] + 1, 0)))
        assert wk.pad_right == len(range(max(reads[i][0], n), reads[i][-1] + 1))
        assert wk.padded_length == reads[i][-1] - reads[i][0] + 1
        # three pieces tile the needed range; the halos are what other workers own of it
        hl, tr, hr = wk.halo_left, wk.trimmed, wk.halo_right
        assert wk.left_halo + (tr[1] - tr[0]) + wk.right_halo == wk.local_length
        # (the needed range may even miss the bulk: then one halo is all of it)
        if wk.left_halo:
            assert hl[1] <= bulks[i][0] and hl[0] == wk.needed[0]
        if wk.right_halo:
            assert bulks[i][1] <= hr[0] and hr[1] == wk.needed[1]
        got = sorted(x for _, iv in wk.recv_from for x in range(*iv))
        assert got == [x for x in range(*wk.needed) if not bulks[i][0] <= x < bulks[i][1]]
        assert wk.left_extra + wk.right_extra + (tr[1] - tr[0]) == wk.n_inputs
        # the local op with padding 0 on [pad | needed | pad] equals the global op's slice
        loc = F.pad(x[..., wk.needed[0]:wk.needed[1]], (wk.pad_left, wk.pad_right))
        y = F.conv1d(loc, w, stride=s, dilation=d)
        # (equal up to round-off: torch may sum the taps in another order on a shorter input)
        assert torch.allclose(y, ref[..., outs[i][0]:outs[i][1]], rtol=1e-13, atol=1e-13), \
            (n, P, k, s, d, pl, pr, i)
    for i in range(P):  # what i sends to j is what j receives from i
        for j, iv in geo.worker(i).send_to:
            assert dict(geo.worker(j).recv_from)[i] == iv
    return "ok" if near else "far"


def test_random_property_against_brute_force():
    rnd = random.Random(1234)
    seen = {"ok": 0, "far": 0, "small": 0}
    for case in range(1500):
        n = rnd.randint(0, 40)
        P = rnd.randint(1, 8)
        k = rnd.randint(1, 6)
        s = rnd.randint(1, 4)
        d = rnd.randint(1, 3)
        pl, pr = rnd.randint(0, 3), rnd.randint(0, 3)
        seen[_check(n, P, k, s, d, pl, pr, case)] += 1
    assert seen["ok"] > 500 and seen["far"] > 50 and seen["small"] > 10, seen


def test_common_layers_exhaustive_small():
    for n in range(1, 30):
        for P in range(1, 6):
            for k, s, d, p in [(3, 1, 1, 1), (2, 2, 1, 0), (3, 2, 1, 1), (3, 1, 2, 2),
                               (5, 1, 1, 2), (1, 1, 1, 0), (3, 3, 1, 0)]:
                _check(n, P, k, s, d, p, p, n * 100 + P)


# ---------------------------------------------------------------- N-D helpers


def test_halo_spec_nd_and_params():
    k, s, p, d = normalize_params(4, 3, 2, 1, 1)
    assert k == (1, 1, 3, 3) and s == (1, 1, 2, 2) and p == ((0, 0), (0, 0), (1, 1), (1, 1))
    k, s, p, d = normalize_params(3, (2, 3), 1, [(0, 1), 2], (1, 2))
    assert k == (1, 2, 3) and p == ((0, 0), (0, 1), (2, 2)) and d == (1, 1, 2)
    geos = halo_spec((4, 3, 20, 11), (1, 1, 6, 1), 2, stride=2)
    assert [g.workers for g in geos] == [1, 1, 6, 1]
    assert geos[0].trivial and geos[1].trivial and not geos[2].trivial
    ws = worker_spec(geos, (0, 0, 3, 0))
    assert ws[2].left_extra == 1 and ws[2].right_halo == 2
    # extent-1 dims keep their trimming/padding info: n=11, k=2, s=2 drops the last entry
    assert ws[3].right_extra == 1 and ws[3].needed == (0, 10)
    wp = worker_spec(halo_spec((9,), (1,), 3, padding=1), (0,))
    assert (wp[0].pad_left, wp[0].pad_right, wp[0].left_halo) == (1, 1, 0)
    with pytest.raises(HaloError, match="3 dimensions but the partition has 2"):
        halo_spec((4, 4, 4), (2, 2), 3)


def test_geometry_is_a_value_type():
    a = HaloGeometry(20, 6, 2, 2)
    b = HaloGeometry(20, 6, 2, 2, padding=0)
    assert a == b and hash(a) == hash(b) and a != HaloGeometry(20, 6, 2, 1)
    with pytest.raises(AttributeError):
        a.size = 3


# ---------------------------------------------------------------- CLI


def test_cli_table_and_drawing(capsys):
    assert cli_main(["--size", "20", "--workers", "6", "--kernel", "2", "--stride", "2",
                     "--draw"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row3 = next(ln for ln in lines if ln.split()[:1] == ["3"])
    # worker outputs range inputs bulk reads halo-L halo-R extra-L extra-R pad-L pad-R
    assert row3.split() == ["3", "2", "6..7", "3", "11..13", "12..15", "0", "2", "1", "0",
                            "0", "0"]
    pic = next(ln for ln in lines if ln.startswith("worker 3"))
    assert pic.split(None, 2)[2] == "...........x##hh...."


def test_cli_padding_and_error(capsys):
    assert cli_main(["-n", "11", "-P", "3", "-k", "5", "-p", "2"]) == 0
    out = capsys.readouterr().out
    assert "-> 11 outputs" in out and "-2..5" in out
    assert cli_main(["-n", "6", "-P", "4", "-k", "5"]) == 0  # halos from 2 workers away
    assert cli_main(["-n", "3", "-P", "1", "-k", "5"]) == 2
    assert "kernel extent" in capsys.readouterr().err


def test_cli_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "gpudist.halo", "-n", "10", "-P", "3", "-k", "2",
                        "-s", "2", "--padding", "0", "1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "padding=(0, 1)" in r.stdout and "worker" in r.stdout
