"""Halo exchange of a 2-D partition vs raw neighbour isend/irecv of the same bytes.

Default case (DESIGN section 9): global (1,16,1024,1024) float32 over a (1,1,2,2) partition
(ranks//2 x 2 in general), 3x3 kernel, stride 1, padding 1, so halo width 1 on interior
faces. gpudist: ``HaloExchange(P_x, 3, 1, 1, 1)`` forward (and forward + adjoint), with and
without the ``global_shape`` hint. Raw: per dimension, in the same order as gpudist (so the
corners travel through two hops), isend/irecv of preallocated contiguous buffers of the
same sizes to the same neighbours -- no packing, no copy of the local tensor.
"""

from __future__ import annotations

import argparse

from .common import RawBackend, Timer, add_common_args, progress, run_suite


def _grid(n: int) -> tuple[int, int]:
    if n == 1:
        return (1, 1)
    return (n // 2, 2)


class _P2P(RawBackend):
    def exchange(self, pairs) -> None:
        """pairs: [(peer, send_buf, recv_buf)] all posted at once, then waited."""
        if self.mpi:
            reqs = []
            for peer, s, r in pairs:
                reqs.append(self.comm.Irecv(r.numpy(), source=peer, tag=11))
                reqs.append(self.comm.Isend(s.numpy(), dest=peer, tag=11))
            self.MPI.Request.Waitall(reqs)
        else:
            works = []
            for peer, s, r in pairs:
                works.append(self.dist.irecv(r, peer))
                works.append(self.dist.isend(s, peer))
            for w in works:
                w.wait()


def run(args, world) -> list[dict]:
    import torch

    from gpudist import Partition
    from gpudist.halo import HaloExchange

    n = world.size
    ph, pw = _grid(n)
    used = ph * pw
    shape = tuple(args.shape) if not args.quick else (1, 4, 64, 64)
    k = args.kernel
    pad = k // 2
    P = Partition.grid((1, 1, ph, pw))
    timer = Timer(world, args.warmup, args.repeats)
    active = world.rank < used
    dev = world.device
    if active:
        i, j = P.coords_of(P.index)[2:]
        lh = shape[2] // ph + (1 if i < shape[2] % ph else 0)
        lw = shape[3] // pw + (1 if j < shape[3] % pw else 0)
        local = (shape[0], shape[1], lh, lw)
    else:
        local = (0, shape[1], 0, 0)
    x = torch.rand(*local, device=dev)
    rows = []
    bar = progress(world, 2, f"halo {world.backend} x{n}", args.no_progress)

    # raw: same neighbours, same byte counts, per-dimension steps like gpudist
    raw = _P2P(world)
    steps = []
    if active:
        h = pad
        nb_h, nb_w = P.neighbors(2), P.neighbors(3)
        n_h = sum(1 for q in nb_h if q is not None)
        # dim H first: faces h rows x local W; then dim W: h columns x (local H + H halos)
        for nb, cnt in ((nb_h, local[0] * local[1] * h * local[3]),
                        (nb_w, local[0] * local[1] * h * (local[2] + n_h * h))):
            steps.append([(q, torch.rand(cnt, device=dev), torch.empty(cnt, device=dev))
                          for q in nb if q is not None])
    halo_bytes = sum(s.numel() * 4 for st in steps for _, s, _ in st)

    def raw_fwd():
        for st in steps:
            if st:
                raw.exchange(st)

    def raw_adj():
        raw_fwd()
        for st in reversed(steps):
            if st:
                raw.exchange(st)

    for hint in (True, False):
        H = HaloExchange(P, k, 1, pad, 1, global_shape=shape if hint else None)
        xg = x.clone().requires_grad_(True)
        y0 = H(x)
        dy = torch.rand_like(y0)

        def g_fwd(H=H):
            with torch.no_grad():
                H(x)

        def g_adj(H=H, xg=xg, dy=dy):
            H(xg).backward(dy)

        res = timer.time({"g_fwd": g_fwd, "r_fwd": raw_fwd, "g_adj": g_adj, "r_adj": raw_adj})
        tot_bytes = timer.max_over_ranks([float(halo_bytes)])[0]
        for mode, g, r in (("fwd", "g_fwd", "r_fwd"), ("fwd+adj", "g_adj", "r_adj")):
            tg, tr = res[g]["median_s"], res[r]["median_s"]
            rows.append({
                "case": "halo", "backend": world.backend, "ranks": n, "partition": f"1x1x{ph}x{pw}",
                "global_shape": "x".join(map(str, shape)), "kernel": k, "mode": mode, "hint": hint,
                "halo_bytes_per_rank": int(tot_bytes),
                "gpudist_ms": tg * 1e3, "raw_ms": tr * 1e3, "ratio": tg / tr,
                "gpudist_p25_ms": res[g]["p25_s"] * 1e3, "gpudist_p75_ms": res[g]["p75_s"] * 1e3,
                "raw_p25_ms": res[r]["p25_s"] * 1e3, "raw_p75_ms": res[r]["p75_s"] * 1e3,
            })
        bar.update()
    bar.close()
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--shape", type=int, nargs=4, default=[1, 16, 1024, 1024])
    p.add_argument("--kernel", type=int, default=3)


COLUMNS = ["partition", "global_shape", "mode", "hint", "halo_bytes_per_rank", "gpudist_ms",
           "raw_ms", "ratio"]


def main(args, argv) -> None:
    run_suite("halo", run, args, argv, columns=COLUMNS)
