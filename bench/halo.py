"""Halo exchange of a 2-D partition vs raw neighbour send/receive of the same faces.

Default case (DESIGN section 9): global (1,16,1024,1024) float32 over a (1,1,2,2) partition
(ranks//2 x 2 in general), 3x3 kernel, stride 1, padding 1, so halo width 1 on interior
faces. Rows (``mode``):

* ``exchange`` -- gpudist's exchange-only operator, in place on a working buffer that
  already holds the block (``plan.exchange_(W)``), vs the raw references;
* ``exchange+adjoint`` -- ``exchange_`` then ``exchange_adjoint_`` (the adjoint adds);
* ``operator`` / ``operator fwd+adj`` -- the whole primitive ``H(x)`` (block copied into the
  plan's buffer, then exchanged) and its autograd backward.

References, both on preallocated buffers, per dimension in gpudist's order (corners travel
through two hops), to the same neighbours: ``raw_inplace`` sends/receives contiguous
buffers of the faces' sizes (no packing: the wire alone); ``raw_pack`` also packs the
strided faces out of the working buffer and unpacks the received ones with plain torch
indexing (unpack-add in the adjoint) -- the work gpudist must do too; on MPI,
``raw_persist`` does what ``raw_pack`` does with persistent requests (``Send_init`` /
``Recv_init`` made once, one ``Startall`` + ``Waitall`` per step), as gpudist's MPI
transport does. ``ratio`` is gpudist over ``raw_pack``; ``ratio_inplace`` over
``raw_inplace``; ``ratio_persist`` over ``raw_persist``. Memory, the largest over ranks:
``kept_MiB_max_rank``, the buffers gpudist keeps between calls (both operator instances'
working buffers and their plans' send/receive buffers); ``peak_mem_MiB_max_rank``, the
process's peak.
"""

from __future__ import annotations

import argparse

from .common import RawBackend, Timer, add_common_args, paired, peak_memory_mib, progress, run_suite


