"""Every distributed layer, forward + backward, against torch in the same process group.

At 1 rank: the layer on a one-worker partition vs the torch layer on the whole tensor (the
overhead ratio). At N > 1 ranks: time and peak memory per worker, and the ratio against
the same torch op on this worker's block with no communication (the compute gpudist cannot
avoid). Layers (``--layers``):

* ``conv2d``       DistributedConv2d, spatial (1,1,N/2,2) partition, 3x3, padding 1
                   (the default local step: the block copied into the halo buffer, conv
                   of that)
* ``conv2d_strips`` the same with ``boundary_strips = True`` (conv of the block plus thin
                   strip convs of the halo faces; no copy of the block)
* ``conv2d_strips_serial`` the strips with ``halo.overlap = False`` (the exchange completed
                   before the block's conv starts: what the overlap saves)
* ``conv2d_strips_overlap`` the strips with ``halo.overlap = True`` (the block's conv while
                   the exchange is in flight; their default only where the transport moves
                   messages by itself: gloo, NCCL, not MPI without a progress thread)
* ``conv2d_chan``  DistributedConv2d, channels split: P_w (1,2,N/2,1,1), x (1,N/2,1,1)
* ``maxpool2d``    DistributedMaxPool2d 3x3, stride 2, padding 1, spatial partition
* ``maxpool2d_copy`` the same with ``edge_split = False`` (the block copied into the halo
                   buffer, pooling of that)
* ``avgpool2d``    DistributedAvgPool2d 2x2, stride 2, spatial partition
* ``batchnorm2d``  DistributedBatchNorm (training mode), spatial partition
* ``upsample2d``   DistributedUpsample bilinear x2, spatial partition (if available)
* ``upsample2d_crop`` the same resampling the halo-extended block and cropping it (the
                   path before ``edge_split``)
* ``linear``       DistributedLinear with P_w (2,N/2), x (1,N/2), y (1,2)
* ``cross_entropy_vocab`` DistributedCrossEntropyLoss with the class dim split, logits
                   (8 x batch, 2 x out features) over (1,N): a vocabulary-parallel loss,
                   against torch's cross-entropy of the block (its classes' targets)

Peak memory per worker: CUDA max allocated on GPU, ``ru_maxrss`` (whole-process peak,
coarse) on CPU; the maximum over ranks is reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .common import Timer, add_common_args, paired, peak_memory_mib, progress, run_suite

LAYERS = ["conv2d", "conv2d_strips", "conv2d_strips_serial", "conv2d_strips_overlap",
          "conv2d_chan", "maxpool2d", "maxpool2d_copy", "avgpool2d", "batchnorm2d", "upsample2d",
          "upsample2d_crop", "linear", "cross_entropy_vocab"]


def grid2(n: int) -> tuple[int, int]:
    return (n // 2, 2) if n % 2 == 0 and n > 1 else (1, n)


def _block(G, P):
    """This rank's block of ``G`` over ``P`` as a DistTensor (its spec carried)."""
    from gpudist import Decomposition, DistTensor

    if not P.active:
        loc = G.new_zeros((0,) * G.dim())
    else:
        loc = G[Decomposition(tuple(G.shape), P.shape).global_slices(P.coords)].contiguous()
    return DistTensor.from_local(loc, P, tuple(G.shape))


