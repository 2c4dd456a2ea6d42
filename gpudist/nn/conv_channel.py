"""Channel-partitioned convolutions: all-gather or reduce-scatter of activations, weights
sharded ZeRO-style over the data axis (after microsoft/distdl's
``DistributedChannelAllGatherConvNd`` / ``DistributedChannelReduceScatterConvNd``).

``x`` (N, C_in, *spatial) lies over ``P_x = (P_d, P_c, 1, ..)`` the standard way: partition
axis 0 (the *data axis*) splits the batch, axis 1 (the *model axis*) the channels; the
spatial dims are not split (:class:`gpudist.nn.conv.DistributedConvNd` handles spatial
partitions). The output ``y`` (N, C_out, *spatial_out) lies over the same ``P_x``, its
channels split along the model axis.

AllGather form (``W`` split by rows: this worker's block of output channels, all inputs)::

    x^ <- AG_c x                (all input channels on every worker of the model axis)
    W_i <- AG_d w; b_i <- AG_d b  (the row block, from the chunks of the data axis)
    y  = conv(x^, W_i) + b_i    (this worker's block of output channels)
    adjoint: dx^, dW_i, db_i from the local conv; dx = RS_c dx^; dw = RS_d dW_i (...)

ReduceScatter form (``W`` split by columns: all outputs, this worker's input channels)::

    W_j <- AG_d w;  b_i <- AG_d b
    y^ = conv(x, W_j)           (partial sums over the model axis, all output channels)
    y  = RS_c y^ + b_i          (summed, this worker's block of output channels kept)
    adjoint: dy^ = AG_c dy; the local conv's adjoints; dw = RS_d dW_j, db = RS_d db_i

``AG_c``/``RS_c`` are the :class:`~gpudist.primitives.AllGather` / ``ReduceScatter`` along the
model axis (tensor dim 1), ``AG_d``/``RS_d`` those of :class:`~gpudist.nn._zero.ZeroShards`
along the data axis: each worker stores one chunk of its weight (and bias) block; the
chunks of the workers sharing a block are all-gathered on use, the gradients
reduce-scattered back (the data-parallel sum and the ZeRO split in one collective).

The transposed forms swap the roles of the weight's two channel dims (its layout is
``(C_in, C_out, *k)``): the AllGather form keeps a column block, the ReduceScatter form a
row block. Differences from the fork: the fork keeps whole weight blocks on the workers at
data coordinate 0 and broadcasts them (its ZeRO variant keeps unsharded local copies);
here they are always sharded over the data axis. ``groups`` must be 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import PartitionError, ShapeError, raised_everywhere
from ..partition import Partition
from ..primitives import AllGather, Plan, ReduceScatter
from ..spec import PARTIAL, REPLICATE, TensorSpec
from ._layer import DistributedModule, per_dim
from ._zero import ZeroParameters, ZeroShards

_TORCH = {(1, False): torch.nn.Conv1d, (2, False): torch.nn.Conv2d, (3, False): torch.nn.Conv3d,
          (1, True): torch.nn.ConvTranspose1d, (2, True): torch.nn.ConvTranspose2d,
          (3, True): torch.nn.ConvTranspose3d}
_FN = {(1, False): F.conv1d, (2, False): F.conv2d, (3, False): F.conv3d,
       (1, True): F.conv_transpose1d, (2, True): F.conv_transpose2d,
       (3, True): F.conv_transpose3d}
_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclass
class _ChannelPlan:
    out: TensorSpec
    x_gather: Plan | None     # AllGather form: the input channels
    y_scatter: Plan | None    # ReduceScatter form: the partial outputs
    w: Plan | None            # the ZeroShards gathers of weight and bias
    b: Plan | None


class _ChannelConvNd(ZeroParameters, DistributedModule):
    """What the channel-partitioned convolutions share (see the module docstring)."""

    autocast = "lower"  # torch.autocast runs it in its lower precision dtype

    spatial: int = 2
    transposed: bool = False
    gather_form: bool = True  # AllGather form; False: ReduceScatter form

    def _build(self, P_x: Partition, in_channels: int, out_channels: int, kernel_size,
               stride, padding, output_padding, dilation, groups: int, bias: bool,
               padding_mode: str, dtype, device) -> None:
        n, name = self.spatial, type(self).__name__
        if P_x.dim != n + 2:
            raise raised_everywhere(PartitionError(
                f"{name}: the input partition must have {n + 2} dimensions (P_d, P_c"
                f"{', 1' * n}), got {P_x.shape}"))
        if any(s != 1 for s in P_x.shape[2:]):
            raise raised_everywhere(PartitionError(
                f"{name}: P_x {P_x.shape} splits spatial dimensions; the channel-partitioned "
                f"convolution takes (P_d, P_c{', 1' * n}) (use DistributedConv{n}d for "
                f"spatial partitions)"))
        pc = P_x.shape[1]
        for what, c in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise raised_everywhere(ValueError(
                    f"{name}: {what} must be a positive int, got {c!r}"))
            if c < pc:
                raise raised_everywhere(PartitionError(
                    f"{name}: {what}={c} cannot be split over the {pc} workers of the "
                    f"channel axis of P_x {P_x.shape}"))
        if groups != 1:
            raise raised_everywhere(ValueError(
                f"{name}: groups={groups!r} is not supported (only groups=1); use "
                f"DistributedConv{n}d with P_w for grouped convolutions"))
        if padding_mode not in (("zeros",) if self.transposed else _MODES):
            raise raised_everywhere(ValueError(
                f"{name}: padding_mode={padding_mode!r} is not supported (use one of "
                f"{list(('zeros',) if self.transposed else _MODES)})"))
        self.k = per_dim("kernel_size", name, kernel_size, n, exact=True)
        self.s = per_dim("stride", name, stride, n)
        self.d = per_dim("dilation", name, dilation, n)
        if min(self.k + self.s + self.d) < 1:
            raise raised_everywhere(ValueError(
                f"{name}: kernel_size, stride and dilation must be positive, got "
                f"{self.k}, {self.s}, {self.d}"))
        if isinstance(padding, str):
            if self.transposed or padding not in ("same", "valid"):
                use = "an int or a tuple" if self.transposed else \
                    "an int, a tuple, 'valid' or 'same'"
                raise raised_everywhere(ValueError(f"{name}: padding={padding!r} (use {use})"))
            if padding == "same" and any(s != 1 for s in self.s):
                raise raised_everywhere(ValueError(
                    f"{name}: padding='same' needs stride 1, got {self.s}"))
            self.padding: str | tuple[int, ...] = padding
        else:
            self.padding = per_dim("padding", name, padding, n)
            if min(self.padding) < 0:
                raise raised_everywhere(ValueError(
                    f"{name}: padding must be non-negative, got {self.padding}"))
        self.op = per_dim("output_padding", name, output_padding, n)
        if any(o < 0 or o >= max(s, d) for o, s, d in zip(self.op, self.s, self.d)):
            raise raised_everywhere(ValueError(
                f"{name}: output_padding {self.op} must be non-negative and smaller than "
                f"stride {self.s} or dilation {self.d}"))
        self.P_x, self.in_channels, self.out_channels = P_x, in_channels, out_channels
        self.groups, self.padding_mode = groups, padding_mode
        self.setup(P_x, P_x.ranks)
        dev = device if device is not None else P_x.world.device
        cls = _TORCH[(n, self.transposed)]
        if self.transposed:
            seq = cls(in_channels, out_channels, self.k, self.s, self.padding, self.op, groups,
                      bias, self.d, padding_mode, dtype=dtype, device=dev)
        else:
            seq = cls(in_channels, out_channels, self.k, self.s, self.padding, self.d, groups,
                      bias, padding_mode, dtype=dtype, device=dev)
            self._pad = tuple(seq._reversed_padding_repeated_twice)
        # the weight dim the model axis splits: output channels (AllGather form) or input
        # channels (ReduceScatter form); the weight is (C_out, C_in, k) or, transposed,
        # (C_in, C_out, k)
        wdim = int(self.gather_form == self.transposed)
        shards = {"weight": ZeroShards(P_x, {1: wdim}, seq.weight.shape)}  # collective
        self.weight = torch.nn.Parameter(shards["weight"].shard(seq.weight))
        if bias:
            shards["bias"] = ZeroShards(P_x, {1: 0}, seq.bias.shape)
            self.bias = torch.nn.Parameter(shards["bias"].shard(seq.bias))
        else:
            self.bias = None
        self._setup_shards(shards)
        if self.gather_form:
            self.x_gather = AllGather(P_x, 1, 1)
        else:
            self.y_scatter = ReduceScatter(P_x, 1, 1)

    # -- plans ----------------------------------------------------------------------
    def out_size(self, L: tuple[int, ...]) -> tuple[int, ...]:
        """The output's spatial extents for input extents ``L`` (torch's formulas)."""
        if self.transposed:
            return tuple((li - 1) * s - 2 * p + d * (k - 1) + o + 1 for li, s, p, d, k, o in
                         zip(L, self.s, self.padding, self.d, self.k, self.op))
        if self.padding == "same":
            return L
        pads = (0,) * self.spatial if self.padding == "valid" else self.padding
        return tuple((li + 2 * p - d * (k - 1) - 1) // s + 1 for li, s, p, d, k in
                     zip(L, self.s, pads, self.d, self.k))

    def make_plan(self, spec: TensorSpec) -> _ChannelPlan:
        name, n, g = self.name, self.spatial, spec.global_shape
        if not spec.standard or spec.ndim != n + 2:
            raise raised_everywhere(ShapeError(
                f"{name}: expected an (N, C, {'spatial, ' * n}) tensor split the standard way "
                f"over P_x, got {spec.describe()}"))
        if g[1] != self.in_channels:
            raise raised_everywhere(ShapeError(
                f"{name}: the input {spec.describe()} has {g[1]} channels, the layer takes "
                f"{self.in_channels}"))
        m = self.out_size(g[2:])
        if min(m, default=1) < 1:
            raise raised_everywhere(ShapeError(
                f"{name}: the input's spatial extents {g[2:]} give an output of extents {m}: "
                f"the kernel is larger than the (padded) input"))
        if not self.transposed and self.padding_mode in ("reflect", "circular"):
            lim = 0 if self.padding_mode == "reflect" else 1  # torch's F.pad rules
            sides = list(zip(self._pad[::2], self._pad[1::2]))[::-1]  # per spatial dim
            if any(max(pair) > li - 1 + lim for pair, li in zip(sides, g[2:])):
                raise raised_everywhere(ShapeError(
                    f"{name}: padding {self.padding} with padding_mode="
                    f"{self.padding_mode!r} needs larger spatial extents than {g[2:]}"))
        dt, dev = spec.dtype, spec.device_type
        y = (g[0], self.out_channels) + m
        xg = ys = None
        if self.gather_form:
            xg = self.x_gather.plan(spec)
            out = TensorSpec(self.P_x, y, dt, dev)
        else:
            part = TensorSpec(self.P_x, y, dt, dev, (0, PARTIAL) + (REPLICATE,) * n)
            ys = self.y_scatter.plan(part)
            out = ys.out
        z = self.shards
        wp = z["weight"].plan(self.weight.dtype, dev)
        bp = z["bias"].plan(self.bias.dtype, dev) if "bias" in z else None
        return _ChannelPlan(out, xg, ys, wp, bp)

    # -- forward --------------------------------------------------------------------
    def conv(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The sequential layer's convolution on local blocks (groups = 1)."""
        fn = _FN[(self.spatial, self.transposed)]
        if self.transposed:
            return fn(x, w, b, self.s, self.padding, self.op, 1, self.d)
        if self.padding_mode != "zeros":
            x = F.pad(x, self._pad, mode=self.padding_mode)
            return fn(x, w, b, self.s, 0, self.d, 1)
        return fn(x, w, b, self.s, self.padding, self.d, 1)

    def run(self, x: torch.Tensor, plan: _ChannelPlan) -> torch.Tensor:
        w = self.shards["weight"].gather(self.weight, plan.w)
        b = self.shards["bias"].gather(self.bias, plan.b) if self.bias is not None else None
        if self.gather_form:
            return self.conv(self.x_gather.apply_plan(x, plan.x_gather), w, b)
        y = self.y_scatter.apply_plan(self.conv(x, w, None), plan.y_scatter)
        return y if b is None else y + b.view((-1,) + (1,) * self.spatial)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.k}, "
                f"stride={self.s}, padding={self.padding}, dilation={self.d}, "
                f"bias={self.bias is not None}, partition={self.P_x.shape}")


