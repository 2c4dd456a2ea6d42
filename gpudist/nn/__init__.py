"""Distributed layers: torch layers composed with gpudist's primitives."""

from ..primitives import Repartition
from .conv import DistributedConv1d, DistributedConv2d, DistributedConv3d, DistributedConvNd
from .conv_channel import (
    DistributedChannelAllGatherConv1d,
    DistributedChannelAllGatherConv2d,
    DistributedChannelAllGatherConv3d,
    DistributedChannelAllGatherConvTranspose1d,
    DistributedChannelAllGatherConvTranspose2d,
    DistributedChannelAllGatherConvTranspose3d,
    DistributedChannelReduceScatterConv1d,
    DistributedChannelReduceScatterConv2d,
    DistributedChannelReduceScatterConv3d,
    DistributedChannelReduceScatterConvTranspose1d,
    DistributedChannelReduceScatterConvTranspose2d,
    DistributedChannelReduceScatterConvTranspose3d,
)
from .conv_transpose import (
    DistributedConvTranspose1d,
    DistributedConvTranspose2d,
    DistributedConvTranspose3d,
    DistributedConvTransposeNd,
)
from .embedding import DistributedEmbedding, DistributedEmbeddingZero
from .experts import (
    DistributedExpertAllGather,
    DistributedExpertAllGatherZero,
    DistributedExpertReduceScatter,
    DistributedExpertReduceScatterZero,
)
from .gradients import GradScaler, clip_grad_norm_
from .layernorm import DistributedLayerNorm, DistributedLayerNormZero, DistributedRMSNormZero
from .linear import DistributedLinear
from .linear_sharded import (
    DistributedLinearAllGather,
    DistributedLinearAllGatherZero,
    DistributedLinearReduceScatter,
    DistributedLinearReduceScatterZero,
)
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
from .transpose import DistributedTranspose, transposed_partition

__all__ = [
    "DistributedAvgPool1d",
    "DistributedAvgPool2d",
    "DistributedAvgPool3d",
    "DistributedBCELoss",
    "DistributedBCEWithLogitsLoss",
    "DistributedBatchNorm",
    "DistributedChannelAllGatherConv1d",
    "DistributedChannelAllGatherConv2d",
    "DistributedChannelAllGatherConv3d",
    "DistributedChannelAllGatherConvTranspose1d",
    "DistributedChannelAllGatherConvTranspose2d",
    "DistributedChannelAllGatherConvTranspose3d",
    "DistributedChannelReduceScatterConv1d",
    "DistributedChannelReduceScatterConv2d",
    "DistributedChannelReduceScatterConv3d",
    "DistributedChannelReduceScatterConvTranspose1d",
    "DistributedChannelReduceScatterConvTranspose2d",
    "DistributedChannelReduceScatterConvTranspose3d",
    "DistributedConv1d",
    "DistributedConv2d",
    "DistributedConv3d",
    "DistributedConvNd",
    "DistributedConvTranspose1d",
    "DistributedConvTranspose2d",
    "DistributedConvTranspose3d",
    "DistributedConvTransposeNd",
    "DistributedCrossEntropyLoss",
    "DistributedEmbedding",
    "DistributedEmbeddingZero",
    "DistributedExpertAllGather",
    "DistributedExpertAllGatherZero",
    "DistributedExpertReduceScatter",
    "DistributedExpertReduceScatterZero",
    "DistributedInterpolate",
    "DistributedKLDivLoss",
    "DistributedL1Loss",
    "DistributedLayerNorm",
    "DistributedLayerNormZero",
    "DistributedLinear",
    "DistributedLinearAllGather",
    "DistributedLinearAllGatherZero",
    "DistributedLinearReduceScatter",
    "DistributedLinearReduceScatterZero",
    "DistributedLoss",
    "DistributedMSELoss",
    "DistributedMaxPool1d",
    "DistributedMaxPool2d",
    "DistributedMaxPool3d",
    "DistributedNLLLoss",
    "DistributedPoissonNLLLoss",
    "DistributedRMSNormZero",
    "DistributedTranspose",
    "DistributedUpsample",
    "DistributedUpsamplingBilinear2d",
    "DistributedUpsamplingNearest2d",
    "LOSSES",
    "Repartition",
    "transposed_partition",
    "clip_grad_norm_",
    "GradScaler",
]
