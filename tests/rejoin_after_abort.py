"""Run by tests/test_foundation.py under a launcher: a world aborted by one rank's error,
finalize(), then init() again: a LaunchError at once on every rank (the dead process
group was reused before and the next collective waited the whole timeout)."""

import os

import torch

import gpudist
from gpudist import LaunchError, Partition
from gpudist.primitives import AllSumReduce

rank = int(os.environ["RANK"])
try:  # (rank 1's failure may reach rank 0 while it still finishes init: in init's wait)
    w = gpudist.init(backend=os.environ.get("REJOIN_BACKEND", "auto"), timeout=30)
    P = Partition.grid((w.size,))
    if w.rank == 1:
        with w.control.scope("test"):
            raise RuntimeError("planted failure")
    AllSumReduce(P, axes=(0,))(torch.ones(2))
except Exception as e:  # noqa: BLE001 - rank 1's own error, the others' RemoteError
    print(f"rank {rank} first world: {type(e).__name__}", flush=True)
gpudist.finalize()
try:
    gpudist.init(backend=os.environ.get("REJOIN_BACKEND", "auto"), timeout=30)
    print(f"rank {rank} joined again", flush=True)
except LaunchError as e:
    print(f"rank {rank} refused: {str(e)[:80]}", flush=True)