def _grid(n: int) -> tuple[int, int]:
    if n == 1:
        return (1, 1)
    return (n // 2, 2)


class _P2P(RawBackend):
    def exchange(self, pairs) -> None:
        """pairs: [(peer, send_buf, recv_buf)] all posted at once, then waited."""
        if self.mpi:
            self.MPI.Request.Waitall(self._requests(pairs, self.comm.Irecv, self.comm.Isend))
        else:
            works = []
            for peer, s, r in pairs:
                if r is not None:
                    works.append(self.dist.irecv(r, peer))
                if s is not None:
                    works.append(self.dist.isend(s, peer))
            for w in works:
                w.wait()

    def persistent(self, pairs):
        """MPI persistent requests for ``exchange(pairs)``: start with :meth:`run`."""
        return self._requests(pairs, self.comm.Recv_init, self.comm.Send_init, tag=12)

    @staticmethod
    def _requests(pairs, recv, send, tag: int = 11) -> list:
        """MPI requests for [(peer, send_buf, recv_buf)], receives before sends per peer."""
        reqs = []
        for peer, s, r in pairs:
            if r is not None:
                reqs.append(recv(r.numpy(), source=peer, tag=tag))
            if s is not None:
                reqs.append(send(s.numpy(), dest=peer, tag=tag))
        return reqs

    def run(self, reqs) -> None:
        self.MPI.Prequest.Startall(reqs)
        self.MPI.Request.Waitall(reqs)


def _sl(box):
    return tuple(slice(a, b) for a, b in box)


def _numel(box):
    n = 1
    for a, b in box:
        n *= b - a
    return n


def run(args, world) -> list[dict]:
    import torch

    from gpudist import DistTensor, Partition, TensorSpec
    from gpudist.halo import HaloExchange

    n = world.size
    ph, pw = _grid(n)
    shape = tuple(args.shape) if not args.quick else (1, 4, 64, 64)
    k = args.kernel
    pad = k // 2
    P = Partition.grid((1, 1, ph, pw))
    timer = Timer(world, args.warmup, args.repeats)
    dev = world.device
    spec = TensorSpec(P, shape, torch.float32, dev.type)
    x = torch.rand(spec.local_shape, device=dev)
    H = HaloExchange(P, k, 1, pad, 1)
    rows = []
    bar = progress(world, 2, f"halo {world.backend} x{n}", args.no_progress)

    hp = H.local_plan(spec) if P.active else None
    W = torch.zeros(hp.work_shape, device=dev) if hp else None
    if hp:
        hp.bulk(W).copy_(x)
    raw = _P2P(world)
    # per step: [(peer, send box, recv box)] from the plan's geometry; buffers preallocated
    steps = []
    for st in (hp.steps if hp else ()):
        faces = []
        for i, peer in enumerate(st.peers):
            if peer is None:
                continue
            sb, rb = st.send[i], st.recv[i]
            faces.append((peer, sb, rb,
                          torch.rand(_numel(sb), device=dev) if _numel(sb) else None,
                          torch.empty(_numel(rb), device=dev) if _numel(rb) else None))
        steps.append(faces)
    halo_bytes = sum(4 * _numel(f[1]) for st in steps for f in st)

    def raw_inplace(adjoint=False):
        for st in (reversed(steps) if adjoint else steps):
            raw.exchange([(p, s, r) if not adjoint else (p, r, s) for p, _, _, s, r in st])

    def packed(adjoint, exchange):
        for st in (reversed(steps) if adjoint else steps):
            for _, sb, rb, s, r in st:  # pack what goes out
                src, buf = (rb, r) if adjoint else (sb, s)
                if buf is not None:
                    buf.view([b - a for a, b in src]).copy_(W[_sl(src)])
            exchange(st, adjoint)
            for _, sb, rb, s, r in st:  # unpack what came in (add in the adjoint)
                dst, buf = (sb, s) if adjoint else (rb, r)
                if buf is not None:
                    view = buf.view([b - a for a, b in dst])
                    if adjoint:
                        W[_sl(dst)].add_(view)
                    else:
                        W[_sl(dst)].copy_(view)

    def raw_pack(adjoint=False):
        packed(adjoint, lambda st, adj: raw.exchange(
            [(p, r, s) if adj else (p, s, r) for p, _, _, s, r in st]))

    if raw.mpi:  # one set of persistent requests per step and direction, made once
        preqs = {(id(st), adj): raw.persistent([(p, r, s) if adj else (p, s, r)
                                                for p, _, _, s, r in st])
                 for st in steps for adj in (False, True)}

        def raw_persist(adjoint=False):
            packed(adjoint, lambda st, adj: raw.run(preqs[(id(st), adj)]))
    else:  # no persistent requests in torch.distributed: the same as raw_pack
        def raw_persist(adjoint=False):
            raw_pack(adjoint)

    def g_exchange():
        if hp:
            hp.exchange_(W)

    def g_exchange_adj():
        if hp:
            hp.exchange_(W)
            hp.exchange_adjoint_(W)

    cases = {"g_ex": g_exchange, "r_in": raw_inplace, "r_pk": raw_pack,
             "g_exa": g_exchange_adj, "r_ina": lambda: (raw_inplace(), raw_inplace(True)),
             "r_pka": lambda: (raw_pack(), raw_pack(True)), "r_ps": raw_persist,
             "r_psa": lambda: (raw_persist(), raw_persist(True))}
    res = timer.time(cases)
    bar.update()

    H2 = HaloExchange(P, k, 1, pad, 1)  # the fwd+adj case's own instance (see primitives)
    xd = DistTensor(x, spec)
    xg = DistTensor(x.clone().requires_grad_(True), spec)
    y0 = H(xd)
    dy = torch.rand_like(y0)

    def g_op():
        with torch.no_grad():
            H(xd)

    def g_op_adj():  # the adjoint's output as handed on (not accumulated into .grad)
        torch.autograd.grad(H2(xg), xg.local, dy)

    res.update(timer.time({"g_op": g_op, "g_opa": g_op_adj, "r_pk2": raw_pack,
                           "r_pka2": lambda: (raw_pack(), raw_pack(True)),
                           "r_in2": raw_inplace,
                           "r_ina2": lambda: (raw_inplace(), raw_inplace(True)),
                           "r_ps2": raw_persist,
                           "r_psa2": lambda: (raw_persist(), raw_persist(True))}))
    bar.update()
    bar.close()
    if raw.mpi:
        for reqs in preqs.values():
            for q in reqs:
                q.Free()
    tot_bytes = timer.max_over_ranks([float(halo_bytes)])[0]
    # what gpudist keeps between calls (both instances' working buffers and send/receive
    # buffers) and the process's peak, the largest over ranks
    kept, peak = timer.max_over_ranks([(H.kept_nbytes() + H2.kept_nbytes()) / 2**20,
                                       peak_memory_mib(world)])
    for mode, g, rp, ri, rs in (("exchange", "g_ex", "r_pk", "r_in", "r_ps"),
                                ("exchange+adjoint", "g_exa", "r_pka", "r_ina", "r_psa"),
                                ("operator", "g_op", "r_pk2", "r_in2", "r_ps2"),
                                ("operator fwd+adj", "g_opa", "r_pka2", "r_ina2", "r_psa2")):
        tg, tp, ti = res[g]["median_s"], res[rp]["median_s"], res[ri]["median_s"]
        ts = res[rs]["median_s"]
        rows.append({
            "case": "halo", "backend": world.backend, "ranks": n, "partition": f"1x1x{ph}x{pw}",
            "global_shape": "x".join(map(str, shape)), "kernel": k, "mode": mode,
            "halo_bytes_per_rank": int(tot_bytes),
            "gpudist_ms": tg * 1e3, "raw_pack_ms": tp * 1e3, "raw_inplace_ms": ti * 1e3,
            "raw_ms": tp * 1e3, "ratio": tg / tp, "ratio_inplace": tg / ti,
            "raw_persist_ms": ts * 1e3, "ratio_persist": tg / ts,
            **paired(res[g], res[rp]),
            "gpudist_p25_ms": res[g]["p25_s"] * 1e3, "gpudist_p75_ms": res[g]["p75_s"] * 1e3,
            "raw_p25_ms": res[rp]["p25_s"] * 1e3, "raw_p75_ms": res[rp]["p75_s"] * 1e3,
            "kept_MiB_max_rank": kept, "peak_mem_MiB_max_rank": peak,
        })
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--shape", type=int, nargs=4, default=[1, 16, 1024, 1024])
    p.add_argument("--kernel", type=int, default=3)


COLUMNS = ["partition", "global_shape", "mode", "halo_bytes_per_rank", "gpudist_ms",
           "raw_pack_ms", "raw_inplace_ms", "raw_persist_ms", "ratio", "ratio_inplace",
           "ratio_persist", "paired", "paired_lo", "paired_hi", "kept_MiB_max_rank",
           "peak_mem_MiB_max_rank"]


def main(args, argv) -> None:
    run_suite("halo", run, args, argv, columns=COLUMNS)
