"""A 2-D Fourier neural operator, sequential and distributed, trained side by side.

* :mod:`.network` -- the spectral convolution (distributed: local FFT along Y, a
  DistributedTranspose, local FFT along X, and back) and the two networks;
* :mod:`.train` -- the data (2-D Poisson), training loops, report and plot;
* ``python -m gpudist.examples.fno`` -- the command line (:mod:`.__main__`).
"""

from ..common import UsageError
from .network import (
    DistributedFNO2d,
    DistributedSpectralConv2d,
    FNO2d,
    SpectralConv2d,
    make_distributed,
    make_sequential,
)
from .train import Config, poisson_data, run_rank

__all__ = [
    "Config", "DistributedFNO2d", "DistributedSpectralConv2d", "FNO2d", "SpectralConv2d",
    "UsageError", "make_distributed", "make_sequential", "poisson_data", "run_rank",
]
