"""Seeded randomized comparison of gpudist's layers with torch's.

Each of ``GPUDIST_FUZZ_N`` random configurations (seed ``GPUDIST_FUZZ_SEED``) picks a layer,
its options, a world size 1-6, a partition over a random subset (in random order) of the
ranks, random uneven (often tiny) global sizes and float64 data, mostly on gloo and a few on
MPI. The torch layer runs first, here, sequentially; then the distributed layer on a rank
pool. The outcome must be one of:

* ``equal``: every rank succeeds; the gathered output, input gradient, parameter gradients
  (``global_grads()``), the state after the steps and the seeded initial parameters equal
  torch's (< 1e-9);
* ``both refuse``: torch rejects the configuration and every rank raises the same gpudist
  error (a type ending in ``Error``, same message);
* ``gpudist refuses``: torch accepts, every rank raises the same error (same type and
  message): allowed, recorded and printed (``-s``) so that the messages can be judged;

never an error on some ranks only (or different errors), a hang (a per-run timeout and a
short communication timeout), a crash or a wrong result.

Layers: the convolutions (spatial and general P_w forms) and transposed ones (1-3d), the
channel-partitioned convolutions (AllGather / ReduceScatter, plain and transposed, 1-3d),
pooling, upsampling, batch and layer norms, the linear, sharded-linear and expert layers
(reference: one ``torch.nn.Linear`` per expert, built in expert order), embeddings,
DistributedTranspose (reference: the identity on the global tensor) and the losses
(reference: the ``torch.nn`` loss on the global input and target; a reduced loss must be a
0-dim tensor on every rank, torch's value on the root of P_x and 0 elsewhere, and every
rank calls backward with the same output gradient). A failing chunk lists each failing
configuration (a JSON dict: ``tests.test_fuzz._run_config(cfg)`` reproduces it, with the
pools of this module; ``make_config(seed, index)`` regenerates it).

Configurations are generated whether or not they hit a known bug. When this file was
written it found four (all fixed since): forward-time errors raised only on the layer's
ranks with plain-tensor input, a second global shape seen by some ranks' blocks only,
DistributedUpsample on empty channel or batch blocks without a spatial split, and the layer
norms on empty row blocks.

Environment: ``GPUDIST_FUZZ_N`` (default 100), ``GPUDIST_FUZZ_SEED`` (default 1234),
``GPUDIST_FUZZ_TIMEOUT`` (seconds per configuration, default 60),
``GPUDIST_FUZZ_COMM_TIMEOUT`` (the ranks' communication timeout, default 10),
``GPUDIST_FUZZ_REPORT`` (a path: append every configuration's outcome there as JSON lines),
``GPUDIST_FUZZ_MPI_SHARE`` (the share of configurations run on MPI where it is installed,
default 0.08; the others run on gloo).
"""

from __future__ import annotations

import json
import math
import os
import random
import traceback

import pytest
import torch

import gpudist.nn as gnn
from gpudist import Decomposition, DistTensor, Partition
from gpudist.launch import Cluster, RankFailure
from gpudist.primitives import zero_volume
from tests.conftest import HAS_MPI
from tests.util import block_of, gather, global_tensor, maxerr

N = int(os.environ.get("GPUDIST_FUZZ_N", "100"))
SEED = int(os.environ.get("GPUDIST_FUZZ_SEED", "1234"))
RUN_TIMEOUT = float(os.environ.get("GPUDIST_FUZZ_TIMEOUT", "60"))
COMM_TIMEOUT = float(os.environ.get("GPUDIST_FUZZ_COMM_TIMEOUT", "10"))
REPORT = os.environ.get("GPUDIST_FUZZ_REPORT")
MPI_SHARE = float(os.environ.get("GPUDIST_FUZZ_MPI_SHARE", "0.08"))
CHUNK = 10
TOL = 1e-9
F64 = torch.float64
# errors that say another rank failed, or that nobody answered: never an agreed refusal
NOT_AGREED = {"RemoteError", "WorldAborted", "CommTimeout", "MismatchError"}




# =========================================================================== generation
def _partition(rng: random.Random, n: int, ndims: int, splittable, cap: int | None = None):
    """A random partition shape over ``ndims`` dims splitting only ``splittable`` (at most
    ``cap`` or ``n`` workers) and a random subset, in random order, of the n ranks."""
    shape = [1] * ndims
    dims = list(splittable)
    rng.shuffle(dims)
    budget = min(n, cap or n)
    for d in dims:
        room = budget // math.prod(shape)
        if room >= 2 and rng.random() < 0.7:
            shape[d] = rng.randint(2, min(room, 4))
    ranks = rng.sample(range(n), math.prod(shape))
    return shape, ranks


def _size(rng: random.Random, lo: int = 1, hi: int = 12) -> int:
    """Sizes biased to tiny ones (1-3) and otherwise uneven."""
    return rng.randint(lo, min(3, hi)) if rng.random() < 0.35 else rng.randint(lo, hi)


def _per_dim(rng: random.Random, nd: int, lo: int, hi: int):
    if rng.random() < 0.5:
        return rng.randint(lo, hi)
    return [rng.randint(lo, hi) for _ in range(nd)]


def _dims(v, nd: int) -> list[int]:
    return list(v) if isinstance(v, (list, tuple)) else [v] * nd


def _vary(rng: random.Random, gshape, dims) -> list[int]:
    """A second global shape: one of ``dims`` changed (another shape through the layer)."""
    g = list(gshape)
    d = rng.choice(list(dims))
    g[d] = max(1, g[d] + rng.choice([-1, 1, 2]))
    return g


def _gen_padding(rng, cfg, nd, transposed, pmax, same, valid):
    """A conv's padding (and a transposed conv's output_padding, sometimes invalid):
    "same" / "valid" with probabilities ``same`` / ``valid - same``, else 0..pmax."""
    if transposed:
        cfg["p"] = _per_dim(rng, nd, 0, pmax)
        s, d = _dims(cfg["s"], nd), _dims(cfg["d"], nd)
        q = [rng.randint(0, max(si, di) - 1) for si, di in zip(s, d)]
        if rng.random() < 0.1:
            q[0] = max(s[0], d[0])  # rejected by both
        cfg["q"] = q
    else:
        r = rng.random()
        cfg["p"] = "same" if r < same else "valid" if r < valid else _per_dim(rng, nd, 0, pmax)


