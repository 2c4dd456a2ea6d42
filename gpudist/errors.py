"""Exceptions raised by gpudist. Each names the problem; collective checks raise on every rank."""

from __future__ import annotations


class GpudistError(RuntimeError):
    """Base class of every gpudist error."""


class PartitionError(GpudistError, ValueError):
    """A partition does not fit the world, the tensor, or another partition."""


class ShapeError(GpudistError, ValueError):
    """A tensor's shape does not match the decomposition an operator expects."""


class HaloError(GpudistError, ValueError):
    """A kernel/partition configuration needs data from beyond direct neighbours."""


class DeviceError(GpudistError, ValueError):
    """Devices or dtypes disagree between tensors or ranks."""


class CommTimeout(GpudistError, TimeoutError):
    """A communication did not complete within the timeout (a peer is missing or stuck)."""


class LaunchError(GpudistError):
    """The launch environment is inconsistent or incomplete."""
