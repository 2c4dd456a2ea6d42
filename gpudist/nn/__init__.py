"""Distributed layers: torch layers composed with gpudist's primitives."""

from ..primitives import Repartition
from .conv import DistributedConv1d, DistributedConv2d, DistributedConv3d, DistributedConvNd
from .linear import DistributedLinear
from .loss import (
    LOSSES,
    DistributedBCELoss,
    DistributedBCEWithLogitsLoss,
    DistributedCrossEntropyLoss,
    DistributedKLDivLoss,
    DistributedL1Loss,
    DistributedLoss,
    DistributedMSELoss,
    DistributedNLLLoss,
    DistributedPoissonNLLLoss,
)
from .norm import DistributedBatchNorm
from .pooling import (
    DistributedAvgPool1d,
    DistributedAvgPool2d,
    DistributedAvgPool3d,
    DistributedMaxPool1d,
    DistributedMaxPool2d,
    DistributedMaxPool3d,
)
from .sampling import (
    DistributedInterpolate,
    DistributedUpsample,
    DistributedUpsamplingBilinear2d,
    DistributedUpsamplingNearest2d,
)

__all__ = [
    "LOSSES", "DistributedBCELoss", "DistributedBCEWithLogitsLoss",
    "DistributedCrossEntropyLoss", "DistributedKLDivLoss", "DistributedL1Loss",
    "DistributedMSELoss", "DistributedNLLLoss", "DistributedPoissonNLLLoss",
    "DistributedAvgPool1d", "DistributedAvgPool2d", "DistributedAvgPool3d",
    "DistributedBatchNorm", "DistributedConv1d", "DistributedConv2d", "DistributedConv3d",
    "DistributedConvNd", "DistributedInterpolate", "DistributedLinear", "DistributedLoss",
    "DistributedMaxPool1d", "DistributedMaxPool2d", "DistributedMaxPool3d",
    "DistributedUpsample", "DistributedUpsamplingBilinear2d", "DistributedUpsamplingNearest2d",
    "Repartition",
]