def _gen_conv(rng, n, cfg, transpose=False):
    nd = rng.choice([1, 1, 1, 2, 2, 2, 3] if transpose else [1, 1, 2, 2, 3])
    hi = 3 if nd == 3 else 5
    cfg.update(nd=nd, cin=rng.randint(1, 4), cout=rng.randint(1, 4),
               k=_per_dim(rng, nd, 1, 3 if nd == 3 else 5), s=_per_dim(rng, nd, 1, 3),
               d=_per_dim(rng, nd, 1, 3 if rng.random() < 0.5 else 1),
               bias=rng.random() < 0.7, groups=1)
    if rng.random() < 0.2:
        g = rng.choice([2, 3])
        if rng.random() < 0.8:  # mostly a valid grouping
            cfg["cin"], cfg["cout"] = g * rng.randint(1, 2), g * rng.randint(1, 2)
        cfg["groups"] = g
    _gen_padding(rng, cfg, nd, transpose, 3, 0.2, 0.3)
    # batch + spatial sizes; halos wider than blocks happen with tiny blocks
    gshape = [rng.randint(1, 3), cfg["cin"]] + [_size(rng, 1, hi * 3) for _ in range(nd)]
    if rng.random() < 0.1:
        gshape[1] = cfg["cin"] + 1  # a wrong channel count: both refuse
    general = rng.random() < 0.4
    if general:  # P_w = (P_b, P_co, P_ci, spatial..)
        wshape, wranks = _partition(rng, n, nd + 3, range(nd + 3))
        pb, pco, pci, sp = wshape[0], wshape[1], wshape[2], wshape[3:]
        cfg.update(form="general", w_shape=wshape, w_ranks=wranks,
                   x_shape=[pb, pci] + sp,
                   x_ranks=rng.sample(range(n), pb * pci * math.prod(sp)))
        cfg["y_ranks"] = (rng.sample(range(n), pb * pco * math.prod(sp))
                          if rng.random() < 0.5 else None)
        cfg["y_shape"] = [pb, pco] + sp
    else:
        # P_x = (P_b, 1, spatial..); now and then channels split without P_w (refused)
        split = [0] + list(range(2, nd + 2)) + ([1] if rng.random() < 0.1 else [])
        xshape, xranks = _partition(rng, n, nd + 2, split)
        cfg.update(form="spatial", x_shape=xshape, x_ranks=xranks)
    cfg["gshapes"] = [gshape]
    cfg["vary"] = [0] + list(range(2, nd + 2))


