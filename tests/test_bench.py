"""Smoke test of the bench harness: every suite with tiny sizes on 2 gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], out: Path) -> None:
    cmd = [sys.executable, "-m", "bench", *args]
    if args[0] != "plot":
        cmd += ["--quick", "--ranks", "2", "--warmup", "1", "--repeats", "3", "--no-progress",
                "--timeout", "60", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("suite,extra", [
    ("primitives", ["--sizes", "4KiB", "--no-hint-compare", "--huge-pages"]),
    ("halo", []),
    ("layers", []),
    ("scaling", []),
])
def test_suite_writes_results(tmp_path, suite, extra):
    try:
        import gpudist.nn  # noqa: F401
    except ImportError:
        if suite in ("layers", "scaling"):
            pytest.skip("gpudist.nn not importable yet")
    _run([suite, *extra], tmp_path)
    js = list(tmp_path.glob(f"{suite}_gloo_*.json"))
    cs = list(tmp_path.glob(f"{suite}_gloo_*.csv"))
    assert js and cs
    data = json.loads(js[0].read_text())
    assert data["meta"]["torch"] and data["meta"]["cpu_count"]
    if Path("/proc/self/smaps").exists():  # the ranks' torch asks for huge pages iff told
        import os

        told = "--huge-pages" in extra or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        assert data["meta"]["torch_huge_pages"] is told, data["meta"]
    rows = data["rows"]
    assert rows
    for r in rows:
        assert r["gpudist_ms"] > 0
        assert r["ratio"] > 0
        if suite != "scaling":
            assert r["paired_lo"] <= r["paired"] <= r["paired_hi"], r
    header = cs[0].read_text().splitlines()[0]
    assert "ratio" in header and "gpudist_ms" in header
    if suite == "primitives":
        assert {r["primitive"] for r in rows} >= {"broadcast", "sumreduce", "allsumreduce",
                                                  "repartition", "allgather"}
        assert all(r["raw_busbw_GBs"] > 0 for r in rows)
        # every case keeps its pooled buffers on some rank (4 KiB: at least 2 KiB)
        assert all(r["kept_MiB_max_rank"] * 2**20 >= 2048 for r in rows), rows
        assert all(r["peak_mem_MiB_max_rank"] > 10 for r in rows)
    if suite == "halo":  # working buffers at least the block, plus the faces' buffers
        assert all(r["kept_MiB_max_rank"] > 0 and r["peak_mem_MiB_max_rank"] > 10
                   for r in rows), rows
    if suite == "scaling":
        assert all("efficiency" in r for r in rows)
    _run(["plot", "--src", str(tmp_path)], tmp_path)
    assert list(tmp_path.glob("*.png"))


def test_paired_ratio_cancels_drift():
    """The paired ratio is the median of per-repeat ratios (drift shared by both cases
    cancels), and its interval holds it; the ratio of medians would not see the pairing."""
    sys.path.insert(0, str(ROOT))
    from bench.common import paired, stats

    a = [1.1 * 2 ** (i % 5) for i in range(40)]  # 1.1x b, whatever the machine did
    b = [2 ** (i % 5) for i in range(40)]
    p = paired(stats(a), stats(b))
    assert p["paired"] == pytest.approx(1.1) and p["paired_lo"] == pytest.approx(1.1)
    c = list(reversed(b))  # the same times, not paired with a's
    q = paired(stats(a), stats(c))
    assert q["paired_lo"] < 1.0 < q["paired_hi"]
    assert stats(a)["median_s"] / stats(c)["median_s"] == pytest.approx(1.1)


def test_cuda_without_a_device_says_so(tmp_path):
    """``--device cuda`` where torch sees no GPU: one clear line, not a dead rank."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    p = subprocess.run([sys.executable, "-m", "bench", "layers", "--device", "cuda",
                        "--ranks", "1", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "sees no CUDA device" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_device_check_script_is_valid_bash():
    """bench/device_check.sh (the prepared run for a lent GPU machine) parses, and refuses
    an unknown phase with its usage line."""
    script = ROOT / "bench" / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    p = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": "/tmp/gpudist-dc",
                                        "PYTHON": sys.executable})
    assert p.returncode == 2 and "usage" in p.stderr, p.stdout + p.stderr


