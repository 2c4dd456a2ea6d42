"""LeNet-5, sequential (plain torch) and distributed (gpudist layers), same parameters.

The network (28x28 inputs, C1 padded by 2 so it sees 32x32 as in LeCun et al.):

    C1 conv 1->6 5x5 pad 2, ReLU, S2 max-pool 2 | C3 conv 6->16 5x5, ReLU, S4 max-pool 2
    C5 affine 400->120, ReLU | F6 affine 120->84, ReLU | Output affine 84->10

Distributed over 4 workers (the paper's layout): the input is scattered from worker 0 over a
2x2 spatial partition of NCHW; C1..S4 run there with the convolution weights held by worker
0 only. A repartition moves the 16x5x5 features to a split over channels on workers 0 and 1,
where flattening gives each worker one contiguous half of the 400 features: exactly the
input blocks of the affine layers, whose weights are split 2x2 (blocks 60x200, 42x60 and
5x42, biases on the first column of the weight partition: workers 0 and 2). The 10 logits are
gathered to worker 0, which computes the loss. Other rank counts use the same scheme on
other grids (see :data:`LAYOUTS`). Between layers the activations travel as
:class:`~gpudist.DistTensor` values: no rank asks another for a shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..common import UsageError

# ranks -> (spatial grid (P_h, P_w) of C1..S4, affine weight grid (P_fo, P_fi))
LAYOUTS: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {
    1: ((1, 1), (1, 1)),
    2: ((1, 2), (1, 2)),
    4: ((2, 2), (2, 2)),
    8: ((2, 4), (2, 4)),
    16: ((4, 4), (4, 4)),
}
PARAM_LAYERS = ("c1", "c3", "c5", "f6", "out")


def supported_ranks() -> str:
    counts = sorted(LAYOUTS)
    return ", ".join(str(c) for c in counts[:-1]) + f" or {counts[-1]}"


def layout_for(ranks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (spatial grid, affine weight grid) for ``ranks`` workers, or a UsageError."""
    if ranks not in LAYOUTS:
        raise UsageError(
            f"the LeNet-5 example cannot run on {ranks} rank(s): it works with "
            f"{supported_ranks()} ranks (4 is the paper's 2x2 layout)"
        )
    return LAYOUTS[ranks]


class LeNet5(nn.Module):
    """The sequential network, from plain torch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 5, padding=2)
        self.s2 = nn.MaxPool2d(2)
        self.c3 = nn.Conv2d(6, 16, 5)
        self.s4 = nn.MaxPool2d(2)
        self.c5 = nn.Linear(16 * 5 * 5, 120)
        self.f6 = nn.Linear(120, 84)
        self.out = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.s2(F.relu(self.c1(x)))
        x = self.s4(F.relu(self.c3(x)))
        x = x.flatten(1)
        x = F.relu(self.c5(x))
        x = F.relu(self.f6(x))
        return self.out(x)


def make_sequential(seed: int, dtype: torch.dtype = torch.float64,
                    device: torch.device | str = "cpu") -> LeNet5:
    """LeNet-5 with torch's default initialization drawn from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return LeNet5().to(dtype=dtype, device=device)


class DistributedLeNet5(nn.Module):
    """LeNet-5 from gpudist layers over ``ranks`` workers (collective construction).

    ``forward(x, batch)`` takes the whole batch (N, 1, 28, 28) on world rank 0 and a
    zero-volume tensor elsewhere (every rank passes the batch size ``N``, so the input's
    spec is known without asking rank 0); it returns the (N, 10) logits on rank 0 and
    zero-volume elsewhere.
    """

    def __init__(self, ranks: int | None = None) -> None:
        super().__init__()
        import gpudist
        from gpudist import Partition
        from gpudist.nn import DistributedConv2d, DistributedLinear, DistributedMaxPool2d
        from gpudist.primitives import Repartition

        w = gpudist.world()
        ranks = w.size if ranks is None else ranks
        if ranks != w.size:
            raise UsageError(f"DistributedLeNet5 for {ranks} ranks in a world of {w.size}")
        (ph, pw), (pfo, pfi) = layout_for(ranks)
        self.layout = ((ph, pw), (pfo, pfi))
        # every rank builds the same partitions in the same order
        self.P_root4 = Partition.root(4, 0)
        self.P_conv = Partition.grid((1, 1, ph, pw))
        self.P_flat = Partition(list(range(pfi)), (1, pfi, 1, 1))  # channel split
        self.P_in = Partition(list(range(pfi)), (1, pfi))  # affine input features
        self.P_w = Partition.grid((pfo, pfi))  # affine weight blocks
        self.P_out = Partition(list(range(pfo)), (1, pfo))  # affine output features
        self.P_root2 = Partition.root(2, 0)

        self.scatter = Repartition(self.P_root4, self.P_conv)
        self.c1 = DistributedConv2d(self.P_conv, 1, 6, 5, padding=2)
        self.s2 = DistributedMaxPool2d(self.P_conv, 2)
        self.c3 = DistributedConv2d(self.P_conv, 6, 16, 5)
        self.s4 = DistributedMaxPool2d(self.P_conv, 2)
        # 16 channels over P_fi workers: each gets 16/P_fi whole 5x5 maps, i.e. the
        # contiguous block of 400/P_fi flattened features that P_in assigns it
        self.to_features = Repartition(self.P_conv, self.P_flat)
        self.c5 = DistributedLinear(self.P_in, self.P_out, self.P_w, 400, 120)
        self.t5 = Repartition(self.P_out, self.P_in)  # identity when P_fo == P_fi
        self.f6 = DistributedLinear(self.P_in, self.P_out, self.P_w, 120, 84)
        self.t6 = Repartition(self.P_out, self.P_in)
        self.out = DistributedLinear(self.P_in, self.P_out, self.P_w, 84, 10)
        self.gather = Repartition(self.P_out, self.P_root2)

    def forward(self, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        from gpudist import DistTensor

        if batch is not None:  # the spec every rank knows: no metadata exchange
            x = DistTensor.from_local(x, self.P_root4, (batch, 1, 28, 28))
        x = self.scatter(x)
        x = self.s2(F.relu(self.c1(x)))
        x = self.s4(F.relu(self.c3(x)))
        x = self.to_features(x).flatten(1)
        x = self.t5(F.relu(self.c5(x)))
        x = self.t6(F.relu(self.f6(x)))
        y = self.gather(self.out(x))
        return y.local if isinstance(y, DistTensor) else y

    def load_from(self, seq: LeNet5) -> None:
        """Take the sequential network's parameters (every rank passes the same ones)."""
        for name in PARAM_LAYERS:
            getattr(self, name).load_global_state_dict(getattr(seq, name).state_dict())

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full parameters (sequential names) on rank 0, {} elsewhere."""
        out: dict[str, torch.Tensor] = {}
        for name in PARAM_LAYERS:
            for k, v in getattr(self, name).global_state_dict().items():
                out[f"{name}.{k}"] = v
        return out


def make_distributed(seq: LeNet5, dtype: torch.dtype, device: torch.device | str
                     ) -> DistributedLeNet5:
    net = DistributedLeNet5().to(dtype=dtype, device=device)
    net.load_from(seq)
    return net.to(dtype=dtype, device=device)