def _gen_pool(rng, n, cfg):
    nd = rng.choice([1, 2])
    kind = cfg["kind"]
    k = _dims(_per_dim(rng, nd, 1, 4), nd)
    p = [rng.randint(0, kk // 2) for kk in k]
    if rng.random() < 0.1:
        p[0] = k[0] // 2 + 1  # torch: pad at most half the (effective) kernel
    cfg.update(nd=nd, k=k, s=None if rng.random() < 0.3 else _per_dim(rng, nd, 1, 3), p=p,
               ceil=rng.random() < 0.4)
    if kind == "maxpool":
        cfg["d"] = _per_dim(rng, nd, 1, 3) if rng.random() < 0.5 else 1
    else:
        cfg["cip"] = rng.random() < 0.5
    gshape = [rng.randint(1, 3), rng.randint(1, 3)] + [_size(rng, 1, 14) for _ in range(nd)]
    xshape, xranks = _partition(rng, n, nd + 2, range(nd + 2))
    cfg.update(x_shape=xshape, x_ranks=xranks, gshapes=[gshape], vary=list(range(nd + 2)))


def _gen_upsample(rng, n, cfg):
    nd = rng.choice([1, 1, 2, 2, 3])
    interp = {1: "linear", 2: "bilinear", 3: "trilinear"}[nd]
    modes = ["nearest", "nearest", interp, interp, "nearest-exact", "area"]
    if nd == 2:
        modes.append("bicubic")
    mode = rng.choice(modes)
    cfg.update(nd=nd, mode=mode, size=None, scale=None, align=None,
               recompute=rng.choice([None, None, True, False]))
    if rng.random() < 0.25:
        cfg["size"] = _per_dim(rng, nd, 1, 9)
        cfg["recompute"] = None
    else:
        pick = [0.5, 0.7, 1.0, 1.5, 2.0, 2.5, 3.0, 1.3333333333333333]
        cfg["scale"] = rng.choice(pick) if rng.random() < 0.5 else \
            [rng.choice(pick) for _ in range(nd)]
    if mode in ("linear", "bilinear", "bicubic", "trilinear") and rng.random() < 0.6:
        cfg["align"] = rng.random() < 0.5
    hi = 6 if nd == 3 else 10
    gshape = [rng.randint(1, 2), rng.randint(1, 3)] + [_size(rng, 1, hi) for _ in range(nd)]
    xshape, xranks = _partition(rng, n, nd + 2, range(nd + 2))
    cfg.update(x_shape=xshape, x_ranks=xranks, gshapes=[gshape], vary=list(range(nd + 2)))


def _gen_bn(rng, n, cfg):
    nd = rng.choice([2, 3, 3, 4, 4, 5])  # input dims (N, C, spatial..)
    C = rng.randint(1, 4)
    cfg.update(C=C, affine=rng.random() < 0.7, track=rng.random() < 0.8,
               momentum=rng.choice([0.1, 0.3, None]), training=rng.random() < 0.7)
    gshape = [_size(rng, 1, 5), C] + [_size(rng, 1, 6) for _ in range(nd - 2)]
    xshape, xranks = _partition(rng, n, nd, range(nd))
    cfg.update(x_shape=xshape, x_ranks=xranks, gshapes=[gshape],
               vary=[0] + list(range(2, nd)))


def _gen_linear(rng, n, cfg):
    wshape, wranks = _partition(rng, n, 2, [0, 1])
    fo, fi = wshape
    P_rank = {(i, j): wranks[i * fi + j] for i in range(fo) for j in range(fi)}
    if rng.random() < 0.5:  # x on P_w's row 0, y on its column 0 (as in the tests)
        xr = [P_rank[(0, j)] for j in range(fi)]
        yr = [P_rank[(i, 0)] for i in range(fo)]
    else:
        xr, yr = rng.sample(range(n), fi), rng.sample(range(n), fo)
    fin, fout = _size(rng, 1, 9), _size(rng, 1, 9)
    cfg.update(w_shape=wshape, w_ranks=wranks, x_ranks=xr, y_ranks=yr, fin=fin, fout=fout,
               bias=rng.random() < 0.7, gshapes=[[_size(rng, 1, 5), fin]], vary=[0])


def _gen_norm(rng, n, cfg):
    nd = rng.randint(2, 4)
    k = rng.randint(1, nd - 1) if rng.random() < 0.9 else nd
    gshape = [_size(rng, 1, 5) for _ in range(nd)]
    cfg.update(k=k, affine=rng.random() < 0.7, bias=rng.random() < 0.7,
               eps=rng.choice([1e-5, 1e-3]) if cfg["kind"] != "rmsz" else
               rng.choice([None, 1e-6]))
    xshape, xranks = _partition(rng, n, nd, range(nd))
    cfg.update(x_shape=xshape, x_ranks=xranks, gshapes=[gshape], vary=list(range(nd - k)))


def _gen_emb(rng, n, cfg):
    ni = rng.choice([1, 2])
    num, dim = _size(rng, 1, 8), _size(rng, 1, 6)
    pshape, pranks = _partition(rng, n, ni + 2, range(ni + 2))
    r = rng.random()
    cfg.update(ni=ni, num=num, dim=dim, p_shape=pshape, p_ranks=pranks,
               padding_idx=rng.randint(-num, num - 1) if r < 0.3 else None,
               max_norm=rng.choice([0.5, 1.0, 2.0]) if rng.random() < 0.25 else None,
               norm_type=rng.choice([1.0, 2.0, 3.0]),
               sgbf=rng.random() < 0.3,
               gshapes=[[_size(rng, 1, 6) for _ in range(ni)]], vary=list(range(ni)))


def _gen_sharded(rng, n, cfg):
    nd = rng.randint(2, 4)
    dim = rng.choice([-2, -2] + list(range(nd - 1)))
    fin, fout = _size(rng, 1, 8), _size(rng, 1, 8)
    gshape = [_size(rng, 1, 6) for _ in range(nd - 1)] + [fin]
    valid = rng.random() < 0.85
    gather_form = cfg["kind"] in ("ag", "agz")
    # AllGather form: features whole; ReduceScatter form: ``dim`` whole
    whole = nd - 1 if gather_form else dim % nd
    split = [d for d in range(nd) if d != whole] if valid else range(nd)
    xshape, xranks = _partition(rng, n, nd, split)
    cfg.update(dim=dim, fin=fin, fout=fout, bias=rng.random() < 0.7, x_shape=xshape,
               x_ranks=xranks, gshapes=[gshape], vary=list(range(nd - 1)))


def _gen_chconv(rng, n, cfg):
    """The channel-partitioned convolutions: P_x = (P_d, P_c, 1, ..)."""
    t = rng.random() < 0.4
    nd = rng.choice([1, 1, 2, 2, 3])
    hi = 3 if nd == 3 else 5
    # (P_d, P_c, 1..); now and then a spatial dim split too (refused)
    split = [0, 1] + ([rng.randint(2, nd + 1)] if rng.random() < 0.08 else [])
    xshape, xranks = _partition(rng, n, nd + 2, split)
    lo = xshape[1] if rng.random() < 0.85 else 1  # mostly channels enough for P_c
    cfg.update(form=rng.choice(["ag", "rs"]), transposed=t, nd=nd, cin=rng.randint(lo, 5),
               cout=rng.randint(lo, 5), k=_per_dim(rng, nd, 1, 3 if nd == 3 else 4),
               s=_per_dim(rng, nd, 1, 3), d=_per_dim(rng, nd, 1, 2 if rng.random() < 0.5 else 1),
               bias=rng.random() < 0.7, groups=1, mode="zeros")
    if rng.random() < 0.05:  # torch groups it, gpudist refuses
        cfg["cin"], cfg["cout"], cfg["groups"] = 2 * rng.randint(1, 2), 2, 2
    _gen_padding(rng, cfg, nd, t, 2, 0.15, 0.25)
    if not t and rng.random() < 0.2:
        cfg["mode"] = rng.choice(["reflect", "replicate", "circular"])
    gshape = [rng.randint(1, 4), cfg["cin"]] + [_size(rng, 1, hi * 3) for _ in range(nd)]
    if rng.random() < 0.05:
        gshape[1] = cfg["cin"] + 1  # a wrong channel count: both refuse
    cfg.update(x_shape=xshape, x_ranks=xranks, gshapes=[gshape],
               vary=[0] + list(range(2, nd + 2)))


def _gen_experts(rng, n, cfg):
    """(experts, tokens.., features): experts split over axis 0; AllGather form: features
    whole; ReduceScatter form: ``dim`` whole."""
    form = rng.choice(["eag", "ers", "eagz", "ersz"])
    nd = rng.choice([3, 3, 4])
    dim = rng.choice([-2, -2] + list(range(1, nd - 1)))
    if rng.random() < 0.04:
        dim = rng.choice([0, nd - 1])  # the experts or the features: refused
    whole = nd - 1 if form in ("eag", "eagz") else dim % nd
    split = [d for d in range(nd) if d != whole] if rng.random() < 0.9 else range(nd)
    xshape, xranks = _partition(rng, n, nd, split)
    E, fin, fout = rng.randint(1, 4), _size(rng, 1, 7), _size(rng, 1, 7)
    if rng.random() < 0.85:  # mostly enough experts and features for the split
        E, fin = max(E, xshape[0]), max(fin, xshape[-1])
        fout = max(fout, xshape[dim % nd])
    gshape = [E] + [_size(rng, 1, 5) for _ in range(nd - 2)] + [fin]
    if rng.random() < 0.05:
        gshape[rng.choice([0, nd - 1])] += 1  # wrong experts or features: both refuse
    cfg.update(form=form, E=E, fin=fin, fout=fout, dim=dim, bias=rng.random() < 0.7,
               x_shape=xshape, x_ranks=xranks, gshapes=[gshape], vary=list(range(1, nd - 1)))


def _factor(rng: random.Random, m: int, nd: int) -> list[int]:
    """A random shape of ``nd`` extents whose product is ``m``."""
    shape = [1] * nd
    for p in (2, 3, 5):
        while m % p == 0:
            m //= p
            shape[rng.randrange(nd)] *= p
    return shape


def _gen_transpose(rng, n, cfg):
    """P_in -> transposed_partition(P_in, a, b), or another partition of the same ranks."""
    nd = rng.randint(1, 4)
    xshape, xranks = _partition(rng, n, nd, range(nd))
    r = rng.random()
    if r < 0.75:
        out = {"a": rng.randrange(nd), "b": rng.randrange(nd) - (nd if rng.random() < 0.3
                                                                  else 0)}
    elif r < 0.93:  # the same ranks, in another order, another shape
        out = {"shape": _factor(rng, len(xranks), nd), "ranks": rng.sample(xranks, len(xranks))}
    elif r < 0.97:  # other ranks: refused (use Repartition)
        out = {"shape": list(xshape), "ranks": rng.sample(range(n), len(xranks))}
    else:  # another number of dims: refused
        out = {"shape": _factor(rng, len(xranks), nd + 1),
               "ranks": rng.sample(xranks, len(xranks))}
    gshape = [_size(rng, 1, 8) for _ in range(nd)]
    cfg.update(x_shape=xshape, x_ranks=xranks, out=out, gshapes=[gshape], vary=list(range(nd)))


LOSS_NAMES = {"mse": "MSELoss", "l1": "L1Loss", "nll": "NLLLoss",
              "cross_entropy": "CrossEntropyLoss", "bce": "BCELoss",
              "bce_with_logits": "BCEWithLogitsLoss", "kl_div": "KLDivLoss",
              "poisson_nll": "PoissonNLLLoss"}


def _gen_loss(rng, n, cfg):
    """A loss of (input, target): the class losses (NLL, cross-entropy) with targets
    without the class dim 1, the others element-wise with targets like the input."""
    name = rng.choice(list(LOSS_NAMES))
    classwise = name in ("nll", "cross_entropy")
    nd = rng.randint(2, 4) if classwise else rng.randint(1, 4)
    gshape = [_size(rng, 1, 5) for _ in range(nd)]
    reduction = rng.choice(["mean", "sum", "none"])
    if name == "kl_div" and rng.random() < 0.35 or rng.random() < 0.03:
        reduction = "batchmean"  # kl_div's only: others refuse
    opts: dict = {}
    if classwise:
        C = gshape[1]
        if rng.random() < 0.3:
            opts["weight"] = [C]
        if rng.random() < 0.3:
            # a class, or a value outside the classes (255 for unlabelled pixels; with
            # class weights it broke the mean's divisor), put into some targets
            opts["ignore_index"] = rng.choice([rng.randint(0, C - 1), C + rng.randint(0, 300)])
        if name == "cross_entropy":
            if rng.random() < 0.3:
                opts["label_smoothing"] = rng.choice([0.1, 0.25])
            cfg["probs"] = rng.random() < 0.2  # class probabilities as targets
    elif name in ("bce", "bce_with_logits"):
        for key in ("weight",) + (("pos_weight",) if name == "bce_with_logits" else ()):
            if rng.random() < 0.3:  # trailing dims, some broadcast
                j = rng.randint(1, nd)
                opts[key] = [1 if rng.random() < 0.3 else g for g in gshape[nd - j:]]
    elif name == "kl_div":
        opts["log_target"] = rng.random() < 0.4
    elif name == "poisson_nll":
        opts["log_input"] = rng.random() < 0.6
        opts["full"] = rng.random() < 0.5
    split = range(nd) if not classwise else [0] + list(range(2, nd)) + (
        [1] if rng.random() < 0.25 else [])  # the class dim split: a vocabulary-parallel loss
    xshape, xranks = _partition(rng, n, nd, split)
    cfg.update(loss=name, reduction=reduction, opts=opts, x_shape=xshape, x_ranks=xranks,
               gshapes=[gshape], vary=[0] + list(range(2, nd)) if classwise else list(range(nd)))


KINDS = [("conv", 6), ("convt", 4), ("maxpool", 3), ("avgpool", 3), ("upsample", 4),
         ("bn", 3), ("linear", 2), ("ln", 2), ("lnz", 1), ("rmsz", 1), ("emb", 2),
         ("embz", 1), ("ag", 1), ("rs", 1), ("agz", 1), ("rsz", 1), ("chconv", 3),
         ("experts", 2), ("transpose", 2), ("loss", 3)]


def make_config(seed: int, index: int) -> dict:
    rng = random.Random(f"{seed}:{index}")
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    n = rng.randint(1, 6)
    backend = "mpi" if HAS_MPI and rng.random() < MPI_SHARE else "gloo"
    cfg = {"index": index, "kind": kind, "n": n, "backend": backend,
           "seed": rng.randint(0, 10**6), "dist": rng.random() < 0.3}
    if kind in ("conv", "convt"):
        _gen_conv(rng, n, cfg, transpose=kind == "convt")
    elif kind in ("maxpool", "avgpool"):
        _gen_pool(rng, n, cfg)
    elif kind == "upsample":
        _gen_upsample(rng, n, cfg)
    elif kind == "bn":
        _gen_bn(rng, n, cfg)
    elif kind == "linear":
        _gen_linear(rng, n, cfg)
    elif kind in ("ln", "lnz", "rmsz"):
        _gen_norm(rng, n, cfg)
    elif kind in ("emb", "embz"):
        _gen_emb(rng, n, cfg)
    elif kind == "chconv":
        _gen_chconv(rng, n, cfg)
    elif kind == "experts":
        _gen_experts(rng, n, cfg)
    elif kind == "transpose":
        _gen_transpose(rng, n, cfg)
    elif kind == "loss":
        _gen_loss(rng, n, cfg)
    else:
        _gen_sharded(rng, n, cfg)
    if cfg["vary"] and rng.random() < 0.3:  # a second call: another global shape
        cfg["gshapes"].append(_vary(rng, cfg["gshapes"][0], cfg["vary"]))
    del cfg["vary"]
    return cfg


# =========================================================================== the layers
def _t(v):
    return tuple(v) if isinstance(v, list) else v


class _ExpertsRef(torch.nn.Module):
    """The sequential expert layer: expert e's parameters those of a torch.nn.Linear built
    in expert order; ``y[e] = x[e] W[e]^T + b[e]``."""

    def __init__(self, E: int, fi: int, fo: int, bias: bool) -> None:
        super().__init__()
        lins = [torch.nn.Linear(fi, fo, bias=bias, dtype=F64) for _ in range(E)]
        self.weight = torch.nn.Parameter(torch.stack([m.weight.detach() for m in lins]))
        self.bias = torch.nn.Parameter(torch.stack([m.bias.detach() for m in lins])) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, _, fi = self.weight.shape
        if x.dim() < 2 or x.shape[0] != E or x.shape[-1] != fi:  # einsum would broadcast
            raise ValueError(f"input {tuple(x.shape)} for {E} experts of {fi} features")
        y = torch.einsum("e...f,eof->e...o", x, self.weight)
        if self.bias is not None:
            y = y + self.bias.reshape((self.bias.shape[0],) + (1,) * (x.dim() - 2) + (-1,))
        return y


class _MaxPoolRef(torch.nn.Module):
    """torch's max pool, except that its gradient comes from the input explicitly padded
    with -inf: where a window reads padding only, torch's own max pool reports an index
    outside the input and its backward writes there (a torch bug; gpudist sends such a
    window's gradient nowhere). Values and refusals are torch's."""

    def __init__(self, nd: int, k, s, p, d, ceil: bool) -> None:
        super().__init__()
        self.nd, self.args = nd, (k, s, p, d)
        self.pool = getattr(torch.nn, f"MaxPool{nd}d")(k, s, p, d, ceil_mode=ceil)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(x)  # torch's values, shape and errors
        nd = self.nd
        k, s, p, d = (v if isinstance(v, tuple) else (v,) * nd for v in
                      (self.args[0], self.args[1] or self.args[0], self.args[2], self.args[3]))
        pads = []
        for a in reversed(range(nd)):
            L, m = x.shape[2 + a], y.shape[2 + a]
            extra = max(0, (m - 1) * s[a] + d[a] * (k[a] - 1) + 1 - (L + 2 * p[a]))
            pads += [p[a], p[a] + extra]
        xp = torch.nn.functional.pad(x, pads, value=-math.inf)
        y2 = getattr(torch.nn.functional, f"max_pool{nd}d")(xp, k, s, 0, d)
        return y2 if y2.shape == y.shape else y


class _ForwardAdjoint(torch.autograd.Function):
    """torch's interpolation forward; backward: the exact adjoint of that forward, from
    its matrix on one plane (the forward of the plane's unit vectors). torch's own
    backward is not the adjoint of its forward for some scales where an output size
    equals the input's: nearest (3-D, scale 4/3: the forward reads entry 0 twice, the
    backward hands back the identity) and bicubic without align_corners (scale 1.1 on 3
    entries: off by 0.4; a fuzz of the periodic call check found it, gpudist's gradient
    being the adjoint)."""

    @staticmethod
    def forward(ctx, x, up):  # type: ignore[override]
        y = up(x)
        m = math.prod(x.shape[2:])
        basis = torch.eye(m, dtype=x.dtype).reshape((m, 1) + tuple(x.shape[2:]))
        ctx.J, ctx.shape = up(basis).reshape(m, -1), x.shape  # row j: unit vector j's image
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        n = math.prod(ctx.shape[:2])
        return (dy.reshape(n, -1) @ ctx.J.T).reshape(ctx.shape), None


class _AdjointRef(torch.nn.Module):
    """torch.nn.Upsample with the adjoint of its forward as backward (nearest modes and
    bicubic, see :class:`_ForwardAdjoint`)."""

    def __init__(self, up: torch.nn.Upsample) -> None:
        super().__init__()
        self.up = up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ForwardAdjoint.apply(x, self.up)


class _LossRef(torch.nn.Module):
    """The torch loss module, held outside the state (its weight buffers are options)."""

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = [loss]

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.loss[0](x, t)


def _loss_opts(cfg: dict) -> dict:
    """The loss's options, tensor options (given by shape) made from the seed."""
    opts = dict(cfg["opts"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 11)
    for key in ("weight", "pos_weight"):
        if key in opts:
            opts[key] = 0.25 + torch.rand(tuple(opts[key]), generator=gen, dtype=F64)
    return opts


def _target(cfg: dict, call: int) -> torch.Tensor:
    """The loss's global target for ``call``."""
    g = tuple(cfg["gshapes"][call])
    gen = torch.Generator().manual_seed(cfg["seed"] + 300 + call)
    name = cfg["loss"]
    if name in ("nll", "cross_entropy"):
        if cfg.get("probs"):
            return torch.softmax(torch.randn(g, generator=gen, dtype=F64), 1)
        t = torch.randint(0, g[1], g[:1] + g[2:], generator=gen)
        ignore = cfg["opts"].get("ignore_index", -100)
        if ignore >= g[1]:  # outside the classes: only as an ignored target
            t.view(-1)[::3] = ignore
        return t
    if name in ("bce", "bce_with_logits") or name == "kl_div" and \
            not cfg["opts"]["log_target"]:
        return torch.rand(g, generator=gen, dtype=F64)
    if name == "poisson_nll":
        return torch.poisson(3 * torch.rand(g, generator=gen, dtype=F64), generator=gen)
    return torch.randn(g, generator=gen, dtype=F64)


def torch_layer(cfg: dict) -> torch.nn.Module:
    """The sequential layer (built from the current RNG state)."""
    kind = cfg["kind"]
    if kind == "chconv":
        if cfg["transposed"]:
            cls = getattr(torch.nn, f"ConvTranspose{cfg['nd']}d")
            return cls(cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                       _t(cfg["q"]), cfg["groups"], cfg["bias"], _t(cfg["d"]), dtype=F64)
        cls = getattr(torch.nn, f"Conv{cfg['nd']}d")
        return cls(cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                   _t(cfg["d"]), cfg["groups"], cfg["bias"], cfg["mode"], dtype=F64)
    if kind == "experts":
        return _ExpertsRef(cfg["E"], cfg["fin"], cfg["fout"], cfg["bias"])
    if kind == "transpose":
        return torch.nn.Identity()  # the global tensor is unchanged
    if kind == "loss":
        cls = getattr(torch.nn, LOSS_NAMES[cfg["loss"]])
        return _LossRef(cls(reduction=cfg["reduction"], **_loss_opts(cfg)))
    if kind == "conv":
        cls = getattr(torch.nn, f"Conv{cfg['nd']}d")
        return cls(cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                   _t(cfg["d"]), cfg["groups"], cfg["bias"], dtype=F64)
    if kind == "convt":
        cls = getattr(torch.nn, f"ConvTranspose{cfg['nd']}d")
        return cls(cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                   _t(cfg["q"]), cfg["groups"], cfg["bias"], _t(cfg["d"]), dtype=F64)
    if kind == "maxpool":
        return _MaxPoolRef(cfg["nd"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]), _t(cfg["d"]),
                           cfg["ceil"])
    if kind == "avgpool":
        return getattr(torch.nn, f"AvgPool{cfg['nd']}d")(
            _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]), cfg["ceil"], cfg["cip"])
    if kind == "upsample":
        up = torch.nn.Upsample(_t(cfg["size"]), _t(cfg["scale"]), cfg["mode"], cfg["align"],
                               cfg["recompute"])
        return _AdjointRef(up) if cfg["mode"] in ("nearest", "nearest-exact", "bicubic") \
            else up
    if kind == "bn":
        nd = len(cfg["gshapes"][0])
        cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
               5: torch.nn.BatchNorm3d}[nd]
        return cls(cfg["C"], momentum=cfg["momentum"], affine=cfg["affine"],
                   track_running_stats=cfg["track"], dtype=F64)
    if kind == "linear":
        return torch.nn.Linear(cfg["fin"], cfg["fout"], cfg["bias"], dtype=F64)
    if kind in ("ln", "lnz", "rmsz"):
        shape = tuple(cfg["gshapes"][0][-cfg["k"]:])
        if kind == "rmsz":
            return torch.nn.RMSNorm(shape, cfg["eps"], cfg["affine"], dtype=F64)
        return torch.nn.LayerNorm(shape, cfg["eps"], cfg["affine"], cfg["bias"], dtype=F64)
    if kind in ("emb", "embz"):
        return torch.nn.Embedding(cfg["num"], cfg["dim"], cfg["padding_idx"], cfg["max_norm"],
                                  cfg["norm_type"], cfg["sgbf"], dtype=F64)
    return torch.nn.Linear(cfg["fin"], cfg["fout"], cfg["bias"], dtype=F64)


