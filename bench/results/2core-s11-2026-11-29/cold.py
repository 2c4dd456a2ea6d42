# The bench arrangement of a primitive call with its caches cold (eleventh session): the
# five cases of `bench primitives` (gpudist fwd, fwd+adj, raw fwd, raw pair, raw pair behind
# autograd) plus a sixth X timed in the same rotation, X being the steady form alone, the
# plan's repeated call, or the whole call. Run from the repository root:
#   SIZE=65536 N=400 OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python bench/results/2core-s11-2026-11-29/cold.py
import sys, time, os, inspect
sys.path.insert(0, os.path.abspath("."))
import torch, numpy as np
import gpudist
from bench.primitives import _cases
from bench.common import Timer
from gpudist import DistTensor
torch.set_num_threads(1)
w = gpudist.init(backend="mpi")
size = int(os.environ.get("SIZE", 65536))
(gf, ga, rf, ra, rg), (op, _) = _cases(os.environ.get("PRIM","broadcast"), size, w, True)
gf()
spec, plan = op._last[:2]
cv = inspect.getclosurevars(gf).nonlocals
xdd = next(v for v in cv.values() if isinstance(v, DistTensor))
loc = xdd.local
again = op._last[3]
T = Timer(w, 10, int(os.environ.get("N", 300)))
variants = {"steady": lambda: plan.fwd(loc), "again": lambda: again(loc), "call": lambda: op(xdd)}
for rep in range(2):
  for name, X in variants.items():
    r = T.time({"gf": gf, "ga": ga, "rf": rf, "ra": ra, "rg": rg, "X": X})
    if w.rank == 0:
        print(size, name, "X/rf", round(r["X"]["median_s"] / r["rf"]["median_s"], 2), "gf/rf", round(r["gf"]["median_s"] / r["rf"]["median_s"], 2),
              "us X", round(r["X"]["median_s"]*1e6, 1), "rf", round(r["rf"]["median_s"]*1e6, 1), flush=True)
os._exit(0)
