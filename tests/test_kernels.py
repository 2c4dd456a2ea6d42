"""Halo pack/unpack kernels: every implementation equals the torch path (and a reference)."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpudist import kernels
from gpudist.kernels import autotune, available, get_packer, halo_faces
from gpudist.kernels.regions import collapse, describe
from gpudist.kernels.torch_pack import TorchPacker

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128]
SHAPES = [(11,), (5, 7), (4, 3, 6), (2, 3, 4, 5)]

try:
    from gpudist.kernels.numba_pack import NumbaCPUPacker
    HAS_NUMBA = True
except ImportError:  # pragma: no cover
    HAS_NUMBA = False


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    return x.to(dtype)


def _boxes(shape, rnd, count):
    out = []
    for _ in range(count):
        box = []
        for n in shape:
            a, b = sorted((rnd.randint(0, n), rnd.randint(0, n)))
            box.append((a, b))
        out.append(tuple(box))
    return out


def _overlap(a, b):
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def _disjoint(boxes):
    """The boxes that do not overlap an earlier one: unpack needs disjoint boxes (the
    kernels write them in parallel, so overlapping writes would race)."""
    keep = []
    for b in boxes:
        if not any(_overlap(b, k) for k in keep):
            keep.append(b)
    return keep


def _reference_pack(x, boxes):
    parts = [x[tuple(slice(a, b) for a, b in box)].reshape(-1) for box in boxes]
    return torch.cat(parts) if parts else x.new_empty(0)


def _cases():
    rnd = random.Random(7)
    cases = []
    for shape in SHAPES:
        for _ in range(3):
            cases.append((shape, _boxes(shape, rnd, rnd.randint(1, 4))))
        # the two faces of every dim (what the exchange packs), plus one empty box
        for d in range(len(shape)):
            cases.append((shape, halo_faces(shape, min(2, shape[d]), d)
                          + [tuple((0, 0) if i == d else (0, n) for i, n in enumerate(shape))]))
    return cases


CASES = _cases()


def _reference_unpack(buf, x, boxes, add=False):
    out, at = x.clone(), 0
    for box in boxes:
        sl = tuple(slice(a, b) for a, b in box)
        n = out[sl].numel()
        part = buf[at:at + n].reshape(out[sl].shape)
        out[sl] = out[sl] + part if add else part
        at += n
    return out


def _same_layout(x):
    """A copy of ``x`` with its strides and storage offset (unpack into views too)."""
    store = torch.zeros(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype)
    y = store.as_strided(x.shape, x.stride(), x.storage_offset())
    y.copy_(x)
    return y


def _views(x):
    """x itself, a contiguous view with a storage offset, a non-contiguous view with a
    storage offset, and a transposed view."""
    yield "contiguous", x
    whole = torch.zeros((2,) + tuple(x.shape), dtype=x.dtype)
    whole[1].copy_(x)
    yield "contiguous with offset", whole[1]
    big = torch.zeros((3,) + tuple(s + 2 for s in x.shape), dtype=x.dtype)
    v = big[(1,) + tuple(slice(1, 1 + s) for s in x.shape)]
    v.copy_(x)
    yield "offset", v
    if x.dim() >= 2:
        t = x.transpose(0, -1).contiguous().transpose(0, -1)
        yield "transposed", t


def _check_packer(p, dtypes, cases):
    T = TorchPacker()
    checked = 0
    for dtype in dtypes:
        for ci, (shape, boxes) in enumerate(cases):
            x0 = _rand(shape, dtype, ci)
            for _, x in _views(x0):
                ref = _reference_pack(x, boxes)
                got = p.pack(x, boxes)
                assert got.dtype == dtype and torch.equal(got, ref), (p.name, dtype, shape, boxes)
                assert torch.equal(T.pack(x, boxes), ref)
                # unpack (overwrite) and unpack-add against torch, on disjoint boxes
                boxes = _disjoint(boxes)
                buf = _rand((T.pack(x, boxes).numel(),), dtype, 1000 + ci)
                a, b = x.clone(), _same_layout(x)
                p.unpack(buf, a, boxes)
                T.unpack(buf, b, boxes)
                assert torch.equal(a, b), (p.name, "unpack", dtype, shape)
                assert torch.equal(b, _reference_unpack(buf, x, boxes)), ("unpack", shape)
                if dtype != torch.bool:
                    a, b = x.clone(), _same_layout(x)
                    p.unpack(buf, a, boxes, add=True)
                    T.unpack(buf, b, boxes, add=True)
                    assert torch.equal(a, b), (p.name, "add", dtype, shape)
                    assert torch.equal(b, _reference_unpack(buf, x, boxes, add=True))
                checked += 1
    return checked


# ---------------------------------------------------------------- torch path, helpers


def test_torch_pack_matches_reference_and_roundtrips():
    T = TorchPacker()
    assert _check_packer(T, [torch.float64, torch.int32], CASES) > 50
    x = _rand((4, 5, 6), torch.float64, 0)
    boxes = halo_faces(x.shape, 1, 2)
    y = torch.zeros_like(x)
    T.unpack(T.pack(x, boxes), y, boxes)
    assert torch.equal(y[..., :1], x[..., :1]) and torch.equal(y[..., 5:], x[..., 5:])
    assert not y[..., 1:5].any()


def test_unpack_add_is_adjoint_of_pack():
    # <P x, b> == <x, P^T b> where P^T is unpack-add into zeros (disjoint boxes)
    T = TorchPacker()
    x = _rand((6, 7, 5), torch.float64, 3)
    boxes = halo_faces(x.shape, 2, 1) + [((0, 6), (2, 5), (0, 1))]
    b = _rand((T.pack(x, boxes).numel(),), torch.float64, 4)
    z = torch.zeros_like(x)
    T.unpack(b, z, boxes, add=True)
    assert abs(float((T.pack(x, boxes) * b).sum() - (x * z).sum())) < 1e-12


def test_box_validation():
    T = TorchPacker()
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="outside"):
        T.pack(x, [((0, 4), (0, 4))])
    with pytest.raises(ValueError, match="2 dims but the tensor has 3"):
        T.pack(torch.zeros(2, 2, 2), [((0, 1), (0, 1))])
    with pytest.raises(ValueError, match="needs? 8|boxes need 8"):
        T.unpack(torch.zeros(3), x, [((0, 2), (0, 4))])


def test_collapse_merges_contiguous_dims():
    # NCHW face of the last dim: (N,C,H) merge into one strided walk
    x = torch.zeros(2, 3, 8, 5)
    base, sz, st = collapse(((0, 2), (0, 3), (0, 8), (4, 5)), x.stride())
    assert (base, sz, st) == (4, [48], [5])
    base, sz, st = collapse(((0, 2), (1, 3), (2, 4), (0, 5)), x.stride())
    assert (base, sz, st) == (40 + 10, [2, 2, 10], [120, 40, 1])  # (H, W) rows merge
    base, sz, st = collapse(((1, 2), (0, 3), (0, 8), (0, 5)), x.stride())
    assert (base, sz, st) == (120, [120], [1])  # one whole batch entry: one run
    desc, ndim, biggest = describe((((0, 1), (0, 1), (0, 1), (0, 1)),
                                    ((0, 2), (1, 3), (2, 4), (0, 5))), x.stride())
    # rows: (buf_off, count, base, size[3], stride[3]); the unit box is left-padded
    assert ndim == 3 and biggest == 40
    assert desc.tolist() == [0, 1, 0, 1, 1, 1, 0, 0, 1,
                             1, 40, 50, 2, 2, 10, 120, 40, 1]


# ---------------------------------------------------------------- numba CPU


@pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")
def test_numba_cpu_equals_torch_all_dtypes():
    assert _check_packer(NumbaCPUPacker(), DTYPES, CASES) > 500


@pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")
def test_numba_reuses_out_buffer_and_description():
    p = NumbaCPUPacker()
    x = _rand((4, 6, 8), torch.float32, 1)
    boxes = tuple(halo_faces(x.shape, 1, 2))
    out = torch.empty(2 * 4 * 6)
    got = p.pack(x, boxes, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, _reference_pack(x, boxes))
    assert p.prepare(x, boxes) is p.prepare(x, boxes)
    with pytest.raises(ValueError, match="pack buffer"):
        p.pack(x, boxes, out=torch.empty(3))


# ---------------------------------------------------------------- numba.cuda (simulator)

_SIM_SCRIPT = r"""
import json, random, sys
import torch
sys.path.insert(0, sys.argv[1])
from gpudist.kernels.numba_pack import NumbaCUDAPacker, simulator
from gpudist.kernels.torch_pack import TorchPacker
from gpudist.kernels import halo_faces
assert simulator()
p, T = NumbaCUDAPacker(), TorchPacker()
rnd = random.Random(3)
res = []
for dtype in (torch.float64, torch.float32, torch.int32, torch.float16, torch.complex64):
    for shape in ((9,), (3, 5), (2, 3, 4)):
        boxes = [tuple(sorted((rnd.randint(0, n), rnd.randint(0, n))) for n in shape)
                 for _ in range(2)] + halo_faces(shape, 1, len(shape) - 1)
        g = torch.Generator().manual_seed(len(res))
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 8).to(dtype)
        ok_pack = torch.equal(p.pack(x, boxes), T.pack(x, boxes))
        keep = []
        for bx in boxes:  # unpack needs disjoint boxes
            if not any(all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(bx, k))
                       for k in keep):
                keep.append(bx)
        boxes = keep
        buf = (torch.randn(T.pack(x, boxes).numel(), generator=g,
                           dtype=torch.float64) * 8).to(dtype)
        a, b = x.clone(), x.clone()
        p.unpack(buf, a, boxes); T.unpack(buf, b, boxes)
        ok_unpack = torch.equal(a, b)
        p.unpack(buf, a, boxes, add=True); T.unpack(buf, b, boxes, add=True)
        res.append([str(dtype), list(shape), ok_pack, ok_unpack, torch.equal(a, b)])