def dist_layer(cfg: dict):
    """(distributed layer, its input partition), built from the current RNG state."""
    kind = cfg["kind"]
    if kind == "chconv":
        P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
        form = "AllGather" if cfg["form"] == "ag" else "ReduceScatter"
        if cfg["transposed"]:
            cls = getattr(gnn, f"DistributedChannel{form}ConvTranspose{cfg['nd']}d")
            return cls(P_x, cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                       _t(cfg["q"]), cfg["groups"], cfg["bias"], _t(cfg["d"]),
                       dtype=F64), P_x
        cls = getattr(gnn, f"DistributedChannel{form}Conv{cfg['nd']}d")
        return cls(P_x, cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                   _t(cfg["d"]), cfg["groups"], cfg["bias"], cfg["mode"], dtype=F64), P_x
    if kind == "experts":
        P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
        cls = {"eag": gnn.DistributedExpertAllGather, "ers": gnn.DistributedExpertReduceScatter,
               "eagz": gnn.DistributedExpertAllGatherZero,
               "ersz": gnn.DistributedExpertReduceScatterZero}[cfg["form"]]
        return cls(P_x, cfg["E"], cfg["fin"], cfg["fout"], cfg["bias"], dim=cfg["dim"],
                   dtype=F64), P_x
    if kind == "transpose":
        P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
        out = cfg["out"]
        P_out = gnn.transposed_partition(P_x, out["a"], out["b"]) if "a" in out else \
            Partition(out["ranks"], out["shape"])
        return gnn.DistributedTranspose(P_x, P_out), P_x
    if kind == "loss":
        P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
        cls = getattr(gnn, "Distributed" + LOSS_NAMES[cfg["loss"]])
        return cls(P_x, cfg["reduction"], **_loss_opts(cfg)), P_x
    if kind in ("conv", "convt"):
        P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
        kw = {"dtype": F64}
        if cfg["form"] == "general":
            kw["P_w"] = Partition(cfg["w_ranks"], cfg["w_shape"])
            if cfg["y_ranks"] is not None:
                kw["P_y"] = Partition(cfg["y_ranks"], cfg["y_shape"])
        if kind == "conv":
            cls = getattr(gnn, f"DistributedConv{cfg['nd']}d")
            layer = cls(P_x, cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]),
                        _t(cfg["p"]), _t(cfg["d"]), cfg["groups"], cfg["bias"], **kw)
            layer.boundary_strips = cfg["index"] % 2 == 1  # both local forms (no RNG draw)
            return layer, P_x
        cls = getattr(gnn, f"DistributedConvTranspose{cfg['nd']}d")
        return cls(P_x, cfg["cin"], cfg["cout"], _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]),
                   _t(cfg["q"]), cfg["groups"], cfg["bias"], _t(cfg["d"]), **kw), P_x
    if kind in ("emb", "embz"):
        P = Partition(cfg["p_ranks"], cfg["p_shape"])
        cls = gnn.DistributedEmbedding if kind == "emb" else gnn.DistributedEmbeddingZero
        layer = cls(P, cfg["num"], cfg["dim"], cfg["padding_idx"], cfg["max_norm"],
                    cfg["norm_type"], cfg["sgbf"], dtype=F64)
        return layer, layer.P_x
    if kind == "linear":
        P_w = Partition(cfg["w_ranks"], cfg["w_shape"])
        P_x = Partition(cfg["x_ranks"], (1, cfg["w_shape"][1]))
        P_y = Partition(cfg["y_ranks"], (1, cfg["w_shape"][0]))
        return gnn.DistributedLinear(P_x, P_y, P_w, cfg["fin"], cfg["fout"], cfg["bias"],
                                     dtype=F64), P_x
    P_x = Partition(cfg["x_ranks"], cfg["x_shape"])
    if kind == "maxpool":
        return getattr(gnn, f"DistributedMaxPool{cfg['nd']}d")(
            P_x, _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]), _t(cfg["d"]),
            ceil_mode=cfg["ceil"]), P_x
    if kind == "avgpool":
        return getattr(gnn, f"DistributedAvgPool{cfg['nd']}d")(
            P_x, _t(cfg["k"]), _t(cfg["s"]), _t(cfg["p"]), cfg["ceil"], cfg["cip"]), P_x
    if kind == "upsample":
        return gnn.DistributedUpsample(P_x, _t(cfg["size"]), _t(cfg["scale"]), cfg["mode"],
                                       cfg["align"], cfg["recompute"]), P_x
    if kind == "bn":
        return gnn.DistributedBatchNorm(P_x, cfg["C"], momentum=cfg["momentum"],
                                        affine=cfg["affine"], track_running_stats=cfg["track"],
                                        dtype=F64), P_x
    if kind in ("ln", "lnz", "rmsz"):
        shape = tuple(cfg["gshapes"][0][-cfg["k"]:])
        if kind == "rmsz":
            return gnn.DistributedRMSNormZero(P_x, shape, cfg["eps"], cfg["affine"],
                                              dtype=F64), P_x
        cls = gnn.DistributedLayerNorm if kind == "ln" else gnn.DistributedLayerNormZero
        return cls(P_x, shape, cfg["eps"], cfg["affine"], cfg["bias"], dtype=F64), P_x
    cls = {"ag": gnn.DistributedLinearAllGather, "rs": gnn.DistributedLinearReduceScatter,
           "agz": gnn.DistributedLinearAllGatherZero,
           "rsz": gnn.DistributedLinearReduceScatterZero}[kind]
    return cls(P_x, cfg["fin"], cfg["fout"], cfg["bias"], dim=cfg["dim"], dtype=F64), P_x


