"""Transport over ``torch.distributed`` (NCCL for CUDA tensors, gloo for CPU tensors).

When the process group cannot take a tensor's device (gloo with CUDA tensors in
point-to-point), the tensor is staged through host memory; NCCL never stages.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import CommTimeout
from .base import P2P, Group, Transport, Work

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _wait(work: dist.Work, what: str):
    def fn(timeout: float) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # gloo raises on timeout / peer loss
            raise CommTimeout(f"{what} failed or timed out after {timeout:.1f}s: {e}") from e
        if ok is False:
            raise CommTimeout(f"{what} did not complete within {timeout:.1f}s")

    return fn


class TorchDistTransport(Transport):
    """``torch.distributed`` process group as a transport."""

    def __init__(self, timeout: float) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call gpudist.init()")
        self.rank, self.size, self.timeout = dist.get_rank(), dist.get_world_size(), timeout
        self.backend = dist.get_backend()
        self.name = f"torch.distributed/{self.backend}"
        self._groups: dict[tuple[int, ...], Group] = {}

    # -- helpers ------------------------------------------------------------
    def _native(self, t: torch.Tensor) -> bool:
        if self.backend == "nccl":
            return t.is_cuda
        return not t.is_cuda

    def _stage(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        if self._native(t):
            return t, None
        return t.detach().to("cuda" if self.backend == "nccl" else "cpu"), t

    def _work(self, w: dist.Work | None, what: str, staged, orig, copy_back: bool) -> Work:
        after = None
        if orig is not None and copy_back:
            def after() -> None:
                orig.copy_(staged)
        if w is None:
            if after is not None:
                after()
            return Work(lambda _t: None, what)
        return Work(_wait(w, what), what, after)

    # -- interface ----------------------------------------------------------
    def group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted({int(r) for r in ranks}))
        g = self._groups.get(key)
        if g is None:
            if key == tuple(range(self.size)):
                handle = dist.group.WORLD
            else:  # world-collective: every rank calls this, in the same order
                handle = dist.new_group(list(key), timeout=datetime.timedelta(seconds=self.timeout))
                if self.rank not in key:
                    handle = None
            g = Group(key, handle)
            self._groups[key] = g
        return g

    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        if not ops:
            return []
        dops, meta = [], []
        for o in ops:
            staged, orig = self._stage(o.tensor)
            fn = dist.isend if o.op == "send" else dist.irecv
            dops.append(dist.P2POp(fn, staged, o.peer, tag=o.tag))
            meta.append((o, staged, orig))
        works = dist.batch_isend_irecv(dops)
        return [
            self._work(w, f"{o.op} {tuple(o.tensor.shape)} with rank {o.peer}", s, orig,
                       o.op == "recv")
            for w, (o, s, orig) in zip(works, meta)
        ]

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Work:
        s, orig = self._stage(tensor)
        w = dist.broadcast(s, src, group=group.handle, async_op=True)
        return self._work(w, f"broadcast from {src} over {group.ranks}", s, orig, True)

    def reduce(self, tensor: torch.Tensor, dst: int, group: Group) -> Work:
        s, orig = self._stage(tensor)
        w = dist.reduce(s, dst, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
        return self._work(w, f"reduce to {dst} over {group.ranks}", s, orig, True)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> Work:
        s, orig = self._stage(tensor)
        w = dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
        return self._work(w, f"all-reduce over {group.ranks}", s, orig, True)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work:
        so, oo = self._stage(out)
        si, _ = self._stage(tensor)
        w = _all_gather_single(so, si, group=group.handle, async_op=True)
        return self._work(w, f"all-gather over {group.ranks}", so, oo, True)

    def all_to_all(self, out, inp, out_splits, in_splits, group: Group) -> Work:
        so, oo = self._stage(out)
        si, _ = self._stage(inp)
        w = dist.all_to_all_single(
            so, si, list(out_splits), list(in_splits), group=group.handle, async_op=True
        )
        return self._work(w, f"all-to-all over {group.ranks}", so, oo, True)

    def barrier(self, group: Group | None = None) -> None:
        handle = None if group is None else group.handle
        if self.backend == "nccl":
            t = torch.zeros(1, device="cuda")
            self.all_reduce(t, group or self.group(range(self.size))).wait(self.timeout)
            return
        try:
            dist.monitored_barrier(group=handle, timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise CommTimeout(f"barrier timed out after {self.timeout:.1f}s: {e}") from e

    def finalize(self) -> None:
        self._groups.clear()
