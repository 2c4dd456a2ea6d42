"""Metadata exchanges: the only place shapes and fingerprints cross ranks.

Both exchanges send one fixed-size int64 row per rank over the group's *meta*
communicator, so any two of them match whatever the ranks were doing, and every rank sees
every row and raises the same error:

* :func:`derive_spec` -- the global shape of a tensor from its blocks' local shapes (what
  a plain local tensor needs at every call; a :class:`~gpudist.spec.DistTensor` never);
* :func:`verify` -- run at a rank's first call of an operator or layer and whenever the
  spec it passes, or what the call records for backward, differs from its previous call's:
  the operator, its configuration, the tensor's spec, whether each rank's block matches it
  and what it records for the adjoint, compared across the participants. Programs that
  disagree (another layer, another dtype, a lying shape hint, requires_grad) fail here with
  a message that says what differs on which ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import DeviceError, MismatchError, ShapeError, raised_everywhere
from .partition import Partition
from .spec import TensorSpec, dtype_code, dtype_of, stable_hash
from .transport.base import Group

MAX_DIM = 8
MAGIC = 0x6D657461
_NAME_WORDS = 3
ROW = 1 + _NAME_WORDS + 6 + 2 * MAX_DIM
OK, BAD_BLOCK, ABSENT = 1, 0, 2
# a verify row's status: block state (bits 0-2) | 1 + what the call records for backward
# (bits 3-5; 0: not said)
_STATUS_MASK, _GRAD_SHIFT = 0x7, 3
PARAM_GRAD_BITS = 40  # parameters whose requires_grad a check tells apart (then one bit)
# a grad state's bit: the call runs inside torch.utils.checkpoint(use_reentrant=False)
# (gpudist.checkpoint); ranks must agree on it as on the rest
CHECKPOINT_BIT = 1 << (PARAM_GRAD_BITS + 2)
META_FP = 0x4D455441
_DEVICES = ("cpu", "cuda")


def _pack_name(name: str) -> list[int]:
    b = name.encode("ascii", "replace")[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b" ")
    return [int.from_bytes(b[8 * i:8 * i + 8], "little", signed=True)
            for i in range(_NAME_WORDS)]


def _unpack_name(words: Sequence[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).decode(
        "ascii", "replace").rstrip()


class Row:
    """One rank's metadata row."""

    def __init__(self, v: Sequence[int]) -> None:
        self.v = [int(x) for x in v]

    @classmethod
    def make(cls, name: str, status: int, config: int, dtype: torch.dtype | None,
             device: str, local: Sequence[int] | None, glob: Sequence[int] | None,
             spec_hash: int = 0) -> Row:
        nd = len(local if local is not None else glob or ())
        if nd > MAX_DIM:
            raise raised_everywhere(ShapeError(
                f"tensors of more than {MAX_DIM} dimensions are not supported"))
        loc = list(local or []) + [-1] * (MAX_DIM - len(local or []))
        gl = list(glob or []) + [-1] * (MAX_DIM - len(glob or []))
        dev = _DEVICES.index(device) if device in _DEVICES else len(_DEVICES)
        code = dtype_code(dtype) if dtype is not None else -1
        return cls([MAGIC, *_pack_name(name), status, config, code, dev, nd, spec_hash,
                    *loc, *gl])

    name = property(lambda self: _unpack_name(self.v[1:1 + _NAME_WORDS]))
    status = property(lambda self: self.v[4])
    config = property(lambda self: self.v[5])
    dtype = property(lambda self: dtype_of(self.v[6]))
    device = property(lambda self: _DEVICES[self.v[7]] if self.v[7] < len(_DEVICES) else "?")
    ndim = property(lambda self: self.v[8])
    spec_hash = property(lambda self: self.v[9])

    @property
    def local(self) -> tuple[int, ...]:
        return tuple(self.v[10:10 + self.ndim])

    @property
    def glob(self) -> tuple[int, ...]:
        return tuple(self.v[10 + MAX_DIM:10 + MAX_DIM + self.ndim])

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        g = f" global {self.glob}" if any(x >= 0 for x in self.glob) else ""
        return f"{self.name} [config {self.config:#x}]{g} {dt} on {self.device}"