def _input(cfg: dict, call: int) -> torch.Tensor:
    g = tuple(cfg["gshapes"][call])
    if cfg["kind"] in ("emb", "embz"):
        gen = torch.Generator().manual_seed(cfg["seed"] + 100 + call)
        return torch.randint(0, cfg["num"], g, generator=gen)
    G = global_tensor(g, seed=cfg["seed"] + 100 + call)
    if cfg["kind"] == "loss" and cfg["loss"] == "bce":
        return torch.sigmoid(G)  # probabilities
    if cfg["kind"] == "loss" and cfg["loss"] == "poisson_nll" and not cfg["opts"]["log_input"]:
        return G.abs() + 0.1  # rates
    return G


def _perturb(cfg: dict, seq: torch.nn.Module) -> None:
    """Move the parameters and running statistics off their (often constant) init."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 7)
    with torch.no_grad():
        for name, t in seq.state_dict().items():
            if not t.is_floating_point():
                continue
            r = torch.rand(t.shape, generator=gen, dtype=t.dtype)
            if name == "running_var":
                t.copy_(0.5 + r)
            elif name == "weight" and cfg["kind"] in ("emb", "embz"):
                t.add_(r - 0.5)
                if cfg["padding_idx"] is not None:
                    t[cfg["padding_idx"]] = 0
            else:
                t.add_(r - 0.5)


# =========================================================================== torch side
def torch_run(cfg: dict) -> dict:
    """The sequential reference: {init, sd, calls: [{y, dx}], grads, state, error}."""
    out: dict = {"calls": [], "error": None}
    stage = "construct"
    try:
        torch.manual_seed(cfg["seed"])
        seq = torch_layer(cfg)
        out["init"] = {k: v.clone() for k, v in seq.state_dict().items()}
        _perturb(cfg, seq)
        out["sd"] = {k: v.clone() for k, v in seq.state_dict().items()}
        if cfg.get("training") is False:
            seq.eval()
        for call in range(len(cfg["gshapes"])):
            stage = f"call{call}"
            G = _input(cfg, call)
            x = G.clone().requires_grad_(G.is_floating_point())
            Y = seq(x, _target(cfg, call)) if cfg["kind"] == "loss" else seq(x)
            dY = global_tensor(Y.shape, seed=cfg["seed"] + 200 + call)
            Y.backward(dY)
            out["calls"].append({"y": Y.detach().clone(), "dx": x.grad.clone()
                                 if x.grad is not None else None})
        stage = "final"
        out["grads"] = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                        for k, p in seq.named_parameters()}
        out["state"] = {k: v.clone() for k, v in seq.state_dict().items()}
    except Exception as e:  # torch rejects the configuration
        out["error"] = (stage, type(e).__name__, str(e).splitlines()[0][:300])
    return out


# =========================================================================== rank side
def _np(obj):
    """Tensors as numpy arrays (MPI ranks are no children of this process: torch's
    shared-memory pickling of tensors does not reach them)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _np(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_np(v) for v in obj]
    return obj


