"""Data-movement primitives: linear operators with hand-written adjoints."""

from .allreduce import AllSumReduce, AllSumReduceOp
from .base import Primitive, apply, is_zero_volume, zero_volume
from .broadcast import Broadcast, BroadcastOp, SumReduce, SumReduceOp
from .gather import AllGather, AllGatherOp, ReduceScatter, ReduceScatterOp
from .repartition import Repartition, RepartitionOp, SendRecv, collect, distribute

__all__ = [
    "AllGather", "AllGatherOp", "AllSumReduce", "AllSumReduceOp", "Broadcast", "BroadcastOp",
    "Primitive", "ReduceScatter", "ReduceScatterOp", "Repartition", "RepartitionOp",
    "SendRecv", "SumReduce", "SumReduceOp", "apply", "collect", "distribute",
    "is_zero_volume", "zero_volume",
]
