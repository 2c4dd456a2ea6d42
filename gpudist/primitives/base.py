"""What every primitive shares: the autograd bridge, metadata exchange, zero-volume tensors.

A primitive is a small object with ``forward(x) -> (y, state)`` and
``adjoint(dy, state) -> dx``; :func:`apply` wraps the pair in one autograd Function, so the
backward pass of a network runs the hand-written adjoint of every data movement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import DeviceError, ShapeError
from ..runtime import World
from ..transport.base import Group

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128,
    torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
MAX_DIM = 8


def zero_volume(
    ndim: int = 1, *, like: torch.Tensor | None = None, batch: int | None = None,
    requires_grad: bool = False,
) -> torch.Tensor:
    """A tensor with a 0 in its shape: what an inactive worker holds.

    ``batch`` keeps the leading dimension (shape ``(batch, 0, ...)``).
    """
    shape = [0] * max(ndim, 1)
    if batch is not None:
        shape[0] = batch
        if len(shape) > 1:
            shape[1] = 0
        else:
            shape[0] = 0
    dtype = like.dtype if like is not None else torch.get_default_dtype()
    device = like.device if like is not None else None
    return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def is_zero_volume(x: torch.Tensor) -> bool:
    return x.numel() == 0


def meta_device(world: World, x: torch.Tensor) -> torch.device:
    return x.device if world.backend == "nccl" else torch.device("cpu")


def encode_meta(x: torch.Tensor, active: bool) -> list[int]:
    """[active, dtype code, device type (0 cpu, 1 cuda), ndim, shape... padded to MAX_DIM]."""
    if x.dim() > MAX_DIM:
        raise DeviceError(f"tensors of more than {MAX_DIM} dimensions are not supported")
    code = DTYPES.index(x.dtype) if x.dtype in DTYPES else -1
    shape = list(x.shape) + [0] * (MAX_DIM - x.dim())
    return [int(active), code, int(x.is_cuda), x.dim(), *shape]


def decode_meta(v: Sequence[int]) -> tuple[bool, torch.dtype | None, str, tuple[int, ...]]:
    active, code, dev, nd = v[0], v[1], v[2], v[3]
    return bool(active), (DTYPES[code] if code >= 0 else None), ("cuda" if dev else "cpu"), \
        tuple(int(s) for s in v[4:4 + nd])


FAILED = -1  # 'active' flag of a member that rejected its input (see signal_failure)


def gather_meta(world: World, group: Group | None, x: torch.Tensor, active: bool | int,
                what: str = "primitive") -> list:
    """Every member's decoded metadata, in ascending world-rank order (collective).

    If some member called :func:`signal_failure` instead, every other member raises
    :class:`ShapeError` naming it (so a bad input is an error on every rank, not a hang).
    """
    mine = torch.tensor(encode_meta(x, int(active)), dtype=torch.int64)
    if group is None or group.size == 1:
        return [decode_meta(mine.tolist())]
    dev = meta_device(world, x)
    out = torch.empty(group.size * mine.numel(), dtype=torch.int64, device=dev)
    world.transport.all_gather(out, mine.to(dev), group).wait(world.timeout)
    rows = out.cpu().view(group.size, -1).tolist()
    failed = [r for r, row in zip(group.ranks, rows) if row[0] == FAILED]
    if failed and active != FAILED:
        raise ShapeError(f"{what}: rank(s) {failed} rejected their input (their error says "
                         f"why); this rank stops too")
    return [decode_meta(r) for r in rows]


def signal_failure(world: World, group: Group | None, like: torch.Tensor) -> None:
    """Take part in a metadata exchange as a member whose input was rejected: the others
    raise instead of waiting for data (the caller then raises its own error)."""
    gather_meta(world, group, like, FAILED)


def check_same_kind(metas: list, ranks: Sequence[int], what: str) -> tuple[torch.dtype, str]:
    """All members (zero-volume ones too) agree on dtype and device type, else DeviceError
    (raised on every rank, since every rank sees every member's metadata)."""
    kinds = {(m[1], m[2]) for m in metas}
    if len(kinds) > 1:
        detail = ", ".join(f"rank {r}: {m[1]} on {m[2]}" for r, m in zip(ranks, metas))
        raise DeviceError(f"{what}: inputs disagree in dtype or device ({detail})")
    return kinds.pop() if kinds else (torch.get_default_dtype(), "cpu")


class Primitive:
    """A linear data movement F with its adjoint F*."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def adjoint(self, dy: torch.Tensor, state: object) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply(self, x)


class _LinearOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: Primitive, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y, state = op.forward(x.detach())
        ctx.op, ctx.state = op, state
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        return None, ctx.op.adjoint(dy.contiguous(), ctx.state)


def apply(op: Primitive, x: torch.Tensor) -> torch.Tensor:
    """Run ``op`` on ``x`` so that autograd's backward applies ``op``'s adjoint."""
    if x.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool) \
            and x.requires_grad:
        raise DeviceError(f"integer tensor of dtype {x.dtype} cannot require grad")
    return _LinearOp.apply(op, x)


class PrimitiveModule(torch.nn.Module):
    """``nn.Module`` face of a primitive (like torch.nn over torch.nn.functional)."""

    op: Primitive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply(self.op, x)