def _torch(obj):
    if hasattr(obj, "__array__") and not isinstance(obj, (dict, list, str)):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_torch(v) for v in obj]
    return obj


def _out_partition(cfg: dict, layer, P_x: Partition) -> tuple[Partition, Partition]:
    """(the partition of the output, of a loss's target) on every rank."""
    kind = cfg["kind"]
    if kind == "transpose":
        return layer.P_out, P_x
    if kind == "loss":
        P_t = P_x
        if cfg["loss"] in ("nll", "cross_entropy"):  # the input's without the class dim
            # (None where the class dim is split: each rank the input block's rows,
            # the same along the class axis, as a plain tensor)
            P_t = Partition(P_x.ranks, P_x.shape[:1] + P_x.shape[2:]) \
                if P_x.shape[1] == 1 else None
        return (P_t if cfg["reduction"] == "none" else P_x), \
            (P_x if cfg.get("probs") else P_t)
    P_y = getattr(layer, "P_y", None)
    return (layer.P_x if P_y is None else P_y), P_x


def rank_run(cfg: dict, sd: dict | None, yshapes: list) -> dict:
    """On every rank: build, load ``sd``, run the calls (forward, backward, gathers)."""
    out: dict = {"calls": [], "error": None}
    stage = "construct"
    sd = _torch(sd)
    try:
        torch.manual_seed(cfg["seed"])
        layer, P_x = dist_layer(cfg)
        stage = "init"
        params = hasattr(layer, "global_state_dict")
        if params:
            init = layer.global_state_dict()
            if init:  # a copy: the root's collected state may be the live tensors
                out["init"] = {k: v.clone() for k, v in init.items()}
            if sd is not None:
                layer.load_global_state_dict(sd)
        if cfg.get("training") is False:
            layer.eval()
        P_y, P_t = _out_partition(cfg, layer, P_x)
        # a reduced loss: a 0-dim tensor on every rank (the value on the root's)
        scalar = cfg["kind"] == "loss" and cfg["reduction"] != "none"
        for call in range(len(cfg["gshapes"])):
            stage = f"call{call}"
            res: dict = {}
            gshape = tuple(cfg["gshapes"][call])
            G = _input(cfg, call)
            x = block_of(G, P_x)
            if x.is_floating_point():
                x.requires_grad_(True)
            xin = DistTensor.from_local(x, P_x, gshape) if cfg["dist"] else x
            if cfg["kind"] == "loss":
                T = _target(cfg, call)
                if P_t is None:  # class indices, the class dim split
                    t = T[:0]
                    if P_x.active:
                        sl = Decomposition(gshape, P_x.shape).global_slices(P_x.coords)
                        t = T[(sl[0],) + sl[2:]].clone()
                    y = layer(xin, t)
                else:
                    t = block_of(T, P_t)
                    y = layer(xin, DistTensor.from_local(t, P_t, tuple(T.shape))
                              if cfg["dist"] else t)
            else:
                y = layer(xin)
            ysh = yshapes[call] if call < len(yshapes) else None
            if isinstance(y, DistTensor):
                res["where"] = [list(y.partition.ranks), list(y.partition.shape),
                                list(y.shape)]
                y = y.local
            elif not cfg["dist"] and isinstance(y, torch.Tensor):
                res["where"] = "plain"
            if scalar:
                if y.dim() != 0:
                    res["scalar"] = f"a loss of shape {tuple(y.shape)}"
                elif not layer.root.active and float(y.detach()) != 0:
                    res["scalar"] = f"a loss {float(y.detach())} off the root"
            elif not P_y.active:
                res["inactive_numel"] = y.numel()
            if ysh is None:  # torch rejected this call: gpudist should have too
                dy = torch.zeros_like(y)
            elif scalar:  # every rank calls backward with the same seed
                dy = global_tensor(ysh, seed=cfg["seed"] + 200 + call)
            elif P_y.active:
                dy = block_of(global_tensor(ysh, seed=cfg["seed"] + 200 + call), P_y)
            else:
                dy = zero_volume(y.dim(), like=y)
            stage = f"call{call}.backward"
            if y.requires_grad:
                y.backward(dy)
            if ysh is None:
                out["calls"].append(res)
                continue
            stage = f"call{call}.gather"
            if scalar:
                if layer.root.active:
                    res["y"] = y.detach().clone()
            else:
                yg, root = gather(y.detach(), P_y, ysh)
                if root.active:
                    res["y"] = yg
            if x.is_floating_point():
                dx = x.grad if x.grad is not None else torch.zeros_like(x)
                dxg, rootx = gather(dx, P_x, gshape)
                if rootx.active:
                    res["dx"] = dxg
            out["calls"].append(res)
        stage = "final"
        if params:
            grads = layer.global_grads()
            if grads:
                out["grads"] = grads
            state = layer.global_state_dict()
            if state:
                out["state"] = state
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        out["error"] = (stage, type(e).__name__, str(e), "\n".join(tb[-6:]))
    return _np(out)


