"""gpudist primitives vs the raw backend call moving the same bytes.

Cases (n = world size, ``size`` = bytes of the reference buffer, float32):

=============  ===============================  =================================  ========
primitive      gpudist                          raw (torch.distributed | mpi4py)   busbw
=============  ===============================  =================================  ========
broadcast      Broadcast root -> (n,)           broadcast | Bcast   (size bytes)   1
sumreduce      SumReduce (n,) -> root           reduce | Reduce     (size bytes)   1
allsumreduce   AllSumReduce((n,), axes=(0,))    all_reduce | Allreduce             2(n-1)/n
repartition    Repartition (n,1) -> (1,n)       all_to_all_single | Alltoall       (n-1)/n
repartition_   the same Repartition             the column strips packed with      (n-1)/n
pack                                            torch, then Alltoall (unpacked in
                                                the adjoint): the work it needs
allgather      AllGather((n,), 0, 0)            all_gather_into_tensor | Allgather (n-1)/n
reducescatter  ReduceScatter((n,), 0, 0)        reduce_scatter_tensor | Reduce_    (n-1)/n
                                                scatter_block (gloo has none: the
                                                all_reduce a user would call;
                                                gpudist sums an all-to-all's chunks)
=============  ===============================  =================================  ========

``size`` follows nccl-tests: the per-rank buffer for broadcast/reduce/all-reduce/all-to-all,
the gathered (output) buffer for all-gather. ``fwd`` times the forward; ``fwd+adj`` times
forward + backward (the adjoint: reduce for broadcast, broadcast for reduce, ...), compared
with the raw forward call followed by the raw adjoint call and (``ratio_autograd``) with
that raw pair behind torch's autograd (a Function whose backward makes the raw adjoint
call): what autograd's engine costs any op with a backward. ``spec`` says whether the input
was a :class:`gpudist.DistTensor` (its spec carried: no metadata exchange, the normal case
between layers) or a plain local block (its spec found by a metadata exchange, once per
local shape where every participant holds a block, every call otherwise). Memory, the
largest over ranks: ``kept_MiB_max_rank``, what the case's operators keep between calls
(both instances' pooled buffers; not the transport's buffers shared by
all operators, e.g. gloo reduce-scatter's chunks); ``peak_mem_MiB_max_rank``, the process's
peak (:func:`bench.common.peak_memory_mib`).
"""

from __future__ import annotations

import argparse

from .common import (
    KiB,
    MiB,
    RawBackend,
    Timer,
    add_common_args,
    paired,
    peak_memory_mib,
    progress,
    run_suite,
)

PRIMS = ["broadcast", "sumreduce", "allsumreduce", "repartition", "repartition_pack",
         "allgather", "reducescatter"]
BUSBW = {"broadcast": lambda n: 1.0, "sumreduce": lambda n: 1.0,
         "allsumreduce": lambda n: 2 * (n - 1) / n, "repartition": lambda n: (n - 1) / n,
         "allgather": lambda n: (n - 1) / n, "reducescatter": lambda n: (n - 1) / n,
         "repartition_pack": lambda n: (n - 1) / n}


def sizes_of(args) -> list[int]:
    if args.sizes:
        return [_parse(s) for s in args.sizes]
    if args.quick:
        return [4 * KiB, 64 * KiB]
    out, s = [], 4 * KiB
    while s <= args.max_size:
        out.append(s)
        s *= 4
    return out


def _parse(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": KiB, "m": MiB, "g": 1024 * MiB}
    for suf in ("kib", "mib", "gib", "k", "m", "g"):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mult[suf[0]])
    return int(s)


