"""gpudist: model parallelism for PyTorch where every data movement is a linear operator
with a hand-written adjoint."""

from .decomposition import Decomposition, block_range, block_sizes, block_starts
from .errors import (
    CommTimeout,
    DeviceError,
    GpudistError,
    HaloError,
    LaunchError,
    PartitionError,
    ShapeError,
)
from .partition import Partition
from .runtime import LaunchEnv, World, detect_launch, finalize, init, is_initialized, world

__all__ = [
    "CommTimeout", "Decomposition", "DeviceError", "GpudistError", "HaloError", "LaunchEnv",
    "LaunchError", "Partition", "PartitionError", "ShapeError", "World", "block_range",
    "block_sizes", "block_starts", "detect_launch", "finalize", "init", "is_initialized",
    "world",
]
__version__ = "0.1.0"