def exchange(group: Group | None, row: Row, what: str, world=None) -> list[Row]:
    """Every member's row, in ascending world-rank order (collective over ``group``;
    ``world``: the current one)."""
    if group is None or group.size == 1:
        return [row]
    from .runtime import require_world

    w = require_world(world)
    out = torch.empty(group.size * (ROW + 1), dtype=torch.int64)
    with w.control.op(group.ranks, f"metadata exchange of {what}", META_FP) as op:
        # the row carries the exchange's operator number on the group: every member
        # counts the same calls, so numbers that differ mean programs that diverged
        mine = torch.tensor(row.v + [op.seq], dtype=torch.int64)
        w.transport.wait([w.transport.meta_all_gather(out, mine, group)],
                         f"metadata exchange of {what} over {list(group.ranks)}")
    table = out.view(group.size, ROW + 1).tolist()
    rows = [Row(r[:ROW]) for r in table]
    bad = [r for r, x in zip(group.ranks, rows) if x.v[0] != MAGIC]
    if bad:
        raise raised_everywhere(MismatchError(
            f"{what}: ranks {bad} sent something else than a metadata row"))
    seqs = [r[ROW] for r in table]
    if len(set(seqs)) > 1:
        at = ", ".join(f"rank {r}: #{n}" for r, n in zip(group.ranks, seqs))
        _diverged(MismatchError(
            f"{what}: the ranks reached this check at different points of the group "
            f"{list(group.ranks)}'s program (as its operator {at}): some ranks ran "
            f"operators the others did not, e.g. a call whose dtype, shape or "
            f"requires_grad changed on some ranks only, checked by those ranks alone while "
            f"their peers' repeated calls went on; the programs have diverged, so the "
            f"world ends"), what, world)
    return rows


def config_of(options: object, instance: int) -> int:
    """An operator's config for the checks across ranks: the hash of its options (high
    bits) beside the hash of options and instance number together (low bits). Equal on
    every rank for the same operator; where only the low bits differ, the ranks run two
    operators alike but for their instance: built or called in another order."""
    return (stable_hash(options) << 31) | stable_hash((options, instance))


def same_program(rows: list[Row], ranks: Sequence[int], what: str, world=None) -> None:
    """Raise a MismatchError (posted to the world) unless every row names the same
    operator and configuration."""
    kinds = {(x.name, x.config) for x in rows}
    if len(kinds) > 1:
        detail = "; ".join(f"rank {r}: {x.describe()}" for r, x in zip(ranks, rows))
        if len({x.name for x in rows}) > 1:
            why = ("the program differs between ranks (a layer or partition created, skipped "
                   "or called on some ranks only)")
        elif len({x.config >> 31 for x in rows}) == 1 and rows[0].config >> 31:
            why = (f"every rank runs a {rows[0].name} with the same options, but not the same "
                   f"one: two such operators built or called in another order on some "
                   f"ranks (an operator is told by its number among those built over its "
                   f"ranks), or one of them skipped or added there")
        else:
            why = (f"every rank runs {rows[0].name}, with other options on some ranks (the "
                   f"config hash covers its options, e.g. kernel size, stride, mode, eps, "
                   f"momentum, reduction, a batch norm's train or eval mode, and its "
                   f"parameters' dtypes: a layer built with other options, its options or "
                   f"mode changed after a call, or two such layers called in another order)")
        err = MismatchError(
            f"{what}: ranks run different operators at the same point of the program "
            f"({detail}): {why}; the programs have diverged, so the world ends")
        _diverged(err, what, world)


def _diverged(err: MismatchError, what: str, world=None) -> None:
    """Post ``err`` to the world and raise it: the programs diverged, no way on."""
    from .runtime import require_world

    require_world(world).control.abort(err, what)
    raise err