# =========================================================================== the verdict
_CLUSTER: list = []


def _cluster() -> Cluster:
    if not _CLUSTER:
        _CLUSTER.append(Cluster(timeout=COMM_TIMEOUT))
    return _CLUSTER[0]


def _stage_index(stage: str) -> int:
    if stage == "construct":
        return -2
    if stage == "init":
        return -1
    if stage == "final":
        return 10**6
    return int(stage[4:].split(".")[0])


def _agreed(errors: list) -> bool:
    """Every rank raised the same error, of a type that is a refusal (not a peer's)."""
    e0 = errors[0]
    return all(e is not None for e in errors) and e0[1].endswith("Error") and \
        e0[1] not in NOT_AGREED and all(e[1:3] == e0[1:3] for e in errors)


def _one(outs: list, pick) -> list:
    """The values ``pick`` finds in the ranks' results (normally on one root rank)."""
    vals = [v for o in outs if (v := pick(o)) is not None]
    return vals


def _compare(ref: dict, outs: list, upto: int) -> list[str]:
    """Mismatches of the first ``upto`` calls (and the final state if all ran)."""
    bad = []
    init = _one(outs, lambda o: o.get("init"))
    built = all(o["error"] is None or o["error"][0] != "construct" for o in outs)
    if ref.get("init") and built and len(init) != 1:
        bad.append(f"seeded init on {len(init)} ranks")
    for d in init[:1] if ref.get("init") else []:
        if set(d) != set(ref["init"]):
            bad.append(f"init keys {sorted(d)} != {sorted(ref['init'])}")
        else:
            bad += [f"init {k}: {e:.3g}" for k in d
                    if (e := maxerr(d[k].double(), ref["init"][k].double())) > TOL]
    for c in range(upto):
        want = ref["calls"][c]
        for key in ("y", "dx"):
            if want[key] is None:
                continue
            got = _one(outs, lambda o, key=key, c=c: o["calls"][c].get(key))
            if len(got) != 1:
                bad.append(f"call{c} {key} on {len(got)} ranks")
                continue
            if tuple(got[0].shape) != tuple(want[key].shape):
                bad.append(f"call{c} {key} shape {tuple(got[0].shape)} != "
                           f"{tuple(want[key].shape)}")
            elif (e := maxerr(got[0], want[key])) > TOL:
                bad.append(f"call{c} {key} err {e:.3g}")
        for r, o in enumerate(outs):
            res = o["calls"][c]
            if res.get("inactive_numel"):
                bad.append(f"call{c} rank {r} outside P_y returned {res['inactive_numel']} "
                           f"entries")
            w = res.get("where")
            if w is not None and w != "plain" and list(w[2]) != list(want["y"].shape):
                bad.append(f"call{c} rank {r}: DistTensor out of global shape {w[2]}")
            if res.get("scalar"):
                bad.append(f"call{c} rank {r}: {res['scalar']}")
    if upto < len(ref["calls"]) or "grads" not in ref:
        return bad
    for what in ("grads", "state"):
        want = ref[what]
        got = _one(outs, lambda o, what=what: o.get(what))
        if not want:
            continue
        if len(got) != 1:
            bad.append(f"{what} on {len(got)} ranks")
            continue
        if set(got[0]) != set(want):
            bad.append(f"{what} keys {sorted(got[0])} != {sorted(want)}")
            continue
        for k in want:
            e = maxerr(got[0][k].double(), want[k].double())
            if e > TOL:
                bad.append(f"{what} {k} err {e:.3g}")
    return bad


