"""LeNet-5 on MNIST, sequential and distributed, trained side by side from the same start.

* :mod:`.network` -- the two networks (the paper's layout on 1-16 ranks);
* :mod:`.train` -- the training loop, accuracy, the report and its plot;
* ``python -m gpudist.examples.lenet5`` -- the command line (:mod:`.__main__`).
"""

from ..common import DTYPES, UsageError
from .network import (
    LAYOUTS,
    PARAM_LAYERS,
    DistributedLeNet5,
    LeNet5,
    layout_for,
    make_distributed,
    make_sequential,
    supported_ranks,
)
from .train import Config, accuracy, distributed_step, run_rank, sequential_step, train

__all__ = [
    "DTYPES", "LAYOUTS", "PARAM_LAYERS", "Config", "DistributedLeNet5", "LeNet5", "UsageError",
    "accuracy", "distributed_step", "layout_for", "make_distributed", "make_sequential",
    "run_rank", "sequential_step", "supported_ranks", "train",
]
