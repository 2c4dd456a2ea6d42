"""Distributed conv layer vs the same local conv with no communication, and world-size-1
overhead vs ``torch.nn.Conv2d``.

At N > 1 ranks: ``DistributedConv2d`` over a (1,1,N/2,2) partition of the global input
(default (4,16,512,512), 16->16, 3x3, padding 1), forward + backward, vs ``F.conv2d`` of the
same weights on the rank's local block (padding 1, so the same output size) -- the compute
gpudist cannot avoid. At 1 rank: ``DistributedConv2d`` on a one-worker partition vs
``torch.nn.Conv2d`` on the whole tensor. Peak memory per worker: CUDA max allocated on GPU,
``ru_maxrss`` (whole-process peak, coarse) on CPU. Skips with a message if ``gpudist.nn`` is
not importable.
"""

from __future__ import annotations

import argparse
import resource

from .common import Timer, add_common_args, progress, run_suite


def grid2(n: int) -> tuple[int, int]:
    return (n // 2, 2) if n % 2 == 0 and n > 1 else (1, n)


def conv_case(args, world, global_shape, case: str) -> dict | None:
    import torch
    import torch.nn.functional as F

    try:
        from gpudist.nn import DistributedConv2d
    except ImportError as e:
        if world.rank == 0:
            print(f"bench {case}: gpudist.nn is not importable yet ({e}); skipped")
        return None
    from gpudist import Partition

    n = world.size
    ph, pw = grid2(n)
    P = Partition.grid((1, 1, ph, pw))
    dev = world.device
    cin = cout = global_shape[1]
    timer = Timer(world, args.warmup, args.repeats)
    i, j = P.coords_of(P.index)[2:] if P.active else (0, 0)
    lh = global_shape[2] // ph + (1 if i < global_shape[2] % ph else 0)
    lw = global_shape[3] // pw + (1 if j < global_shape[3] % pw else 0)
    local = (global_shape[0], cin, lh, lw)
    torch.manual_seed(0)
    layer = DistributedConv2d(P, cin, cout, 3, 1, 1, 1, True).to(dev)
    ref = torch.nn.Conv2d(cin, cout, 3, 1, 1, bias=True).to(dev)
    x = torch.rand(*local, device=dev, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def g():
        layer(x).sum().backward()

    def r():
        if n == 1:
            ref(xr).sum().backward()
        else:
            F.conv2d(xr, ref.weight, ref.bias, 1, 1).sum().backward()

    res = timer.time({"gpudist": g, "local": r})
    if dev.type == "cuda":
        mem = torch.cuda.max_memory_allocated() / 2**20
    else:
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mem = timer.max_over_ranks([float(mem)])[0]
    tg, tr = res["gpudist"]["median_s"], res["local"]["median_s"]
    return {
        "case": case, "backend": world.backend, "ranks": n, "partition": f"1x1x{ph}x{pw}",
        "global_shape": "x".join(map(str, global_shape)),
        "local_shape": "x".join(map(str, local)),
        "reference": "torch.nn.Conv2d (whole tensor)" if n == 1 else "local conv, no comm",
        "gpudist_ms": tg * 1e3, "reference_ms": tr * 1e3, "ratio": tg / tr,
        "gpudist_p25_ms": res["gpudist"]["p25_s"] * 1e3,
        "gpudist_p75_ms": res["gpudist"]["p75_s"] * 1e3,
        "reference_p25_ms": res["local"]["p25_s"] * 1e3,
        "reference_p75_ms": res["local"]["p75_s"] * 1e3,
        "peak_mem_MiB_max_rank": mem,
    }


def run(args, world) -> list[dict]:
    shape = (1, 2, 32, 32) if args.quick else tuple(args.shape)
    if world.size == 1:
        shape = (1, 2, 32, 32) if args.quick else tuple(args.shape1)
    bar = progress(world, 1, f"layers {world.backend} x{world.size}", args.no_progress)
    row = conv_case(args, world, shape, "conv2d" if world.size > 1 else "conv2d_ws1")
    bar.update()
    bar.close()
    return [row] if row else []


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--shape", type=int, nargs=4, default=[4, 16, 512, 512],
                   help="global input at N ranks")
    p.add_argument("--shape1", type=int, nargs=4, default=[4, 16, 256, 256],
                   help="input for the world-size-1 overhead case")
    p.add_argument("--no-ws1", action="store_true", help="skip the world-size-1 case")


COLUMNS = ["case", "ranks", "partition", "global_shape", "gpudist_ms", "reference_ms", "ratio",
           "peak_mem_MiB_max_rank"]


def main(args, argv) -> None:
    counts = [args.ranks] if args.no_ws1 or args.ranks == 1 else [1, args.ranks]
    run_suite("layers", run, args, argv, rank_counts=counts, columns=COLUMNS)