class _Raw(RawBackend):
    """Raw backend calls on preallocated buffers (torch.distributed or mpi4py)."""

    @staticmethod
    def _np(t):
        return t.detach().numpy()

    def broadcast(self, buf):
        if self.mpi:
            self.comm.Bcast(self._np(buf), root=0)
        else:
            self.dist.broadcast(buf, 0)

    def reduce(self, buf, out):
        if self.mpi:
            self.comm.Reduce(self._np(buf), self._np(out), op=self.MPI.SUM, root=0)
        else:
            self.dist.reduce(buf, 0)

    def all_reduce(self, buf, out):
        if self.mpi:
            self.comm.Allreduce(self._np(buf), self._np(out), op=self.MPI.SUM)
        else:
            self.dist.all_reduce(buf)

    def all_to_all(self, out, buf):
        if self.mpi:
            self.comm.Alltoall(self._np(buf), self._np(out))
        else:
            self.dist.all_to_all_single(out, buf)

    def all_gather(self, out, buf):
        if self.mpi:
            self.comm.Allgather(self._np(buf), self._np(out))
        else:
            (getattr(self.dist, "all_gather_single", None)
             or self.dist.all_gather_into_tensor)(out, buf)

    def reduce_scatter(self, out, buf):
        if self.mpi:
            self.comm.Reduce_scatter_block(self._np(buf), self._np(out), op=self.MPI.SUM)
        elif self.dist.get_backend() == "gloo":  # gloo has none: the all-reduce it costs
            self.dist.all_reduce(buf)
        else:
            self.dist.reduce_scatter_tensor(out, buf)


class _RawPair:
    """Made at first use: a ``torch.autograd.Function`` whose forward runs a raw forward
    call and whose backward runs the raw adjoint call (both on preallocated buffers)."""

    fn = None

    @classmethod
    def apply(cls, x, fwd, adj, out, grad_in):
        if cls.fn is None:
            import torch

            class Pair(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, fwd, adj, out, grad_in):
                    ctx.adj, ctx.grad_in = adj, grad_in
                    fwd()
                    return out.detach()  # a new tensor object, as gpudist's pooled buffers

                @staticmethod
                def backward(ctx, dy):
                    ctx.adj()
                    return ctx.grad_in.detach(), None, None, None, None

            cls.fn = Pair
        return cls.fn.apply(x, fwd, adj, out, grad_in)


