"""Distributed layers: torch layers composed with gpudist's primitives."""

from ..primitives import Repartition
from .conv import DistributedConv1d, DistributedConv2d, DistributedConv3d, DistributedConvNd
from .conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
    DistributedConvTransposeNd,
)
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
    "DistributedAvgPool1d",
    "DistributedAvgPool2d",
    "DistributedAvgPool3d",
    "DistributedBCELoss",
    "DistributedBCEWithLogitsLoss",
    "DistributedBatchNorm",
    "DistributedConv1d",
    "DistributedConv2d",
    "DistributedConv3d",
    "DistributedConvNd",
    "DistributedConvTranspose1d",
    "DistributedConvTranspose2d",
    "DistributedConvTranspose3d",
    "DistributedConvTransposeNd",
    "DistributedCrossEntropyLoss",
    "DistributedInterpolate",
    "DistributedKLDivLoss",
    "DistributedL1Loss",
    "DistributedLinear",
    "DistributedLoss",
    "DistributedMSELoss",
    "DistributedMaxPool1d",
    "DistributedMaxPool2d",
    "DistributedMaxPool3d",
    "DistributedNLLLoss",
    "DistributedPoissonNLLLoss",
    "DistributedUpsample",
    "DistributedUpsamplingBilinear2d",
    "DistributedUpsamplingNearest2d",
    "LOSSES",
    "Repartition",
]