def barrier(group: Group | None, what: str, world=None, config: int = 0) -> None:
    """A checked barrier: a metadata exchange of a row naming ``what`` (and ``config``,
    e.g. a layer's), so a rank that meets another operator's exchange (or wait), or one
    of another config, raises a MismatchError on every rank (a raw barrier's shorter row
    against a metadata row crashed gloo)."""
    rows = exchange(group, Row.make(what[-8 * _NAME_WORDS:], OK, config, None, "cpu", None,
                                    None), what, world)  # (a long name's end tells it)
    same_program(rows, group.ranks if group is not None else (), what, world)


def check_call(group: Group | None, what: str, fingerprint: int, seq: int,
               history: int = 0) -> None:
    """The call check (every call with ``GPUDIST_CHECK_CALLS=1``, else every
    ``World.check_every``-th operator of a group): before a data exchange, compare the
    operator each member is about to run (``what`` and the ``fingerprint`` of its plan and
    direction), how many operators each has run on the group (``seq``) and the hash of
    those operators in order (``history``, :meth:`Control.history`). Catches what the
    per-change checks cannot: two operators whose counts agree run in swapped order by
    some ranks, an adjoint meeting a forward (a skipped or an extra backward), an operator
    skipped or added since the last check (not a whole step skipped among alike steps:
    the sequence stays alike). One small all-gather per check."""
    if group is None or group.size == 1:
        return
    rows = exchange(group, Row.make(what, OK, fingerprint, None, "cpu", [history], None,
                                    spec_hash=seq), f"call check of {what}")
    if len({(x.name, x.config, x.spec_hash, x.local) for x in rows}) > 1:
        detail = "; ".join(f"rank {r}: {x.name} [plan {x.config & 0xFFFFFFFF:#x}] after "
                           f"{x.spec_hash} operators [history {x.local[0] & 0xFFFFFFFF:#x}]"
                           for r, x in zip(group.ranks, rows))
        err = MismatchError(
            f"call check over ranks {list(group.ranks)}: the ranks are about to run "
            f"different operators, or ran different ones on the group before ({detail}): "
            f"the program differs between ranks (operators called in another order, a "
            f"backward skipped or run once more, or an operator run on some ranks only)")
        _diverged(err, what)