class _Conv(_ChannelConvNd):
    def __init__(self, P_x: Partition, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] | str = 0, dilation: int | Sequence[int] = 1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self._build(P_x, in_channels, out_channels, kernel_size, stride, padding, 0, dilation,
                    groups, bias, padding_mode, dtype, device)


class _ConvTranspose(_ChannelConvNd):
    transposed = True

    def __init__(self, P_x: Partition, in_channels: int, out_channels: int,
                 kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                 groups: int = 1, bias: bool = True, dilation: int | Sequence[int] = 1,
                 padding_mode: str = "zeros", *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self._build(P_x, in_channels, out_channels, kernel_size, stride, padding,
                    output_padding, dilation, groups, bias, padding_mode, dtype, device)


class DistributedChannelAllGatherConv1d(_Conv):
    """``torch.nn.Conv1d``: input channels all-gathered, weight rows local (see module)."""

    spatial = 1


class DistributedChannelAllGatherConv2d(_Conv):
    """``torch.nn.Conv2d``: input channels all-gathered, weight rows local (see module)."""

    spatial = 2


class DistributedChannelAllGatherConv3d(_Conv):
    """``torch.nn.Conv3d``: input channels all-gathered, weight rows local (see module)."""

    spatial = 3


class DistributedChannelReduceScatterConv1d(_Conv):
    """``torch.nn.Conv1d``: partial sums over input-channel blocks reduce-scattered."""

    spatial, gather_form = 1, False


class DistributedChannelReduceScatterConv2d(_Conv):
    """``torch.nn.Conv2d``: partial sums over input-channel blocks reduce-scattered."""

    spatial, gather_form = 2, False


class DistributedChannelReduceScatterConv3d(_Conv):
    """``torch.nn.Conv3d``: partial sums over input-channel blocks reduce-scattered."""

    spatial, gather_form = 3, False


class DistributedChannelAllGatherConvTranspose1d(_ConvTranspose):
    """``torch.nn.ConvTranspose1d``: input channels all-gathered, weight columns local."""

    spatial = 1


class DistributedChannelAllGatherConvTranspose2d(_ConvTranspose):
    """``torch.nn.ConvTranspose2d``: input channels all-gathered, weight columns local."""

    spatial = 2


class DistributedChannelAllGatherConvTranspose3d(_ConvTranspose):
    """``torch.nn.ConvTranspose3d``: input channels all-gathered, weight columns local."""

    spatial = 3


class DistributedChannelReduceScatterConvTranspose1d(_ConvTranspose):
    """``torch.nn.ConvTranspose1d``: partial sums over input-channel blocks
    reduce-scattered."""

    spatial, gather_form = 1, False


class DistributedChannelReduceScatterConvTranspose2d(_ConvTranspose):
    """``torch.nn.ConvTranspose2d``: partial sums over input-channel blocks
    reduce-scattered."""

    spatial, gather_form = 2, False


class DistributedChannelReduceScatterConvTranspose3d(_ConvTranspose):
    """``torch.nn.ConvTranspose3d``: partial sums over input-channel blocks
    reduce-scattered."""

    spatial, gather_form = 3, False
