import sys, os, time, statistics as st
sys.path.insert(0, "/work/main")
import torch, gpudist
from gpudist import DistTensor, Partition
from gpudist.primitives import Broadcast
torch.set_num_threads(1)
w = gpudist.init(backend="mpi")
from mpi4py import MPI
comm = MPI.COMM_WORLD
P = Partition.grid((w.size,)); root = Partition.grid((1,), ranks=[0])
n = int(sys.argv[1]) // 4
full = torch.rand(n)
op = Broadcast(root, P)
xd = DistTensor.from_local(full if w.rank == 0 else torch.empty(0), root, (n,))
grp = op.fans.mine_many.group if w.rank else op.fans.mine_one.group
tr = w.transport
b1, b2, b3, b4 = full.clone(), full.clone(), full.clone(), full.clone()
big = torch.rand(4 << 20)  # 16 MiB thrash
c2 = comm.Dup()
def g(): op(xd)
def raw(): comm.Bcast(b1.numpy(), root=0)
def iraw():
    r = c2.Ibcast(b2.numpy(), root=0)
    while not r.Test(): pass
def trans(): tr.wait([tr.broadcast(b3, 0, grp)])
def fans(): op.fans.broadcast(b4, b4)
plan = None
def runf(): op.run_forward(xd.local, op._last[1])
def spread(): op.spread(xd.local, op._last[1].out, "out")
xl = xd.local
def fans_pool():
    out = op.buffers.get("out", (n,), torch.float32, torch.device("cpu")) if w.rank else None
    op.fans.broadcast(xl, out)
def fans_full(): op.fans.broadcast(xl, b4)
cases = dict(g=g, raw=raw, iraw=iraw, trans=trans, fans=fans, runf=runf, spread=spread, fans_pool=fans_pool, fans_full=fans_full)
thrash = len(sys.argv) > 2
res = {k: [] for k in cases}
for i in range(300):
    names = list(cases)
    names = names[i % len(names):] + names[:i % len(names)]
    for k in names:
        if thrash: big.add_(1.0)
        comm.Barrier(); t = time.perf_counter(); cases[k](); res[k].append(time.perf_counter() - t)
mx = {k: comm.allreduce(v, op=MPI.MAX) if False else v for k, v in res.items()}
import numpy as np
per = {k: comm.allgather(np.median(v)) for k, v in res.items()}
out = {k: np.maximum.reduce([np.array(x) for x in comm.allgather(v)]) for k, v in res.items()}
if w.rank == 0:
    for k, v in out.items(): print(f"{k:9s} {np.median(v)*1e6:8.1f} us  per rank", " ".join(f"{x*1e6:.1f}" for x in per[k]))