def derive_spec(P: Partition, local: torch.Tensor, what: str, group: Group | None = None,
                placements: Sequence[int] | Callable[[int], Sequence[int]] | None = None,
                instance: int | None = None) -> TensorSpec:
    """The spec of the tensor whose block on this rank is ``local`` (collective over
    ``group``, default ``P``'s members; members of ``group`` outside ``P`` pass anything).

    ``placements`` as in :class:`~gpudist.spec.TensorSpec` (default: tensor dim ``i``
    split along partition dim ``i``), or a function of the blocks' rank giving them (decided
    after the exchange, so every rank decides alike). Raises the same error on every rank
    if the blocks do not tile a tensor so placed, or disagree in dtype or device.
    ``instance``: the calling operator's config (:func:`config_of`), compared too: two
    operators alike called in another order on some ranks are a MismatchError here.
    """
    g = group if group is not None else P.group
    ranks = g.ranks if g is not None else (P.world.rank,)
    here = P.active
    if g is None and not here:  # outside P with nobody to ask: this rank's error alone
        with P.world.control.scope(what):  # posted: P's ranks raise at their next wait
            raise ShapeError(
                f"{what}: rank {P.world.rank} is not in partition {P.shape} of ranks "
                f"{list(P.ranks)}: it holds no block, and the blocks' shapes are exchanged "
                f"among the partition's ranks only. Pass global_shape, or call this on the "
                f"partition's ranks only")
    config = stable_hash(P.key) if instance is None else \
        config_of((P.key, instance >> 31), instance)
    row = Row.make(f"shape:{what}", OK if here else ABSENT, config,
                   local.dtype, local.device.type, tuple(local.shape) if here else None, None)
    rows = exchange(g, row, what)
    same_program(rows, ranks, what)
    members = [(r, x) for r, x in zip(ranks, rows) if x.status != ABSENT]
    kinds = {(x.dtype, x.device) for x in rows}  # zero-volume blocks of non-members too
    if len(kinds) > 1:
        detail = ", ".join(f"rank {r}: {str(x.dtype).replace('torch.', '')} on {x.device}"
                           for r, x in zip(ranks, rows))
        raise raised_everywhere(DeviceError(f"{what}: blocks disagree in dtype or device "
                                            f"({detail})"))
    dims = {x.ndim for _, x in members}
    nd = next(iter(dims)) if len(dims) == 1 else local.dim()
    if callable(placements):
        placements = placements(nd)
    if len(dims) > 1 or (placements is None and dims != {P.dim}):
        have = f"{nd}" if len(dims) == 1 else f"{sorted(dims)}"
        raise raised_everywhere(ShapeError(
            f"{what}: blocks have {have} dimensions but the partition has {P.dim} (partition "
            f"{P.shape}; pass a DistTensor to say how a tensor of another rank is placed)"))
    pl = tuple(range(P.dim)) if placements is None else tuple(placements)
    shapes = {P.coords_of(P.ranks.index(r)): x.local for r, x in members}
    origin = (0,) * P.dim
    glob = []
    for d in range(nd):
        axis = next((i for i, p in enumerate(pl) if p == d), None)
        if axis is None:
            glob.append(shapes[origin][d])
        else:
            glob.append(sum(shapes[tuple(c if b == axis else 0 for b in range(P.dim))][d]
                            for c in range(P.shape[axis])))
    dtype, dev = kinds.pop() if kinds else (local.dtype, local.device.type)
    spec = TensorSpec(P, tuple(glob), dtype, dev, pl)
    for c, s in sorted(shapes.items()):
        if spec.local_shape_of(c) != s:
            raise raised_everywhere(ShapeError(
                f"{what}: the blocks over partition {P.shape} are not a block decomposition of "
                f"a tensor: {_misfit(spec, shapes, c, pl)}"))
    return spec


def _misfit(spec: TensorSpec, shapes: dict, c: tuple[int, ...], pl: tuple) -> str:
    """Where the block at coords ``c`` leaves the decomposition of ``spec``: the sizes
    the ranks hold along the first dimension it differs in (every rank's on that line of
    the partition, so the odd one can be seen)."""
    P, want = spec.partition, spec.local_shape_of(c)
    d = next(i for i, (a, b) in enumerate(zip(shapes[c], want)) if a != b)
    axis = next((i for i, p in enumerate(pl) if p == d), None)
    here = f"rank {P.world_rank_of(c)} holds a block of shape {shapes[c]} at coords {c}"
    if axis is None or P.shape[axis] == 1:  # not split: every block has the whole size
        o = (0,) * P.dim
        return (f"{here}, rank {P.world_rank_of(o)} one of shape {shapes[o]}; dimension {d} "
                f"is not split, so every block has its whole size")
    line = [tuple(j if b == axis else x for b, x in enumerate(c)) for j in range(P.shape[axis])]
    held = [shapes[q][d] if q in shapes else None for q in line]
    split = [spec.local_shape_of(q)[d] for q in line]
    return (f"{here}; along dimension {d} (split over partition dim {axis}) ranks "
            f"{[P.world_rank_of(q) for q in line]} hold sizes {held}, but a tensor of size "
            f"{spec.global_shape[d]} is split as {split} (a block too long or short on one "
            f"rank, or blocks cut another way: pass a DistTensor or global_shape)")


