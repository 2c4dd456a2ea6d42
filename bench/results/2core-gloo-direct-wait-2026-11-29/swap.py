"""One 64 KiB swap between 2 gloo ranks, 600 rounds after a barrier each: the raw
isend/irecv waited on the caller's thread against gpudist's transport (batch_p2p + wait),
alternated round by round; medians in us of the slower rank. Run from a tree's root:
python swap.py"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
import gpudist  # noqa: E402
from gpudist.launch import run  # noqa: E402
from gpudist.transport.base import P2P  # noqa: E402


def task(rounds=600):
    w = gpudist.world()
    tr, peer = w.transport, 1 - w.rank
    a, b = torch.ones(16384), torch.empty(16384)
    ops = [P2P("send", a, peer, 5), P2P("recv", b, peer, 5)]
    t = {"raw": [], "gpudist": []}
    for i in range(rounds):
        for kind in (("raw", "gpudist") if i % 2 else ("gpudist", "raw")):
            tr.barrier()
            t0 = time.perf_counter()
            if kind == "raw":
                for wk in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, tag=7),
                                                  dist.P2POp(dist.irecv, b, peer, tag=7)]):
                    wk.wait()
            else:
                with w.control.op((0, 1), "swap"):
                    tr.wait(tr.batch_p2p(ops))
            t[kind].append(time.perf_counter() - t0)
    return t


if __name__ == "__main__":
    res = run(task, 2, backend="gloo")
    for k in ("raw", "gpudist"):
        m = statistics.median(max(x, y) for x, y in zip(res[0][k], res[1][k]))
        print(f"{k}: {m * 1e6:.1f} us")
