"""Expert (mixture-of-experts) linear layers: one sharded linear per expert.

The input has shape ``(num_experts, tokens..., in_features)`` (the tokens already dispatched
to their experts, e.g. ``(E, capacity, features)``) and lies over ``P_x`` the standard way;
partition axis 0 splits the experts (*expert parallelism*): each worker holds its experts'
blocks of the weight ``(num_experts, out_features, in_features)`` and bias ``(num_experts,
out_features)``. The rest is :mod:`gpudist.nn.linear_sharded` per expert:

* :class:`DistributedExpertAllGather`: AllGather of ``dim`` (default ``-2``, the tokens)
  over its axis (features whole on the input), local ``y_e = x_e W_e^T + b_e`` with row
  block ``m`` of every local expert's W; output over ``transposed_partition(P_x, dim, -1)``.
* :class:`DistributedExpertReduceScatter`: features split over the last axis (``dim``
  whole), local partial ``x_e W_e[:, m]^T``, ReduceScatter along ``dim``, ``+ b_e``; output
  over ``transposed_partition(P_x, -1, dim)``.

Adjoints by autograd, as in the linear layers; the parameter gradients are summed over the
replica axes (the axes other than the expert, model and feature axes) into the home blocks.

Sequential reference: ``y = torch.einsum('etf,eof->eto', x, W) + b[:, None]``, i.e. a loop
of ``torch.nn.Linear`` over the experts. Initialization rule: expert ``e``'s weight and bias
are those of ``torch.nn.Linear(in_features, out_features)`` built for ``e = 0, 1, ...`` in
order from the current RNG state (equal seeds on every rank give equal values);
``global_state_dict()`` holds the stacked ``weight``/``bias``. The ``*Zero`` forms shard
each block over its replica fibre (ZeRO), as the linear layers' do.
"""

from __future__ import annotations

import torch

from ..partition import Partition
from ._layer import ShardedParameters
from ._zero import ZeroParameters
from .linear_sharded import _ShardedLinear

__all__ = ["DistributedExpertAllGather", "DistributedExpertAllGatherZero",
           "DistributedExpertReduceScatter", "DistributedExpertReduceScatterZero"]


class _Experts(_ShardedLinear):
    experts = True

    def __init__(self, P_x: Partition, num_experts: int, in_features: int, out_features: int,
                 bias: bool = True, *, dim: int = -2, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super(_ShardedLinear, self).__init__()  # not the linear constructor
        self._build(P_x, num_experts, in_features, out_features, bias, dim, dtype, device)

    def _init_params(self, E, fi, fo, bias, dtype, dev):
        ws, bs = [], []
        for _ in range(E):  # expert order, one torch.nn.Linear each
            seq = torch.nn.Linear(fi, fo, bias=bias, dtype=dtype, device=dev)
            ws.append(seq.weight.detach())
            if bias:
                bs.append(seq.bias.detach())
        return torch.stack(ws), (torch.stack(bs) if bias else None)


class DistributedExpertAllGather(ShardedParameters, _Experts):
    """Per expert ``torch.nn.Linear`` in the AllGather form (see the module docstring):
    input ``(num_experts, tokens..., in_features)`` with the features whole, experts split
    over partition axis 0 and ``dim`` over its own axis (the model axis)."""


class DistributedExpertReduceScatter(ShardedParameters, _Experts):
    """Per expert ``torch.nn.Linear`` in the ReduceScatter form (see the module docstring):
    input ``(num_experts, tokens..., in_features)`` with the features split over the last
    partition axis, ``dim`` whole, experts split over partition axis 0."""

    gather_form = False


class DistributedExpertAllGatherZero(ZeroParameters, _Experts):
    """:class:`DistributedExpertAllGather` with each (expert, row) block of the weight and
    bias sharded ZeRO-style over its replica fibre (all-gathered on use)."""

    zero = True


class DistributedExpertReduceScatterZero(ZeroParameters, _Experts):
    """:class:`DistributedExpertReduceScatter` with the weight's (expert, column) blocks and
    the bias's expert blocks sharded ZeRO-style over their replica fibres."""

    gather_form = False
    zero = True