def _records(grad: int, names: Sequence[str] = ()) -> str:
    """What a call records for backward, from its grad state (see :func:`verify`;
    ``names``: the parameters')."""
    parts = ["the input requires grad"] if grad & 1 else []
    params = [i for i in range(PARAM_GRAD_BITS + 1) if grad >> (i + 1) & 1]
    if params:
        said = [names[i] if i < min(len(names), PARAM_GRAD_BITS) else
                f"parameter #{i}{'+' if i == PARAM_GRAD_BITS else ''}" for i in params]
        parts.append(f"parameter(s) {', '.join(said)} require grad")
    text = " and ".join(parts) or "nothing requires grad (or no grad mode)"
    if grad & CHECKPOINT_BIT:
        text += ", inside torch.utils.checkpoint(use_reentrant=False)"
    return text


def _bad_blocks(ranks: list[int], text: str) -> ShapeError:
    """The ShapeError of a check that found bad blocks (``bad_ranks``: where), raised alike
    by every rank of the check."""
    err = ShapeError(text)
    err.bad_ranks = ranks  # type: ignore[attr-defined]
    return raised_everywhere(err)


def verify(group: Group | None, what: str, config: int, spec: TensorSpec | None,
           local_ok: bool, ranks: Sequence[int] | None = None, grad: int | None = None,
           bad_text: str | None = None, param_names: Callable[[], list[str]] | None = None
           ) -> None:
    """Check, across ``group``, that every rank runs the same operator (``what`` and its
    ``config`` hash) on the same ``spec``, that every block matches it, and (``grad`` not
    None) that every rank records the same adjoints for backward (else they would run on
    some ranks only: a wait, or a message a later call receives). ``grad``: bit 1 the input
    records its graph (requires grad, in grad mode), bit 2 + i parameter i does (a bool:
    the input alone; ``param_names()`` names them in a message). ``bad_text``: the
    message for ranks whose ``local_ok`` is False (``{ranks}`` is filled in), where what
    is checked is not the block itself."""
    if group is None or group.size == 1:
        if not local_ok:
            me = [spec.partition.world.rank] if spec else []
            raise _bad_blocks(me, bad_text.format(ranks=me) if bad_text is not None else
                              f"{what}: this rank's block does not match "
                              f"{spec.describe() if spec else 'its spec'}")
        return
    status = (OK if local_ok else BAD_BLOCK) | (
        0 if grad is None else (1 + int(grad)) << _GRAD_SHIFT)
    row = Row.make(what, status, config,
                   spec.dtype if spec else None, spec.device_type if spec else "cpu",
                   None, spec.global_shape if spec else None,
                   spec.fingerprint if spec else 0)
    rows = exchange(group, row, what)
    same_program(rows, group.ranks, what)
    specs = {(x.spec_hash, x.dtype, x.device, x.glob) for x in rows}
    if len(specs) > 1:
        detail = "; ".join(f"rank {r}: {x.describe()} [partition/spec {x.spec_hash:#x}]"
                           for r, x in zip(group.ranks, rows))
        raise raised_everywhere(MismatchError(
            f"{what}: ranks disagree about the tensor ({detail}): dtype, global shape, "
            f"device or partition differ"))
    grads = {r: (x.status >> _GRAD_SHIFT) - 1 for r, x in zip(group.ranks, rows)
             if x.status >> _GRAD_SHIFT}
    if len(set(grads.values())) > 1:
        names = param_names() if param_names is not None else []
        detail = "; ".join(f"rank {r}: {_records(g, names)}" for r, g in grads.items())
        raise raised_everywhere(MismatchError(
            f"{what}: ranks differ in what this call records for backward ({detail}): the "
            f"adjoints would run on some ranks only. Make the blocks (zero-volume ones too) "
            f"and the parameters require grad alike on every rank, under the same grad "
            f"mode"))
    bad = [r for r, x in zip(group.ranks, rows) if x.status & _STATUS_MASK != OK]
    if bad:
        raise _bad_blocks(bad, bad_text.format(ranks=bad) if bad_text is not None else
                          f"{what}: the block on rank(s) {bad} does not match the tensor "
                          f"{spec.describe() if spec else ''} (each rank's error says what "
                          f"it holds)")
