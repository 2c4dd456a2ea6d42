"""Halo geometry: which input entries each worker needs for a sliding-kernel operator.

For one tensor dimension of global input length ``n`` split over ``P`` workers, a kernel of
size ``k`` with stride ``s``, dilation ``d`` and padding ``(p_l, p_r)`` produces

    m = floor((n + p_l + p_r - d*(k-1) - 1) / s) + 1

outputs. The *outputs* are block-balanced over the workers (they carry the compute load);
the *inputs* are block-balanced too (``gpudist.decomposition.block_range``), as if produced by
an earlier layer with the same rule. Worker ``i`` computing outputs ``[o0, o1)`` reads the
global input indices ``[o0*s - p_l, (o1-1)*s - p_l + d*(k-1)]``. Intersected with ``[0, n)``
this *needed* range splits into three intervals relative to the worker's bulk ``[i0, i1)``:

* a left halo (needed indices below ``i0``: copies of the left neighbour's bulk),
* the trimmed bulk (needed indices the worker owns),
* a right halo (needed indices at or above ``i1``: copies of the right neighbour's bulk);

owned entries outside the needed range are *extra* (trimmed before the local operator), and
needed indices outside ``[0, n)`` are global *padding* (added by the layer, zeros or -inf).
The local operator then runs with padding 0 on ``[pad_l | halo_l | trimmed | halo_r | pad_r]``.

:meth:`HaloGeometry.from_intervals` takes the per-worker output and needed ranges directly
(operators that are not a sliding kernel, e.g. interpolation); the rest is the same.

Halos usually come from the direct neighbours; when a halo is wider than the neighbours'
blocks (small blocks, a large kernel) the needed entries come straight from the workers
further along that own them (``WorkerHalo.recv_from``/``send_to``). A kernel that does not
fit the padded input is a :class:`~gpudist.errors.HaloError`, raised identically on every
worker because every worker computes the whole geometry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..decomposition import block_range
from ..errors import HaloError, ShapeError, raised_everywhere

Interval = tuple[int, int]  # half-open [lo, hi)


def _size(iv: Interval) -> int:
    return max(0, iv[1] - iv[0])


@dataclass(frozen=True)
class WorkerHalo:
    """One worker's view of one dimension (all intervals global, half-open).

    ``outputs``: its output range; ``bulk``: the input entries it owns; ``needed``: the input
    entries its outputs read, clipped to ``[0, n)``; ``halo_left``/``halo_right``: the parts of
    ``needed`` owned by workers to the left/right; ``trimmed``: the part it owns itself;
    ``send_left``/``send_right``: the parts of its bulk workers to the left/right need;
    ``recv_from``/``send_to``: per other worker (index along this dimension), the interval
    received from / sent to it -- usually the direct neighbours, further workers when a
    halo is wider than their blocks; ``work``: the smallest interval holding both bulk and
    needed (the exchange buffer).
    """

    index: int
    outputs: Interval
    bulk: Interval
    needed: Interval
    halo_left: Interval
    trimmed: Interval
    halo_right: Interval
    send_left: Interval
    send_right: Interval
    pad_left: int
    pad_right: int
    work: Interval
    recv_from: tuple[tuple[int, Interval], ...] = ()
    send_to: tuple[tuple[int, Interval], ...] = ()

    @property
    def n_outputs(self) -> int:
        return _size(self.outputs)

    @property
    def n_inputs(self) -> int:
        return _size(self.bulk)

    @property
    def left_halo(self) -> int:
        """Width of the left halo."""
        return _size(self.halo_left)

    @property
    def right_halo(self) -> int:
        """Width of the right halo."""
        return _size(self.halo_right)

    @property
    def left_extra(self) -> int:
        """Owned entries left of the needed range (trimmed away)."""
        if _size(self.needed) == 0:
            return self.n_inputs
        return max(0, min(self.needed[0], self.bulk[1]) - self.bulk[0])

    @property
    def right_extra(self) -> int:
        """Owned entries right of the needed range (trimmed away)."""
        if _size(self.needed) == 0:
            return 0
        return max(0, self.bulk[1] - max(self.needed[1], self.bulk[0]))

    @property
    def local_length(self) -> int:
        """Length after the exchange (halos + trimmed bulk, padding not included)."""
        return _size(self.needed)

    @property
    def padded_length(self) -> int:
        """Length the local operator sees (with global padding)."""
        return self.pad_left + _size(self.needed) + self.pad_right

    @property
    def reads(self) -> tuple[int, int] | None:
        """Inclusive global input range the outputs read, padding included (None if no output)."""
        if self.n_outputs == 0:
            return None
        return self.needed[0] - self.pad_left, self.needed[1] - 1 + self.pad_right

    @property
    def exchanges(self) -> bool:
        """Whether this worker sends or receives anything in this dimension."""
        return bool(self.recv_from or self.send_to)

    @property
    def hops(self) -> int:
        """How far the furthest worker it exchanges with is (1: direct neighbours only)."""
        me = self.index
        return max((abs(j - me) for j, _ in self.recv_from + self.send_to), default=0)

    def row(self) -> dict[str, object]:
        """A flat summary (for tables and tests)."""
        nd = self.needed
        return {
            "worker": self.index, "outputs": self.n_outputs, "out_range": self.outputs,
            "inputs": self.n_inputs, "bulk": self.bulk,
            "needed": (nd[0], nd[1] - 1) if _size(nd) else None, "reads": self.reads,
            "halo_l": self.left_halo, "halo_r": self.right_halo,
            "extra_l": self.left_extra, "extra_r": self.right_extra,
            "pad_l": self.pad_left, "pad_r": self.pad_right,
        }


@dataclass(frozen=True)
class HaloGeometry:
    """The halo geometry of one dimension over all ``workers`` (a value type).

    Raises :class:`HaloError` if the kernel does not fit the padded input. ``axis`` only
    labels messages.
    """

    size: int
    workers: int
    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    padding: tuple[int, int] = (0, 0)
    axis: int = 0
    intervals: tuple[tuple[Interval, Interval], ...] | None = field(default=None, repr=False)
    per_worker: tuple[WorkerHalo, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def from_intervals(cls, size: int, outputs: Sequence[Interval], needed: Sequence[Interval],
                       axis: int = 0) -> HaloGeometry:
        """A geometry from explicit per-worker intervals instead of kernel parameters.

        ``outputs[i]``: worker ``i``'s output range (half-open; the ranges must tile
        ``[0, m)`` in worker order); ``needed[i]``: the input range its outputs read, inside
        ``[0, size]`` (no global padding). Input bulks are block-balanced as usual. For
        operators that are not a sliding kernel, e.g. interpolation
        (:mod:`gpudist.nn.sampling`).
        """
        if len(outputs) != len(needed):
            raise HaloError(f"dimension {axis}: {len(outputs)} output intervals but "
                            f"{len(needed)} needed intervals")
        ivs = tuple(((int(o[0]), int(o[1])), (int(n[0]), int(n[1])))
                    for o, n in zip(outputs, needed))
        return cls(int(size), len(ivs), axis=axis, intervals=ivs)

    def __repr__(self) -> str:
        if self.intervals is None:
            return (f"HaloGeometry(size={self.size}, workers={self.workers}, "
                    f"kernel={self.kernel}, stride={self.stride}, dilation={self.dilation}, "
                    f"padding={self.padding}, axis={self.axis})")
        return (f"HaloGeometry.from_intervals(size={self.size}, "
                f"outputs={[o for o, _ in self.intervals]}, "
                f"needed={[n for _, n in self.intervals]}, axis={self.axis})")

    def __post_init__(self) -> None:
        if self.intervals is not None:
            self._init_from_intervals()
            return
        pad = self.padding
        if isinstance(pad, int):
            pad = (pad, pad)
        pad = (int(pad[0]), int(pad[1]))
        object.__setattr__(self, "padding", pad)
        n, P, k, s, d = self.size, self.workers, self.kernel, self.stride, self.dilation
        where = f"dimension {self.axis}"
        if n < 0 or P < 1 or k < 1 or s < 1 or d < 1 or min(pad) < 0:
            raise HaloError(
                f"{where}: invalid halo parameters size={n}, workers={P}, kernel={k}, "
                f"stride={s}, dilation={d}, padding={pad} (need size>=0, workers/kernel/stride/"
                f"dilation>=1, padding>=0)"
            )
        span = d * (k - 1) + 1
        if n + pad[0] + pad[1] < span and not (n == 0 and span == 1 and pad == (0, 0)):
            # (an empty dimension the kernel leaves alone, a batch of 0, stays empty;
            # whether a layer accepts one is the layer's call: require_nonempty)
            raise HaloError(
                f"{where}: kernel extent dilation*(kernel-1)+1 = {span} exceeds the padded "
                f"input length {n}+{pad[0]}+{pad[1]} = {n + sum(pad)}: no output"
            )
        m = (n + pad[0] + pad[1] - span) // s + 1
        outs = [block_range(m, P, i) for i in range(P)]
        bulks = [block_range(n, P, i) for i in range(P)]
        needs, pads = [], []
        for o0, o1 in outs:
            if o1 <= o0:
                a = min(max(o0 * s - pad[0], 0), n)
                needs.append((a, a))
                pads.append((0, 0))
                continue
            lo, hi = o0 * s - pad[0], (o1 - 1) * s - pad[0] + d * (k - 1) + 1  # [lo, hi)
            pads.append((max(0, min(hi, 0) - lo), max(0, hi - max(lo, n))))
            a, b = min(max(lo, 0), n), max(min(hi, n), 0)
            needs.append((a, max(a, b)))
        self._finish(outs, bulks, needs, pads,
                     f"n={n}, kernel={k}, stride={s}, dilation={d}, padding={pad}")

    def _init_from_intervals(self) -> None:
        n, P, ivs = self.size, self.workers, self.intervals
        where = f"dimension {self.axis}"
        if n < 0 or P < 1 or len(ivs) != P:
            raise HaloError(f"{where}: invalid interval geometry size={n}, workers={P}, "
                            f"{len(ivs)} intervals (need size>=0, one interval pair per worker)")
        outs = [o for o, _ in ivs]
        at = 0
        for i, (o0, o1) in enumerate(outs):
            if o0 != at or o1 < o0:
                raise HaloError(f"{where}: output intervals must tile [0, m) in worker order; "
                                f"worker {i} has [{o0}, {o1}), expected a start at {at}")
            at = o1
        bulks = [block_range(n, P, i) for i in range(P)]
        needs = []
        for i, ((o0, o1), (a, b)) in enumerate(ivs):
            if not 0 <= a <= b <= n:
                raise HaloError(f"{where}: worker {i} needs input [{a}, {b}), outside "
                                f"[0, {n}] or reversed")
            if o1 == o0 or a == b:  # nothing read: an empty range at the bulk start
                a = b = bulks[i][0]
            needs.append((a, b))
        self._finish(outs, bulks, needs, [(0, 0)] * P, f"n={n}, explicit intervals")

    def _finish(self, outs: list[Interval], bulks: list[Interval], needs: list[Interval],
                pads: list[tuple[int, int]], detail: str) -> None:
        """Split each worker's needed range into halos and trimmed bulk, find who sends what
        to whom (any worker along the dimension: direct neighbours, or further ones when a
        halo is wider than their blocks), and set ``per_worker``."""
        P = self.workers

        def meet(a: Interval, b: Interval) -> Interval:
            return (max(a[0], b[0]), min(a[1], b[1]))

        per = []
        for i in range(P):
            (a, b), (i0, i1) = needs[i], bulks[i]
            hl = (a, min(b, i0)) if a < i0 else (i0, i0)
            hr = (max(a, i1), b) if b > i1 else (i1, i1)
            tr = (max(a, i0), min(b, i1))
            if tr[1] < tr[0]:
                tr = (tr[0], tr[0])
            recv = tuple((j, meet(needs[i], bulks[j])) for j in range(P)
                         if j != i and _size(meet(needs[i], bulks[j])))
            send = tuple((j, meet(needs[j], bulks[i])) for j in range(P)
                         if j != i and _size(meet(needs[j], bulks[i])))
            left = [iv for j, iv in send if j < i]
            right = [iv for j, iv in send if j > i]
            sl = (i0, max(iv[1] for iv in left)) if left else (i0, i0)  # a prefix of the bulk
            sr = (min(iv[0] for iv in right), i1) if right else (i1, i1)  # a suffix
            spans = [iv for iv in (needs[i], bulks[i]) if _size(iv)]
            work = (min(x[0] for x in spans), max(x[1] for x in spans)) if spans else (i0, i0)
            per.append(WorkerHalo(i, outs[i], bulks[i], (a, b), hl, tr, hr, sl, sr,
                                  pads[i][0], pads[i][1], work, recv, send))
        object.__setattr__(self, "per_worker", tuple(per))

    # -- whole-dimension facts ---------------------------------------------
    @property
    def output_size(self) -> int:
        """Global output length m."""
        if self.intervals is not None:
            return self.intervals[-1][0][1]
        s, (pl, pr) = self.stride, self.padding
        return (self.size + pl + pr - self.dilation * (self.kernel - 1) - 1) // s + 1

    @property
    def trivial(self) -> bool:
        """No halo, no trimming, no padding for any worker (e.g. kernel 1, stride 1)."""
        return all(not w.exchanges and w.left_extra == 0 and w.right_extra == 0
                   and w.pad_left == 0 and w.pad_right == 0 for w in self.per_worker)

    def worker(self, i: int) -> WorkerHalo:
        """Worker ``i``'s geometry."""
        return self.per_worker[i]

    def rows(self) -> list[dict[str, object]]:
        return [w.row() for w in self.per_worker]


