"""Exceptions raised by gpudist. Each names the problem.

Two kinds of failure, told apart by :func:`raised_everywhere`:

* errors every participant raises identically, because every participant checks the same
  shared facts (a constructor's arguments, a global shape, the fingerprints every rank
  sees after a metadata exchange): the world stays usable;
* everything else (a local block that does not match its spec, a local torch op failing, a
  lost peer): the raising rank posts the error to the world's control plane
  (:mod:`gpudist.control`) and every other rank raises :class:`RemoteError` naming it at
  its next wait. The world is then aborted: later gpudist calls raise at once.
"""

from __future__ import annotations


class GpudistError(RuntimeError):
    """Base class of every gpudist error."""


class PartitionError(GpudistError, ValueError):
    """A partition does not fit the world, the tensor, or another partition."""


class ShapeError(GpudistError, ValueError):
    """A tensor's shape does not match the decomposition an operator expects."""


class HaloError(GpudistError, ValueError):
    """A kernel/partition configuration the halo exchange cannot serve."""


class DeviceError(GpudistError, ValueError):
    """Devices or dtypes disagree between tensors, ranks or the backend."""


class CommTimeout(GpudistError, TimeoutError):
    """A communication did not complete within the timeout (a peer is missing or stuck)."""


class LaunchError(GpudistError):
    """The launch environment is inconsistent or incomplete."""


class MismatchError(GpudistError):
    """Ranks disagree about a collective: a different operator, partition, global shape or
    dtype at the same point of the program (the message says what differs, on which ranks)."""


class RemoteError(GpudistError):
    """Another rank failed; ``rank``, ``kind`` and ``message`` are its error."""

    def __init__(self, rank: int, kind: str, message: str, where: str = "") -> None:
        self.rank, self.kind, self.message = rank, kind, message
        at = f" (this rank was in {where})" if where else ""
        super().__init__(f"rank {rank} failed with {kind}: {message}{at}")


class WorldAborted(GpudistError):
    """The world was aborted by an earlier failure; no further communication is possible."""


class WorldFinalized(WorldAborted):
    """``gpudist.finalize()`` was called: the world's objects cannot communicate any more."""


def raised_everywhere(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised identically by every participant (the world stays usable)."""
    exc.gpudist_everywhere = True  # type: ignore[attr-defined]
    return exc


def is_everywhere(exc: BaseException) -> bool:
    return bool(getattr(exc, "gpudist_everywhere", False)) or isinstance(
        exc, (RemoteError, WorldAborted))


#: errors that say the code itself went wrong, not the input: a plan is made from the spec
#: alone, but a bug may still hit some ranks only (an inactive one, say), so these are
#: left as this rank's own and posted to the world (peers raise instead of hanging)
_BUGS = (AttributeError, TypeError, KeyError, IndexError, NameError, AssertionError,
         ZeroDivisionError)


def planning_error(exc: BaseException) -> BaseException:
    """Mark an error raised while planning from a spec (shared by every rank, so every
    rank raises it) -- unless it is a communication failure or a bug, this rank's own."""
    if not isinstance(exc, (CommTimeout, RemoteError, WorldAborted, KeyboardInterrupt,
                            *_BUGS)):
        raised_everywhere(exc)
    return exc


def not_picklable(what: str) -> TypeError:
    """The error of pickling (``torch.save(model)``) a layer, primitive or partition."""
    return TypeError(
        f"{what}: a gpudist layer, primitive or partition cannot be pickled (e.g. by "
        f"torch.save(model)): it holds the world's communicators. Save the state instead: "
        f"torch.save(model.state_dict(), path) per rank (it loads into the same layout), or "
        f"a layer's global_state_dict() on its root (it loads into any layout)")


def not_copyable(what: str) -> TypeError:
    """The error of ``copy.deepcopy`` on a layer or primitive (it holds communicators)."""
    return TypeError(
        f"{what}: copy.deepcopy of a gpudist layer or primitive is not supported (it holds "
        f"the world's communicators and plans). Build another one (equal seeds give equal "
        f"parameters) and load the state into it: copy.load_state_dict(layer.state_dict())")
