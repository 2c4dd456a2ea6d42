"""gpudist: model parallelism for PyTorch where every data movement is a linear operator
with a hand-written adjoint."""

from .decomposition import Decomposition, block_range, block_sizes, block_starts
from .errors import (
    CommTimeout,
    DeviceError,
    GpudistError,
    HaloError,
    LaunchError,
    MismatchError,
    PartitionError,
    RemoteError,
    ShapeError,
    WorldAborted,
    WorldFinalized,
)
from .partition import Partition
from .runtime import (
    LaunchEnv,
    World,
    detect_launch,
    finalize,
    init,
    is_initialized,
    reset,
    world,
)
from .spec import PARTIAL, REPLICATE, DistTensor, TensorSpec

__all__ = [
    "PARTIAL", "REPLICATE", "CommTimeout", "Decomposition", "DeviceError", "DistTensor",
    "GpudistError", "HaloError", "LaunchEnv", "LaunchError", "MismatchError", "Partition",
    "PartitionError", "RemoteError", "ShapeError", "TensorSpec", "World", "WorldAborted",
    "WorldFinalized", "block_range", "block_sizes", "block_starts", "detect_launch",
    "finalize", "init", "is_initialized", "reset", "world",
]
__version__ = "0.2.0"
