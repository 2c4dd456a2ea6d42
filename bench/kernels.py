"""Halo pack / unpack / unpack-add bandwidth of each packer vs a plain contiguous copy.

For every case (tensor shape, dimension, halo width) the two faces of that dimension are
packed into one buffer (``pack``), written back (``unpack``) and added back (``unpack-add``,
the adjoint's operation) with each available implementation (torch, numba, cupy, and
numba.cuda on GPUs); the baseline is ``dst.copy_(src)`` of two contiguous buffers holding
the same number of bytes, on the same device. Samples of the compared operations are
interleaved; each sample times ``inner`` back-to-back calls (chosen so a sample lasts at
least ``--min-sample-ms``), and the reported time is the median over ``--repeats`` samples.
Bandwidth = payload bytes / time (each payload byte counted once).

    python -m bench kernels [--device cpu|cuda] [--quick] [--out results]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .common import positive_int

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def _shape(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.lower().replace("x", ",").split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                   help="dtype(s) to time (default float32)")
    p.add_argument("--shape", action="append", type=_shape,
                   help="tensor shape, e.g. 1x16x1024x1024 (repeatable)")
    p.add_argument("--dims", type=int, nargs="+", default=None,
                   help="dimensions whose faces are packed (default: the last two)")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 3])
    p.add_argument("--impls", nargs="+", default=None,
                   help="packers to time (default: all available on the device)")
    p.add_argument("--repeats", type=positive_int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-sample-ms", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (tests)")
    p.add_argument("--out", default="results", help="output folder (default %(default)s)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    return p


def _packers(device: torch.device, names: Sequence[str] | None) -> list:
    from gpudist.kernels import _make, available

    out = []
    for name in names or available(device):
        key = name
        if name == "numba":
            key = "numba-cuda" if device.type == "cuda" else "numba"
        p = _make(key)
        if p is not None and p.device_ok(device):
            out.append(p)
    return out


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _inner_count(fn: Callable[[], None], sync, min_s: float) -> int:
    n = 1
    while True:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_s or n >= 4096:
            return n
        n = min(4096, max(n * 2, int(n * min_s / max(dt, 1e-9)) + 1))


def _measure(fns: dict[str, Callable[[], None]], sync, repeats: int, warmup: int,
             min_s: float) -> dict[str, tuple[float, float, float, int]]:
    """Interleaved samples; per name: (median, p25, p75) seconds per call, inner count."""
    inner = {k: _inner_count(f, sync, min_s) for k, f in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + repeats):
        for k, f in fns.items():
            n = inner[k]
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            sync()
            if r >= warmup:
                samples[k].append((time.perf_counter() - t0) / n)
    out = {}
    for k, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        out[k] = (statistics.median(s), q[0], q[2], inner[k])
    return out


def _ops(p, x, y, buf, boxes) -> dict[str, Callable[[], None]]:
    return {f"{p.name}:pack": lambda: p.pack(x, boxes, out=buf),
            f"{p.name}:unpack": lambda: p.unpack(buf, y, boxes),
            f"{p.name}:unpack-add": lambda: p.unpack(buf, y, boxes, add=True)}


def run(args) -> list[dict]:
    from gpudist.kernels import halo_faces

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench kernels: --device cuda but no CUDA device is available")
    dtypes = [DTYPES[d] for d in (args.dtype or ["float32"])]
    if args.quick:
        shapes = args.shape or [(2, 4, 32, 32)]
        args.repeats, args.warmup, args.min_sample_ms = min(args.repeats, 5), 1, 0.2
    else:
        shapes = args.shape or ([(4, 16, 256, 256), (1, 16, 1024, 1024)]
                                if device.type == "cuda" or os.cpu_count() > 4
                                else [(4, 16, 128, 128), (1, 16, 512, 512)])
    packers = _packers(device, args.impls)
    sync = _sync(device)
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            x = torch.randn(shape, device=device).to(dtype)
            dims = args.dims or [len(shape) - 2, len(shape) - 1]
            for dim in dims:
                for width in args.widths:
                    if 2 * width > shape[dim]:
                        continue
                    boxes = tuple(halo_faces(shape, width, dim))
                    n = sum(torch.Size([hi - lo for lo, hi in b]).numel() for b in boxes)
                    src = torch.randn(n, device=device).to(dtype)
                    dst = torch.empty_like(src)
                    fns: dict[str, Callable[[], None]] = {"copy": lambda d=dst, s=src: d.copy_(s)}
                    for p in packers:
                        buf = torch.empty(n, dtype=dtype, device=device)
                        y = x.clone()
                        p.pack(x, boxes, out=buf)  # compile / describe once
                        fns.update(_ops(p, x, y, buf, boxes))
                    res = _measure(fns, sync, args.repeats, args.warmup,
                                   args.min_sample_ms / 1e3)
                    nbytes = n * x.element_size()
                    t_copy = res["copy"][0]
                    for k, (t, p25, p75, inner) in res.items():
                        impl, _, op = k.partition(":")
                        rows.append({
                            "impl": impl, "op": op or "copy", "device": str(device),
                            "dtype": str(dtype).replace("torch.", ""),
                            "shape": "x".join(map(str, shape)), "dim": dim, "width": width,
                            "boxes": len(boxes), "elements": n, "bytes": nbytes,
                            "time_us": t * 1e6, "p25_us": p25 * 1e6, "p75_us": p75 * 1e6,
                            "inner": inner, "gbps": nbytes / t / 1e9,
                            "copy_time_us": t_copy * 1e6, "copy_gbps": nbytes / t_copy / 1e9,
                            "time_vs_copy": t / t_copy,
                        })
    return rows


def _table(rows: list[dict]) -> str:
    head = ["impl", "op", "dtype", "shape", "dim", "width", "bytes", "time_us", "gbps",
            "time_vs_copy"]
    lines = ["  ".join(f"{h:>12}" for h in head)]
    for r in rows:
        cells = []
        for h in head:
            v = r[h]
            cells.append(f"{v:12.2f}" if isinstance(v, float) else f"{v!s:>12}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _machine() -> dict:
    try:
        from .common import machine_info

        return machine_info()
    except Exception:  # pragma: no cover - bench.common unavailable
        import platform

        return {"platform": platform.platform(), "torch": torch.__version__}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    rows = run(args)
    print(_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"kernels_{torch.device(args.device).type}{'_' + args.tag if args.tag else ''}"
    meta = {"suite": "kernels", "machine": _machine(), "args": {
        k: (list(map(list, v)) if k == "shape" and v else v) for k, v in vars(args).items()}}
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"wrote {out / stem}.json and .csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