def _per_dim(value, ndim: int, name: str, default: int) -> tuple:
    """Broadcast an int or a (trailing-aligned) sequence to ``ndim`` entries.

    An int applies to the spatial dims: all dims after the first two (batch, channel) when
    ``ndim >= 3``, else to every dim. A shorter sequence is aligned with the trailing dims.
    """
    if isinstance(value, int):
        lead = 2 if ndim >= 3 else 0
        return tuple([default] * lead + [value] * (ndim - lead))
    vals = list(value)
    if len(vals) > ndim:
        raise HaloError(f"{name} has {len(vals)} entries but the tensor has {ndim} dimensions")
    return tuple([default] * (ndim - len(vals)) + vals)


def normalize_params(
    ndim: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int | tuple[int, int]] = 0,
    dilation: int | Sequence[int] = 1,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Per-dimension ``(kernel, stride, (pad_l, pad_r), dilation)`` for an ``ndim`` tensor.

    Ints apply to the spatial dims (dims ``2:`` of a >=3-D tensor, else all dims); sequences
    shorter than ``ndim`` align with the trailing dims, the leading ones get kernel 1, stride 1,
    padding 0, dilation 1. A padding entry is an int (both sides) or a ``(left, right)`` pair.
    """
    k = _per_dim(kernel_size, ndim, "kernel_size", 1)
    s = _per_dim(stride, ndim, "stride", 1)
    dl = _per_dim(dilation, ndim, "dilation", 1)
    p = _per_dim(padding, ndim, "padding", 0)
    pads = tuple((int(x), int(x)) if isinstance(x, int) else (int(x[0]), int(x[1])) for x in p)
    return tuple(int(x) for x in k), tuple(int(x) for x in s), pads, tuple(int(x) for x in dl)


def require_nonempty(global_shape: Sequence[int], what: str) -> None:
    """Raise (alike on every rank) if a dimension other than the batch (dimension 0) of an
    (N, C, spatial...) input is empty: torch's convolutions, pooling and interpolation
    refuse those, and take a batch of 0."""
    for a, n in enumerate(global_shape):
        if a and not n:
            raise raised_everywhere(ShapeError(
                f"{what}: the input's global shape {tuple(global_shape)} is empty in "
                f"dimension {a} ({'channels' if a == 1 else f'spatial dim {a - 2}'}); only "
                f"the batch dimension may be empty"))


def halo_spec(
    global_shape: Sequence[int],
    partition_shape: Sequence[int],
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int | tuple[int, int]] = 0,
    dilation: int | Sequence[int] = 1,
) -> tuple[HaloGeometry, ...]:
    """Per-dimension :class:`HaloGeometry` of a tensor over a partition.

    Dimensions with partition extent 1 still carry their padding and trimming, so the local
    operator can always run with padding 0. Use :func:`worker_spec` for one worker's numbers.
    """
    g, ps = tuple(int(x) for x in global_shape), tuple(int(x) for x in partition_shape)
    if len(g) != len(ps):
        raise HaloError(
            f"tensor has {len(g)} dimensions but the partition has {len(ps)}: "
            f"global shape {g}, partition shape {ps}"
        )
    k, s, p, dl = normalize_params(len(g), kernel_size, stride, padding, dilation)
    return tuple(HaloGeometry(g[a], ps[a], k[a], s[a], dl[a], p[a], axis=a) for a in range(len(g)))


def worker_spec(geometry: Sequence[HaloGeometry], coords: Sequence[int]) -> tuple[WorkerHalo, ...]:
    """The worker at partition ``coords``: one :class:`WorkerHalo` per dimension."""
    return tuple(geo.worker(c) for geo, c in zip(geometry, coords))