print("RESULT " + json.dumps(res))
"""


@pytest.mark.skipif(not HAS_NUMBA, reason="numba not installed")
def test_numba_cuda_kernel_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _SIM_SCRIPT, str(ROOT)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert len(res) == 15
    bad = [x for x in res if not all(x[2:])]
    assert not bad, bad


# ---------------------------------------------------------------- CUDA C++ (nvcc / cupy)


def _nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_cuda_source_compiles_to_ptx(tmp_path):
    from gpudist.kernels.cupy_pack import name_expressions, source_path

    out = tmp_path / "halo_pack.ptx"
    r = subprocess.run([_nvcc(), "-ptx", "-arch=sm_80", str(source_path()), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    entries = re.findall(r"\.entry\s+(\S+?)\(", out.read_text())
    # one entry per name expression CuPy asks for, with the expected kernel names
    assert len(entries) == len(name_expressions()) == 17
    for kind, n in (("halo_pack", 4), ("halo_unpack", 4), ("halo_unpack_add", 9)):
        assert sum(bool(re.match(rf"_Z\d+{kind}I", e)) for e in entries) == n, kind


def _gpu_cupy():
    if not torch.cuda.is_available():
        return False
    from gpudist.kernels.cupy_pack import cupy_available

    return cupy_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_cupy_and_numba_cuda_on_gpu_equal_torch():
    small = CASES[::3]
    T = TorchPacker()
    tested = []
    impls = []
    if _gpu_cupy():
        from gpudist.kernels.cupy_pack import CupyPacker

        impls.append(CupyPacker())
    if HAS_NUMBA:
        from gpudist.kernels.numba_pack import NumbaCUDAPacker

        if NumbaCUDAPacker().device_ok(torch.device("cuda")):
            impls.append(NumbaCUDAPacker())
    if not impls:
        pytest.skip("neither cupy nor numba.cuda can run on this GPU")
    for p in impls:
        for dtype in DTYPES:
            for ci, (shape, boxes) in enumerate(small):
                x = _rand(shape, dtype, ci).cuda()
                ref = T.pack(x, boxes)
                assert torch.equal(p.pack(x, boxes), ref), (p.name, dtype, shape)
                boxes = _disjoint(boxes)
                buf = _rand((T.pack(x, boxes).numel(),), dtype, ci + 50).cuda()
                for add in ((False, True) if dtype != torch.bool else (False,)):
                    a, b = x.clone(), x.clone()
                    p.unpack(buf, a, boxes, add=add)
                    T.unpack(buf, b, boxes, add=add)
                    assert torch.equal(a, b), (p.name, dtype, shape, add)
        tested.append(p.name)
    assert tested


# ---------------------------------------------------------------- dispatcher


def test_dispatcher_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("GPUDIST_PACKER", raising=False)
    monkeypatch.delenv("GPUDIST_PACKER_AUTOTUNE", raising=False)
    monkeypatch.setattr(kernels, "_TUNED", {})
    assert "torch" in available("cpu")
    assert get_packer("cpu", torch.float32).name == "torch"
    if HAS_NUMBA:
        assert "numba" in available("cpu")
        assert get_packer("cpu", torch.float32, prefer="numba").name == "numba"
        monkeypatch.setenv("GPUDIST_PACKER", "numba")
        assert get_packer("cpu", torch.float64).name == "numba"
        # an explicit preference beats the environment
        assert get_packer("cpu", torch.float64, prefer="torch").name == "torch"
    # cupy cannot serve CPU tensors: falls back to the default
    monkeypatch.setenv("GPUDIST_PACKER", "cupy")
    assert get_packer("cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown packer"):
        get_packer("cpu", prefer="fortran")
    if not torch.cuda.is_available():
        monkeypatch.delenv("GPUDIST_PACKER")
        assert get_packer("cuda").name == "torch"  # nothing else can run without a GPU


def test_cuda_default_is_cupy_then_torch(monkeypatch):
    """On CUDA the default is CuPy, else torch: numba.cuda (whose dispatch measured ~180
    us a launch on an H200, 8x torch's indexing) serves by preference only."""
    monkeypatch.delenv("GPUDIST_PACKER", raising=False)
    monkeypatch.delenv("GPUDIST_PACKER_AUTOTUNE", raising=False)
    monkeypatch.setattr(kernels, "_TUNED", {})
    fake = {name: type("P", (), {"name": name})() for name in ("cupy", "numba")}
    served = {"cupy": True, "numba": True}
    monkeypatch.setattr(kernels, "_resolve",
                        lambda name, dev: fake[name] if served.get(name) else None)
    assert get_packer("cuda").name == "cupy"
    served["cupy"] = False  # CuPy missing: torch, although numba.cuda could serve
    assert get_packer("cuda").name == "torch"
    assert get_packer("cuda", prefer="numba").name == "numba"


def test_autotune_records_a_measured_choice(monkeypatch):
    monkeypatch.delenv("GPUDIST_PACKER", raising=False)
    monkeypatch.setattr(kernels, "_TUNED", {})
    name = autotune("cpu", torch.float32, shape=(2, 8, 16, 16), repeats=3)
    assert name in available("cpu")
    assert kernels._TUNED[("cpu", torch.float32)] == name
    assert get_packer("cpu", torch.float32).name == name
    # another dtype is not affected until tuned
    assert ("cpu", torch.float64) not in kernels._TUNED


# ---------------------------------------------------------------- benchmark smoke test


def test_bench_kernels_writes_json_and_csv(tmp_path):
    from bench.kernels import main

    assert main(["--device", "cpu", "--quick", "--impls", "torch", "--dims", "3",
                 "--widths", "1", "--repeats", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    ops = {(r["impl"], r["op"]) for r in data["rows"]}
    assert ops == {("copy", "copy"), ("torch", "pack"), ("torch", "unpack"),
                   ("torch", "unpack-add")}
    assert all(r["time_us"] > 0 and r["bytes"] == 2 * 2 * 4 * 32 * 4 for r in data["rows"])
    assert (tmp_path / "kernels_cpu.csv").read_text().startswith("impl,op,device")


def test_cuda_source_ships_with_the_package():
    """The CUDA C++ source is found inside the package (a symlink to csrc/ in a checkout,
    a copy in a wheel via package-data), so a wheel install can compile the kernels."""
    from pathlib import Path

    import gpudist.kernels
    from gpudist.kernels.cupy_pack import source_path

    pkg = Path(gpudist.kernels.__file__).parent
    p = source_path()
    assert p.is_file() and p.parent == pkg / "csrc", p
    assert "__global__" in p.read_text()
    root = pkg.parents[1]
    text = (root / "pyproject.toml").read_text()
    assert '"gpudist.kernels" = ["csrc/*.cu"' in text