def test_targets_checklist_verdicts():
    """``python -m bench table --targets``: each measured case #14 sets a bar for, with
    met / not met / unclear read from the paired ratio and its interval."""
    from bench.table import targets

    def prim(name, size, mode, p, lo, hi, hint="True"):
        return {"primitive": name, "bytes": str(size), "mode": mode, "hint": hint,
                "backend": "mpi", "ranks": "4", "ratio": str(p), "paired": str(p),
                "paired_lo": str(lo), "paired_hi": str(hi)}

    rows = {
        "primitives": [prim("broadcast", 1 << 20, "fwd", 1.02, 1.0, 1.04),
                       prim("broadcast", 4 << 20, "fwd", 1.04, 0.95, 1.2),  # holds the bar
                       prim("broadcast", 64 << 20, "fwd", 1.2, 1.1, 1.3),
                       prim("broadcast", 64 << 10, "fwd", 1.4, 1.2, 1.5),
                       prim("broadcast", 4 << 10, "fwd", 9.0, 8.0, 10.0),  # no bar
                       prim("broadcast", 1 << 20, "fwd", 3.0, 2.9, 3.1, hint="False")],
        "layers": [{"case": "conv2d", "ranks": "4", "backend": "gloo", "ratio": "1.2",
                    "paired": "", "paired_lo": "", "paired_hi": ""},
                   {"case": "conv2d", "ranks": "1", "backend": "gloo", "ratio": "1.0",
                    "paired": "", "paired_lo": "", "paired_hi": ""}],
        "halo": [{"mode": "exchange", "backend": "mpi", "ratio": "0.9", "paired": "0.9",
                  "paired_lo": "0.8", "paired_hi": "1.0"},
                 {"mode": "operator", "backend": "mpi", "ratio": "5", "paired": "5",
                  "paired_lo": "4", "paired_hi": "6"}],
    }
    lines = targets(rows)[2:]
    verdicts = {tuple(c.strip() for c in ln.strip("|").split("|"))[1]: ln.split("|")[-2]
                .strip() for ln in lines}
    assert verdicts == {"exchange": "met", "conv2d": "not met",
                        "broadcast 1 MiB fwd": "met", "broadcast 4 MiB fwd": "unclear",
                        "broadcast 64 MiB fwd": "not met",
                        "broadcast 64 KiB fwd": "unclear"}, lines


def test_table_reads_several_folders_and_refuses_none(tmp_path):
    """``bench table --src`` takes the folders a run wrote (halo/, primitives/, ...); a
    folder holding no CSV (the run's parent folder) is an error, not an empty table."""
    a, b = tmp_path / "halo", tmp_path / "primitives"
    a.mkdir()
    b.mkdir()
    (a / "halo_mpi_2r.csv").write_text("mode,backend,ratio,paired,paired_lo,paired_hi\n"
                                       "exchange,mpi,0.9,0.9,0.8,1.0\n")
    (b / "primitives_mpi_2r.csv").write_text(
        "primitive,backend,ranks,bytes,mode,hint,ratio,paired,paired_lo,paired_hi\n"
        "broadcast,mpi,2,1048576,fwd,True,3.0,3.0,2.9,3.1\n")
    cmd = [sys.executable, "-m", "bench", "table", "--targets", "--src"]
    p = subprocess.run(cmd + [str(a), str(b)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "met: 1, unclear: 0, not met: 1" in p.stdout, p
    p = subprocess.run(cmd + [str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "no CSV files" in p.stderr, p


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only (madvise)")
def test_page_size_probe_runs_under_mpiexec():
    """bench/pages.py (RESULTS.md's page-size finding): two rounds of its four cases, and
    its huge-page buffer is advised as such (``hg`` in the mapping's flags)."""
    from tests.conftest import HAS_MPI
    from tests.harness import mpiexec

    if not HAS_MPI:
        pytest.skip("mpi4py or mpiexec not installed")
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "bench.pages", "--mib",
                        "4", "--repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if "MiB Bcast" in x]
    assert len(lines) == 8 and all(x.endswith(" ms") for x in lines), p.stdout

    import os

    import torch

    from bench.common import MiB, advised_huge_pages
    from bench.pages import huge_pages

    t = huge_pages(4 * MiB)
    assert advised_huge_pages(t.data_ptr()) is True
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # torch's own 4 MiB: small pages
        u = torch.rand(MiB)
        assert advised_huge_pages(u.data_ptr()) is False


def test_overhead_bench_times_every_primitive_with_the_wire_cut():
    """bench/overhead.py: every primitive, both modes, a positive CPU time on each rank
    (the stand-in communicators answer every call; a call they miss would hang or raise),
    and the wire really cut: a 16 MiB Broadcast or AllGather, which move data only (their
    steady forms copy nothing), costs microseconds, where the real transfer costs
    milliseconds of CPU time (the tenth session's operators bound their prepared
    collectives before the script cut the wire, and it timed them moving data)."""
    from tests.conftest import HAS_MPI
    from tests.harness import mpiexec

    if not HAS_MPI:
        pytest.skip("mpi4py or mpiexec not installed")
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "bench.overhead", ".",
                        "--calls", "10", "--repeats", "1", "--bytes", str(16 << 20)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [x.split() for x in p.stdout.splitlines() if x and not x.startswith("#")]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (n, m) for n in ("broadcast", "sumreduce", "allsumreduce", "repartition",
                         "allgather", "reducescatter") for m in ("fwd", "fwd+adj")), p.stdout
    assert all(len(r) == 4 and float(r[2]) > 0 and float(r[3]) > 0 for r in rows), p.stdout
    moves = [r for r in rows if r[0] in ("broadcast", "allgather") and r[1] == "fwd"]
    assert len(moves) == 2 and all(float(t) < 300 for r in moves for t in r[2:]), p.stdout
