"""The adjoint (dot-product) test, usable on any distributed linear operator.

For a linear F applied by every rank to its local block x (zero-volume where inactive),

    mismatch = |<F x, y> - <x, F* y>| / max(||F x|| ||y||, ||x|| ||F* y||)

with inner products and norms summed over all workers in float64. F* y is what autograd
computes as the vector-Jacobian product, i.e. the hand-written adjoint under test.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime import World, require_world
from ..spec import DistTensor

_SUMS_FP = 0x41444A54  # the global sums' fingerprint in the operator history


def _global_sum(values: list[float], world: World) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world.size > 1:
        dev = "cuda" if world.backend == "nccl" else "cpu"
        t = t.to(dev)
        tr, ranks = world.transport, tuple(range(world.size))
        # numbered as an operator of the world, so that a rank left alone here (a peer
        # that failed, or finished its task) is told within seconds, as in a primitive
        with world.control.op(ranks, "the adjoint test's global sums", _SUMS_FP):
            tr.wait([tr.all_reduce(t, tr.group(ranks))], "the adjoint test's global sums")
    return t.cpu().tolist()


def _plain(t):
    return t.local if isinstance(t, DistTensor) else t


def _with_local(like, t: torch.Tensor):
    """``t`` in the form of ``like`` (a DistTensor with ``like``'s spec, or plain)."""
    return DistTensor(t, like.spec, check=False) if isinstance(like, DistTensor) else t


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Re <a, b> (the real inner product; for complex blocks the real part of
    sum(conj(a) * b), under which autograd's backward of a linear map is its adjoint)."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    if a.is_complex() or b.is_complex():
        return float((a.to(torch.complex128).conj() * b.to(torch.complex128)).real.sum())
    return float((a.to(torch.float64) * b.to(torch.float64)).sum())


def adjoint_mismatch(
    op: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    world: World | None = None,
    seed: int | None = None,
) -> float:
    """Relative adjoint mismatch of the linear map ``op`` at random ``x`` and ``y``.

    ``x`` is this rank's input block; ``y`` (default: random, shaped like ``op(x)``) is this
    rank's output-space block. Collective over the world; every rank gets the same value.
    """
    w = require_world(world)
    xl = _plain(x).detach().clone().requires_grad_(True)
    fx = _plain(op(_with_local(x, xl)))
    x = xl
    if y is None:
        g = torch.Generator().manual_seed((seed or 0) * 7919 + w.rank)
        wide = torch.complex128 if fx.is_complex() else torch.float64
        y = torch.randn(fx.shape, generator=g, dtype=wide).to(fx.dtype).to(fx.device)
    if fx.shape != y.shape:
        raise ValueError(f"y has shape {tuple(y.shape)} but F(x) has {tuple(fx.shape)}")
    fty = None
    if fx.requires_grad:  # not on ranks outside the operator (nothing to differentiate)
        (fty,) = torch.autograd.grad(fx, x, grad_outputs=y, allow_unused=True)
    if fty is None:
        fty = torch.zeros_like(x)
    fx_y, x_fty, nfx, ny, nx, nfty = _global_sum(
        [_dot(fx, y), _dot(x, fty), _dot(fx, fx), _dot(y, y), _dot(x, x), _dot(fty, fty)], w
    )
    scale = max((nfx * ny) ** 0.5, (nx * nfty) ** 0.5)
    if scale == 0.0:
        return 0.0
    return abs(fx_y - x_fty) / scale


def jacobian_adjoint_mismatch(
    op: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    v: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    world: World | None = None,
    seed: int | None = None,
) -> float:
    """Adjoint mismatch of the Jacobian J of a (possibly nonlinear) ``op`` at ``x0``.

    J v comes from central differences (op(x0 + eps v) - op(x0 - eps v)) / (2 eps), J* y from
    autograd at ``x0`` (the hand-written adjoints under test), so the result also checks that
    backward is the derivative of forward. Use float64; the finite difference limits the
    attainable mismatch to about eps**2 (smooth ops) or round-off (piecewise-linear ones).
    Collective over the world.
    """
    w = require_world(world)
    like, x0 = x0, _plain(x0)
    g = torch.Generator().manual_seed((seed or 0) * 7919 + w.rank + 1)
    if v is None:
        v = torch.randn(x0.shape, generator=g, dtype=torch.float64).to(x0)
    x = x0.detach().clone().requires_grad_(True)
    fx = _plain(op(_with_local(like, x)))
    if y is None:
        y = torch.randn(fx.shape, generator=g, dtype=torch.float64).to(fx)
    jty = None
    if fx.requires_grad:
        (jty,) = torch.autograd.grad(fx, x, grad_outputs=y, allow_unused=True)
    if jty is None:
        jty = torch.zeros_like(x)
    with torch.no_grad():
        jv = (_plain(op(_with_local(like, x0.detach() + eps * v)))
              - _plain(op(_with_local(like, x0.detach() - eps * v)))) / (2 * eps)
    jv_y, v_jty, njv, ny, nv, njty = _global_sum(
        [_dot(jv, y), _dot(v, jty), _dot(jv, jv), _dot(y, y), _dot(v, v), _dot(jty, jty)], w
    )
    scale = max((njv * ny) ** 0.5, (nv * njty) ** 0.5)
    return 0.0 if scale == 0.0 else abs(jv_y - v_jty) / scale


def assert_adjoint(op, x, y=None, *, tol: float | None = None, **kw) -> float:
    """Raise AssertionError if the mismatch exceeds ``tol`` (default by dtype)."""
    if tol is None:
        tol = {torch.float64: 1e-13, torch.float32: 1e-5}.get(x.dtype, 1e-2)
    m = adjoint_mismatch(op, x, y, **kw)
    if not m <= tol:
        raise AssertionError(f"adjoint mismatch {m:.3e} exceeds {tol:.1e}")
    return m
