"""The transport interface: the only thing a backend implements.

Primitives are written once against :class:`Transport`; a backend only moves bytes.
All ranks are *world* ranks. A :class:`Group` is a set of world ranks with a backend
communicator; ``Transport.group(ranks)`` is collective over the whole world (like
``torch.distributed.new_group``) and cached, so every rank constructs the same partitions
and primitives in the same order, and the groups they need are created once.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import CommTimeout

DEFAULT_TIMEOUT_S = 120.0


@dataclass(eq=False)
class Group:
    """A set of world ranks (ascending) plus the backend's handle for it."""

    ranks: tuple[int, ...]
    handle: object = field(repr=False, default=None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, world_rank: int) -> int:
        return self.ranks.index(world_rank)


class Work:
    """A pending operation. ``wait`` raises :class:`CommTimeout` past the deadline."""

    def __init__(
        self,
        wait_fn: Callable[[float], None],
        what: str,
        after: Callable[[], None] | None = None,
    ) -> None:
        self._wait_fn, self._what, self._after, self._done = wait_fn, what, after, False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        self._wait_fn(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        self._done = True
        if self._after is not None:
            self._after()

    @property
    def what(self) -> str:
        return self._what


def completed() -> Work:
    return Work(lambda _t: None, "no-op")


def wait_all(works: Sequence[Work], timeout: float | None = None) -> None:
    """Wait for every work item; one shared deadline."""
    total = DEFAULT_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + total
    for w in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"{w.what} did not complete within {total:.1f}s")
        w.wait(left)


@dataclass(frozen=True)
class P2P:
    """One half of a point-to-point transfer: ``op`` is "send" or "recv"."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class Transport(ABC):
    """Moves tensors between world ranks. Tensors handed in must be contiguous."""

    name: str = "abstract"
    rank: int
    size: int
    timeout: float = DEFAULT_TIMEOUT_S

    # -- groups -------------------------------------------------------------
    @abstractmethod
    def group(self, ranks: Sequence[int]) -> Group:
        """The cached group of the rank *set* ``ranks``, members in ascending order.

        Collective over the WORLD: every rank calls it with the same ranks in the same
        order (non-members get a Group whose ``handle`` is None). Member order (all-gather,
        all-to-all slots) is ascending world rank whatever order ``ranks`` was given in.
        """

    # -- point to point -----------------------------------------------------
    @abstractmethod
    def batch_p2p(self, ops: Sequence[P2P]) -> list[Work]:
        """Start all sends/receives at once (order-independent, deadlock-free)."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        wait_all(self.batch_p2p([P2P("send", tensor, dst, tag)]), self.timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        wait_all(self.batch_p2p([P2P("recv", tensor, src, tag)]), self.timeout)

    # -- collectives over a group (all start asynchronously) ----------------
    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group) -> Work:
        """Copy ``tensor`` from world rank ``src`` to every member, in place."""

    @abstractmethod
    def reduce(self, tensor: torch.Tensor, dst: int, group: Group) -> Work:
        """Sum members' ``tensor`` into world rank ``dst``'s, in place (others undefined)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> Work:
        """Sum members' ``tensor`` in place on every member."""

    @abstractmethod
    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work:
        """Equal-sized ``tensor`` from each member into ``out`` (size * numel), group order."""

    @abstractmethod
    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
    ) -> Work:
        """Uneven all-to-all of flat buffers: ``inp[in_splits[j]]`` goes to member ``j``."""

    @abstractmethod
    def barrier(self, group: Group | None = None) -> None:
        """Block until every member arrives (raises :class:`CommTimeout`)."""

    def finalize(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""