def _run_config(cfg: dict) -> tuple[str, str]:
    """(outcome, detail): outcome in equal / both refuse / gpudist refuses / FAIL."""
    ref = torch_run(cfg)
    yshapes = [list(c["y"].shape) for c in ref["calls"]]
    try:
        outs = _cluster().run(cfg["n"], rank_run, cfg, _np(ref.get("sd")), yshapes,
                              backend=cfg["backend"], timeout=RUN_TIMEOUT)
    except TimeoutError as e:
        return "FAIL", f"hang: {e}"
    except RankFailure as e:
        return "FAIL", f"crash: {e}"
    outs = _torch(outs)
    errors = [o["error"] for o in outs]
    failed = [r for r, e in enumerate(errors) if e is not None]

    def errtext():
        return "; ".join(f"rank {r} [{errors[r][0]}] {errors[r][1]}: {errors[r][2][:400]}"
                         for r in failed)

    terr = ref["error"]
    if failed and not _agreed(errors):
        own = [r for r in failed if errors[r][1] not in NOT_AGREED] or failed
        tail = f"(rank {own[0]})\n" + errors[own[0]][3]
        return "FAIL", (f"errors on ranks {failed} of {cfg['n']} (torch: {terr}): "
                        f"{errtext()}\n  first traceback tail:\n{tail}")
    if terr is not None:
        tstage = _stage_index(terr[0])
        if not failed:
            return "FAIL", f"gpudist accepted what torch rejects: torch {terr}"
        gstage = _stage_index(errors[0][0])
        if gstage > tstage:
            return "FAIL", f"gpudist accepted a call torch rejects: torch {terr}; {errtext()}"
        bad = _compare(ref, outs, max(gstage, 0))
        if bad:
            return "FAIL", "wrong results before the refusal: " + "; ".join(bad)
        return "both refuse", f"torch {terr[1]}: {terr[2]} | gpudist {errors[0][1]}: " \
                              f"{errors[0][2]}"
    if failed:
        gstage = _stage_index(errors[0][0])
        bad = _compare(ref, outs, max(gstage, 0))
        if bad:
            return "FAIL", "wrong results before the refusal: " + "; ".join(bad)
        return "gpudist refuses", f"[{errors[0][0]}] {errors[0][1]}: {errors[0][2]}"
    bad = _compare(ref, outs, len(ref["calls"]))
    if bad:
        return "FAIL", "wrong result: " + "; ".join(bad)
    return "equal", ""


CHUNKS = [list(range(i, min(i + CHUNK, N))) for i in range(0, N, CHUNK)]


@pytest.fixture(scope="module", autouse=True)
def _close_cluster():
    yield
    if _CLUSTER:
        _CLUSTER.pop().close()


@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"seed{SEED}-cfg{c[0]}-{c[-1]}")
def test_fuzz_against_torch(chunk):
    failures, counts = [], {}
    for i in chunk:
        cfg = make_config(SEED, i)
        outcome, detail = _run_config(cfg)
        counts[outcome] = counts.get(outcome, 0) + 1
        line = json.dumps(cfg)
        if outcome == "gpudist refuses":
            print(f"gpudist refuses {line}\n    {detail}")
        if outcome == "FAIL":
            failures.append(f"{line}\n    {detail}")
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(json.dumps({"seed": SEED, "cfg": cfg, "outcome": outcome,
                                    "detail": detail}) + "\n")
    print(f"seed {SEED} configs {chunk[0]}-{chunk[-1]}: {counts}")
    assert not failures, f"{len(failures)} of {len(chunk)} configurations failed " \
                         f"(seed {SEED}):\n" + "\n".join(failures)
