"""One 64 KiB swap between 2 gloo ranks, 600 rounds after a barrier each: raw isend/irecv,
batch_isend_irecv, and gpudist's batch_p2p + wait, in rotating order; medians in us of the
slower rank. Run from a tree's root: python swap3.py"""
import statistics, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, ".")
import gpudist
from gpudist.launch import run
from gpudist.transport.base import P2P

def task(rounds=600):
    w = gpudist.world()
    tr, peer = w.transport, 1 - w.rank
    a, b = torch.ones(16384), torch.empty(16384)
    ops = [P2P("recv", b, peer, 5), P2P("send", a, peer, 5)]
    g = tr.p2p_group
    kinds = ("isend/irecv", "batch", "gpudist")
    t = {k: [] for k in kinds}
    for i in range(rounds):
        for kind in kinds[i % 3:] + kinds[:i % 3]:
            tr.barrier()
            t0 = time.perf_counter()
            if kind == "batch":
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, tag=7, group=g),
                                                  dist.P2POp(dist.isend, a, peer, tag=7, group=g)]):
                    wk.wait()
            elif kind == "isend/irecv":
                ws = [dist.irecv(b, peer, tag=8, group=g), dist.isend(a, peer, tag=8, group=g)]
                for wk in ws: wk.wait()
            else:
                with w.control.op((0, 1), "swap"):
                    tr.wait(tr.batch_p2p(ops))
            t[kind].append(time.perf_counter() - t0)
    return t

if __name__ == "__main__":
    res = run(task, 2, backend="gloo")
    for k in res[0]:
        m = statistics.median(max(x, y) for x, y in zip(res[0][k], res[1][k]))
        print(f"{k}: {m * 1e6:.1f} us")