def _build(name: str, world, shape: tuple[int, ...], feat: tuple[int, int, int]):
    """(distributed fn, its input, reference fn, its input, partition label) or None."""
    import torch
    import torch.nn.functional as F

    import gpudist.nn as gnn
    from gpudist import Partition

    n, dev = world.size, world.device
    ph, pw = grid2(n)
    P = Partition.grid((1, 1, ph, pw))
    torch.manual_seed(0)
    G = torch.rand(*shape, device=dev)
    x = _block(G, P)
    c = shape[1]
    whole = n == 1
    if name == "conv2d" or name.startswith("conv2d_strips"):
        layer = gnn.DistributedConv2d(P, c, c, 3, 1, 1, device=dev)
        layer.boundary_strips = name != "conv2d"
        layer.halo.overlap = {"conv2d_strips_serial": False,
                              "conv2d_strips_overlap": True}.get(name)
        ref = torch.nn.Conv2d(c, c, 3, 1, 1, device=dev)
        rfn = ref if whole else (lambda t: F.conv2d(t, ref.weight, ref.bias, 1, 1))
        return layer, x, rfn, (G if whole else x.local), f"1x1x{ph}x{pw}"
    if name == "conv2d_chan":
        if n % 2:
            return None
        cc = 2 * c
        P_w = Partition.grid((1, 2, n // 2, 1, 1))
        P_x = Partition([P_w.world_rank_of((0, 0, j, 0, 0)) for j in range(n // 2)],
                        (1, n // 2, 1, 1))
        G = torch.rand(shape[0], cc, *shape[2:], device=dev)
        layer = gnn.DistributedConv2d(P_x, cc, cc, 3, 1, 1, P_w=P_w, device=dev)
        ref = torch.nn.Conv2d(cc, cc, 3, 1, 1, device=dev)
        if whole:
            return layer, _block(G, P_x), ref, G, "w 1x1x1x1x1"
        ci, co = cc // (n // 2), cc // 2  # the local conv of one P_w worker
        wl = torch.rand(co, ci, 3, 3, device=dev, requires_grad=True)
        xr = torch.rand(shape[0], ci, *shape[2:], device=dev)
        return (layer, _block(G, P_x), lambda t: F.conv2d(t, wl, None, 1, 1), xr,
                f"w 1x2x{n // 2}x1x1")
    if name in ("maxpool2d", "maxpool2d_copy", "avgpool2d"):
        if name != "avgpool2d":
            layer, ref = gnn.DistributedMaxPool2d(P, 3, 2, 1), torch.nn.MaxPool2d(3, 2, 1)
            layer.edge_split = name == "maxpool2d"
            rfn = ref if whole else (lambda t: F.max_pool2d(t, 3, 2, 1))
        else:
            layer, ref = gnn.DistributedAvgPool2d(P, 2, 2), torch.nn.AvgPool2d(2, 2)
            rfn = ref
        return layer, x, rfn, (G if whole else x.local), f"1x1x{ph}x{pw}"
    if name == "batchnorm2d":
        layer = gnn.DistributedBatchNorm(P, c, device=dev)
        ref = torch.nn.BatchNorm2d(c, device=dev)
        return layer, x, ref, (G if whole else x.local), f"1x1x{ph}x{pw}"
    if name in ("upsample2d", "upsample2d_crop"):
        layer = gnn.DistributedUpsample(P, scale_factor=2, mode="bilinear",
                                        align_corners=False)
        layer.edge_split = name == "upsample2d"

        def rfn(t):
            return F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False)
        return layer, x, rfn, (G if whole else x.local), f"1x1x{ph}x{pw}"
    if name == "linear":
        batch, fin, fout = feat
        fo, fi = (1, 1) if whole else (2, n // 2)
        if fo * fi != n:
            return None
        P_w = Partition.grid((fo, fi))
        P_x = Partition([P_w.world_rank_of((0, j)) for j in range(fi)], (1, fi))
        P_y = Partition([P_w.world_rank_of((i, 0)) for i in range(fo)], (1, fo))
        layer = gnn.DistributedLinear(P_x, P_y, P_w, fin, fout, device=dev)
        GX = torch.rand(batch, fin, device=dev)
        ref = torch.nn.Linear(fin // fi, fout // fo, device=dev)
        xr = GX if whole else torch.rand(batch, fin // fi, device=dev)
        return layer, _block(GX, P_x), ref, xr, f"w {fo}x{fi}"
    if name == "cross_entropy_vocab":
        T, V = 8 * feat[0], 2 * feat[2]
        P_v = Partition.grid((1, n))
        loss = gnn.DistributedCrossEntropyLoss(P_v)
        gen = torch.Generator().manual_seed(1)
        t = torch.randint(0, V, (T,), generator=gen).to(dev)
        GX = torch.randn(T, V, generator=gen).to(dev)
        xv = _block(GX, P_v)
        tl = torch.randint(0, xv.local.shape[1], (T,), generator=gen).to(dev)
        return ((lambda z: loss(z, t)), xv, (lambda z: F.cross_entropy(z, tl)),
                GX if whole else xv.local.clone(), f"1x{n}")
    raise ValueError(f"unknown layer {name!r} (choose from {LAYERS})")


def layer_case(args, world, name: str, shape, feat) -> dict | None:
    import torch

    built = _build(name, world, shape, feat)
    if built is None:
        return None
    from gpudist import DistTensor

    layer, x, rfn, xr, label = built
    dev = world.device
    x = x.detach().requires_grad_(True)
    xr = xr.detach().requires_grad_(True)
    timer = Timer(world, args.warmup, args.repeats)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def run_(fn: Callable, t):
        def go():
            y = fn(t)
            y = y.local if isinstance(y, DistTensor) else y
            (y.sum() if y.numel() else y.sum() * 0).backward()
        return go

    res = timer.time({"gpudist": run_(layer, x), "reference": run_(rfn, xr)})
    mem = timer.max_over_ranks([peak_memory_mib(world)])[0]
    tg, tr = res["gpudist"]["median_s"], res["reference"]["median_s"]
    n = world.size
    return {
        "case": name, "backend": world.backend, "ranks": n, "partition": label,
        "global_shape": "x".join(map(str, feat if name == "linear" else (
            (8 * feat[0], 2 * feat[2]) if name == "cross_entropy_vocab" else shape))),
        "reference": "torch layer (whole tensor)" if n == 1 else "torch op on the block",
        "gpudist_ms": tg * 1e3, "reference_ms": tr * 1e3, "ratio": tg / tr,
        **paired(res["gpudist"], res["reference"]),
        "gpudist_p25_ms": res["gpudist"]["p25_s"] * 1e3,
        "gpudist_p75_ms": res["gpudist"]["p75_s"] * 1e3,
        "reference_p25_ms": res["reference"]["p25_s"] * 1e3,
        "reference_p75_ms": res["reference"]["p75_s"] * 1e3,
        "peak_mem_MiB_max_rank": mem,
    }


def conv_case(args, world, shape, case: str) -> dict | None:
    """The ``conv2d`` row for ``shape``, labelled ``case`` (used by the scaling suite)."""
    row = layer_case(args, world, "conv2d", shape, (0, 0, 0))
    if row:
        row["case"] = case
    return row


def run(args, world) -> list[dict]:
    try:
        import gpudist.nn  # noqa: F401
    except ImportError as e:
        if world.rank == 0:
            print(f"bench layers: gpudist.nn is not importable ({e}); skipped")
        return []
    if args.quick:
        shape, feat = (2, 2, 32, 32), (8, 32, 16)
    else:
        shape = tuple(args.shape if world.size > 1 else args.shape1)
        feat = tuple(args.features)
    names = args.layers or LAYERS
    bar = progress(world, len(names), f"layers {world.backend} x{world.size}",
                   args.no_progress)
    if not args.quick and names:  # the first layer timed read 10-20 % high (MPI, 4 ranks:
        # the same conv 1.19x first, 0.96x later in one run): one untimed pass first
        layer_case(argparse.Namespace(**{**vars(args), "repeats": 3}), world, names[0],
                   shape, feat)
    rows = []
    for name in names:
        row = layer_case(args, world, name, shape, feat)
        if row:
            rows.append(row)
        bar.update()
    bar.close()
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--layers", nargs="*", choices=LAYERS, default=None,
                   help="layers to run (default: all)")
    p.add_argument("--shape", type=int, nargs=4, default=[4, 16, 512, 512],
                   help="global input at N ranks")
    p.add_argument("--shape1", type=int, nargs=4, default=[4, 16, 256, 256],
                   help="input for the world-size-1 overhead case")
    p.add_argument("--features", type=int, nargs=3, default=[256, 4096, 4096],
                   metavar=("BATCH", "IN", "OUT"), help="linear layer problem")
    p.add_argument("--no-ws1", action="store_true", help="skip the world-size-1 case")


COLUMNS = ["case", "ranks", "partition", "global_shape", "gpudist_ms", "reference_ms", "ratio",
           "paired", "paired_lo", "paired_hi", "peak_mem_MiB_max_rank"]


def main(args, argv) -> None:
    counts = [args.ranks] if args.no_ws1 or args.ranks == 1 else [1, args.ranks]
    run_suite("layers", run, args, argv, rank_counts=counts, columns=COLUMNS)
