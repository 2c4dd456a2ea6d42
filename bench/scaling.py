"""Weak and strong scaling of DistributedConv2d (3x3, 16->16, padding 1) fwd+bwd over
1, 2, 4 ranks: time and peak memory per worker, efficiency.

Weak: the local block per worker is fixed (``--local``, default (4,16,256,256)); the global
input grows with the (N/2, 2) grid; efficiency = t(1) / t(N). Strong: the global input is
fixed (``--global``, default (4,16,512,512)); efficiency = t(1) / (N t(N)).
"""

from __future__ import annotations

import argparse

from .common import add_common_args, progress, run_suite
from .layers import conv_case, grid2


def run(args, world) -> list[dict]:
    n = world.size
    ph, pw = grid2(n)
    loc = (1, 2, 16, 16) if args.quick else tuple(args.local)
    glo = (1, 2, 32, 32) if args.quick else tuple(args.global_)
    rows = []
    bar = progress(world, 2, f"scaling {world.backend} x{n}", args.no_progress)
    for kind, shape in (("weak", (loc[0], loc[1], loc[2] * ph, loc[3] * pw)), ("strong", glo)):
        r = conv_case(args, world, shape, kind)
        if r:
            rows.append(r)
        bar.update()
    bar.close()
    return rows


def add_efficiency(rows: list[dict]) -> None:
    for kind in ("weak", "strong"):
        base = [r for r in rows if r["case"] == kind and r["ranks"] == 1]
        if not base:
            continue
        t1 = base[0]["gpudist_ms"]
        for r in rows:
            if r["case"] == kind:
                n = r["ranks"]
                t = r["gpudist_ms"]
                r["efficiency"] = t1 / t if kind == "weak" else t1 / (n * t)


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--counts", type=int, nargs="*", default=None,
                   help="rank counts (default 1 2 4, capped at --ranks)")
    p.add_argument("--local", type=int, nargs=4, default=[4, 16, 256, 256])
    p.add_argument("--global", dest="global_", type=int, nargs=4, default=[4, 16, 512, 512])


COLUMNS = ["case", "ranks", "partition", "global_shape", "gpudist_ms", "reference_ms",
           "efficiency", "peak_mem_MiB_max_rank"]


def main(args, argv) -> None:
    counts = args.counts or [c for c in (1, 2, 4, 8, 16) if c <= args.ranks]
    import bench.common as common

    orig = common.write_results

    def write(out_dir, name, rows, meta):  # efficiency needs every rank count's rows
        add_efficiency(rows)
        return orig(out_dir, name, rows, meta)

    common.write_results = write
    try:
        run_suite("scaling", run, args, argv, rank_counts=counts, columns=COLUMNS)
    finally:
        common.write_results = orig