def _cases(prim: str, size: int, world, hint: bool):
    """(gpudist fwd, gpudist fwd+adj, raw fwd, raw fwd+adj, raw fwd+adj behind autograd)
    closures and the two gpudist instances; ``hint``: the input is a DistTensor (else a
    plain block)."""
    import torch

    from gpudist import PARTIAL, DistTensor, Partition, TensorSpec
    from gpudist.primitives import (
        AllGather,
        AllSumReduce,
        Broadcast,
        ReduceScatter,
        Repartition,
        SumReduce,
    )

    n, r = world.size, world.rank
    dev = world.device
    numel = size // 4
    raw = _Raw(world)
    f32 = dict(dtype=torch.float32, device=dev)
    P = Partition.grid((n,))
    root = Partition.root(1, 0)
    full = torch.rand(numel, **f32)
    empty = torch.empty(0, **f32)

    # gpudist's input, its spec and the adjoint's seed; ``raw_calls`` makes the raw
    # forward and adjoint calls on buffers of their own
    if prim == "broadcast":
        make = lambda: Broadcast(root, P)  # noqa: E731
        x = full if r == 0 else empty
        spec = TensorSpec(root, (numel,), torch.float32, dev.type)
        dy = torch.rand(numel, **f32)

        def raw_calls():
            buf, seed, out = full.clone(), dy.clone(), torch.empty_like(dy)
            return (lambda: raw.broadcast(buf)), (lambda: raw.reduce(seed, out))
    elif prim == "sumreduce":
        make = lambda: SumReduce(P, root)  # noqa: E731
        x = full
        spec = TensorSpec(P, (numel,), torch.float32, dev.type, (PARTIAL,))
        dy = torch.rand(numel, **f32) if r == 0 else empty

        def raw_calls():
            buf, out = full.clone(), torch.empty_like(full)
            return (lambda: raw.reduce(buf, out)), (lambda: raw.broadcast(out))
    elif prim == "allsumreduce":
        make = lambda: AllSumReduce(P, axes=(0,))  # noqa: E731
        x = full
        spec = TensorSpec(P, (numel,), torch.float32, dev.type, (PARTIAL,))
        dy = torch.rand(numel, **f32)

        def raw_calls():
            buf, seed, out = full.clone(), dy.clone(), torch.empty_like(full)
            return (lambda: raw.all_reduce(buf, out)), (lambda: raw.all_reduce(seed, out))
    elif prim in ("repartition", "repartition_pack"):
        m = max(1, numel // n)
        g = (n * m, n)  # local in (m, n) on (n,1); local out (n*m, 1) on (1,n)
        make = lambda: Repartition(Partition.grid((n, 1)), Partition.grid((1, n)))  # noqa: E731
        x = torch.rand(m, n, **f32)
        spec = TensorSpec(Partition.grid((n, 1)), g, torch.float32, dev.type)
        dy = torch.rand(n * m, 1, **f32)

        def raw_calls():
            src = x.reshape(-1).clone()
            dst = torch.empty_like(src)
            if prim == "repartition":  # the wire alone: contiguous buffers both ways
                return (lambda: raw.all_to_all(dst, src)), (lambda: raw.all_to_all(src, dst))
            # what this move needs: column strips packed, sent, unpacked on the way back
            packed = torch.empty(n, m, **f32)
            xr = x.clone()

            def rf():
                for j in range(n):  # column by column (faster than one transposed copy)
                    packed[j].copy_(xr[:, j])
                raw.all_to_all(dst, packed.view(-1))

            def rb():
                raw.all_to_all(packed.view(-1), dst)
                for j in range(n):
                    xr[:, j].copy_(packed[j])
            return rf, rb
    elif prim == "allgather":
        m = max(1, numel // n)
        make = lambda: AllGather(P, 0, 0)  # noqa: E731
        x = torch.rand(m, **f32)
        spec = TensorSpec(P, (n * m,), torch.float32, dev.type)
        dy = torch.rand(n * m, **f32)

        def raw_calls():
            buf, seed, gout = x.clone(), dy.clone(), torch.empty(n * m, **f32)
            # adjoint of all-gather is reduce-scatter; gloo has none, so the raw pair is
            # all-gather + all-reduce of the gathered buffer (an upper bound on raw work)
            return (lambda: raw.all_gather(gout, buf)), (lambda: raw.reduce_scatter(buf, seed))
    elif prim == "reducescatter":
        m = max(1, numel // n)
        make = lambda: ReduceScatter(P, 0, 0)  # noqa: E731
        x = torch.rand(n * m, **f32)
        dy = torch.rand(m, **f32)
        spec = TensorSpec(P, (n * m,), torch.float32, dev.type, (PARTIAL,))

        def raw_calls():
            # the raw call may work in place (gloo all-reduces its buffer): a copy of x
            buf, rout = x.clone(), torch.empty(m, **f32)
            seed, gout = dy.clone(), torch.empty(n * m, **f32)
            return (lambda: raw.reduce_scatter(rout, buf)), (lambda: raw.all_gather(gout, seed))
    else:
        raise ValueError(prim)
    op = make()
    # Each case, gpudist's and raw, moves buffers of its own, as gpudist's two instances
    # do: raw buffers shared by the three raw cases were touched three times a round and
    # stayed in cache where gpudist's were not (MPI, 1 MiB Broadcast: 80 vs 137 us for
    # the same call on a buffer used once a round, after a raw 1 MiB MPI_Reduce)
    rf, _ = raw_calls()
    rf2, rb2 = raw_calls()
    rf3, rb3 = raw_calls()

    def wrap(t):
        return DistTensor(t, spec) if hint else t

    def local(y):
        return y.local if isinstance(y, DistTensor) else y

    # the fwd+adj case calls its own instance (a call site of its own, as in a network): a
    # call unlike the previous one (here: grad mode on, then off) is checked across ranks
    op_adj = make()
    # every rank requires grad (zero-volume inputs too) so that every rank runs the adjoint
    xg = x.clone().requires_grad_(True)
    xd, xgd = wrap(x), wrap(xg)
    with torch.no_grad():
        y0 = local(op_adj(xd))
    if tuple(dy.shape) != tuple(y0.shape):
        dy = torch.rand_like(y0)

    def ra():  # the raw pair: forward call, then adjoint call
        rf2()
        rb2()

    # the same raw pair behind torch's autograd (a Function whose backward runs the raw
    # adjoint): the floor any op with a backward pays for autograd's engine, so that the
    # fwd+adj rows also say how much of gpudist's time is autograd and how much its own
    xr_g = torch.zeros_like(x).requires_grad_(True)
    gx_r = torch.zeros_like(x)
    dy_r = torch.rand(1, **f32)  # the Function's output: a stand-in (the raw calls write
    # their own buffers, as in the raw pair)

    def rg():
        torch.autograd.grad(_RawPair.apply(xr_g, rf3, rb3, dy_r, gx_r), xr_g, dy_r)

    def gf():  # (the input requires no grad: no graph is recorded, as in the raw call)
        op(xd)

    def ga():  # the adjoint's output as autograd hands it on (not accumulated into .grad:
        # the raw pair accumulates nothing either; inside a network it flows to the next op)
        torch.autograd.grad(local(op_adj(xgd)), xg, dy, allow_unused=True)

    return (gf, ga, rf, ra, rg), (op, op_adj)


def run(args, world) -> list[dict]:
    n = world.size
    timer = Timer(world, args.warmup, args.repeats)
    prims = args.prims or PRIMS
    sizes = sizes_of(args)
    hints = [True, False] if not args.no_hint_compare else [True]
    bar = progress(world, len(prims) * len(sizes) * len(hints), f"primitives {world.backend} x{n}",
                   args.no_progress)
    rows = []
    for prim in prims:
        for size in sizes:
            for hint in hints:
                (gf, ga, rf, ra, rg), ops = _cases(prim, size, world, hint)
                res = timer.time({"g_fwd": gf, "r_fwd": rf, "g_adj": ga, "r_adj": ra,
                                  "r_autograd": rg})
                # what gpudist keeps between calls (both instances: pooled buffers, reduce
                # programs) and the process's peak, the largest over ranks
                kept, peak = timer.max_over_ranks(
                    [sum(o.kept_nbytes() for o in ops) / 2**20, peak_memory_mib(world)])
                for mode, g, r in (("fwd", "g_fwd", "r_fwd"), ("fwd+adj", "g_adj", "r_adj")):
                    tg, tr = res[g]["median_s"], res[r]["median_s"]
                    passes = 1 if mode == "fwd" else 2
                    algbw = passes * size / tr / 1e9
                    rows.append({
                        "primitive": prim, "backend": world.backend, "ranks": n,
                        "bytes": size, "mode": mode, "hint": hint,
                        "gpudist_ms": tg * 1e3, "raw_ms": tr * 1e3, "ratio": tg / tr,
                        **paired(res[g], res[r]),
                        "gpudist_p25_ms": res[g]["p25_s"] * 1e3,
                        "gpudist_p75_ms": res[g]["p75_s"] * 1e3,
                        "raw_p25_ms": res[r]["p25_s"] * 1e3, "raw_p75_ms": res[r]["p75_s"] * 1e3,
                        # fwd+adj: vs the raw pair behind autograd (fwd: no graph, as raw)
                        **({"raw_autograd_ms": res["r_autograd"]["median_s"] * 1e3,
                            "ratio_autograd": tg / res["r_autograd"]["median_s"]}
                           if mode == "fwd+adj" else {}),
                        "gpudist_algbw_GBs": passes * size / tg / 1e9,
                        "gpudist_busbw_GBs": passes * size / tg / 1e9 * BUSBW[prim](n),
                        "raw_algbw_GBs": algbw, "raw_busbw_GBs": algbw * BUSBW[prim](n),
                        "kept_MiB_max_rank": kept, "peak_mem_MiB_max_rank": peak,
                    })
                bar.update()
                bar.set_postfix_str(f"{prim} {size // KiB} KiB")
    bar.close()
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--prims", nargs="*", choices=PRIMS, default=None)
    p.add_argument("--sizes", nargs="*", default=None, help="e.g. 1MiB 64MiB (default: sweep)")
    p.add_argument("--max-size", type=_parse, default=64 * MiB)
    p.add_argument("--no-hint-compare", action="store_true",
                   help="only time DistTensor inputs (skip the plain-block variant)")


COLUMNS = ["primitive", "bytes", "mode", "hint", "gpudist_ms", "raw_ms", "ratio",
           "paired", "paired_lo", "paired_hi", "raw_autograd_ms", "ratio_autograd",
           "gpudist_busbw_GBs", "raw_busbw_GBs", "kept_MiB_max_rank", "peak_mem_MiB_max_rank"]


def main(args, argv) -> None:
    run_suite("primitives", run, args, argv, columns=COLUMNS)
