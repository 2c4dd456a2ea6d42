"""Run by tests/test_foundation.py under a launcher: join, reduce, finalize, three times
(a world joined again after finalize() hung under torchrun and failed under a plain env
launch: the launcher's store held the last world's keys, its port was served twice)."""

import os
import sys

import torch

import gpudist
from gpudist import Partition
from gpudist.primitives import AllSumReduce

for i in range(3):
    w = gpudist.init(backend=os.environ.get("REJOIN_BACKEND", "auto"), timeout=30)
    y = AllSumReduce(Partition.grid((w.size,)), axes=(0,))(torch.ones(2))
    print(f"rank {w.rank} world {i} {w.backend} {y.tolist()}", flush=True)
    gpudist.finalize()
sys.exit(0)
