"""Run by tests/test_foundation.py under a launcher: join, reduce, finalize, three times
(a world joined again after finalize() hung under torchrun and failed under a plain env
launch: the launcher's store held the last world's keys, its port was served twice).
REJOIN_PROGRAM_GROUP=1: the program made the default group itself; gpudist's world data
moves on a group of its own, and the program's group outlives every finalize()."""

import os
import sys

import torch

import gpudist
from gpudist import Partition
from gpudist.primitives import AllSumReduce

own = os.environ.get("REJOIN_PROGRAM_GROUP") == "1"
if own:
    import torch.distributed as dist

    dist.init_process_group("gloo")
for i in range(3):
    w = gpudist.init(backend=os.environ.get("REJOIN_BACKEND", "auto"), timeout=30)
    y = AllSumReduce(Partition.grid((w.size,)), axes=(0,))(torch.ones(2))
    print(f"rank {w.rank} world {i} {w.backend} {y.tolist()}", flush=True)
    if own:
        assert w.transport.group(range(w.size)).handle is not dist.group.WORLD
    gpudist.finalize()
    if own:
        t = torch.full((1,), float(i))
        dist.all_reduce(t)
        print(f"rank {w.rank} program group {i} {t.item()}", flush=True)
sys.exit(0)
