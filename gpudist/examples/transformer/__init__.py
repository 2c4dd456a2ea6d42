"""A small character-level transformer, sequential and distributed (sequence and tensor
parallel: sharded-weight linear layers, layer norm, embeddings), trained side by side.

* :mod:`.network` -- the two networks and the corpus;
* :mod:`.train` -- training loops, report and plot;
* ``python -m gpudist.examples.transformer`` -- the command line (:mod:`.__main__`).
"""

from ..common import UsageError
from .network import (
    CORPUS,
    CharTransformer,
    DistributedBlock,
    DistributedCharTransformer,
    make_distributed,
    make_sequential,
)
from .train import Config, run_rank

__all__ = [
    "CORPUS", "CharTransformer", "Config", "DistributedBlock", "DistributedCharTransformer",
    "UsageError", "make_distributed", "make_sequential", "run_rank",
]
