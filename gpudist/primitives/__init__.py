"""Data-movement primitives: linear operators with hand-written adjoints."""

from .allreduce import AllSumReduce
from .base import Plan, Primitive, is_zero_volume, zero_volume
from .broadcast import Broadcast, SumReduce
from .gather import AllGather, ReduceScatter
from .repartition import Repartition, SendRecv, collect, distribute

__all__ = [
    "AllGather", "AllSumReduce", "Broadcast", "HaloExchange", "Plan", "Primitive",
    "ReduceScatter", "Repartition", "SendRecv", "SumReduce", "collect", "distribute",
    "is_zero_volume", "zero_volume",
]


def __getattr__(name: str):
    if name == "HaloExchange":  # a primitive too; lives in gpudist.halo (which imports .base)
        from ..halo.exchange import HaloExchange

        return HaloExchange
    raise AttributeError(name)
