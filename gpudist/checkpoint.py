"""gpudist inside ``torch.utils.checkpoint(..., use_reentrant=False)``.

That form of activation checkpointing runs the region once without keeping what its ops
save for backward, and recomputes the region when backward first unpacks one of the saved
tensors. A distributed region recomputes its collectives, so every rank taking part in
one must recompute at the same point of its backward, and recompute the same operators:

- **where**: every gpudist autograd node recorded in a region saves a marker (an empty
  tensor) and unpacks it before its adjoint communicates, so a rank recomputes no later
  than its first adjoint in the region. Every operator in a region records (a block that
  requires no grad is anchored: :func:`mark` requires grad, a layer's input is made to
  by :func:`anchor`), so each rank that communicates there has a node to unpack; torch
  orders backward by the nodes' creation, so ops outside the region keep their places on
  every rank.
- **what**: the region's early stop (recompute only until the last saved tensor) is
  turned off for a region holding a gpudist operator: a rank whose last saved tensor comes
  before a peer's would leave its collectives after that point out.

Ranks must checkpoint alike: a layer's or primitive's call check compares it (a bit of
the grad state). Ops inside the region under ``torch.no_grad`` run their collectives in
the forward and the recomputation alike on every rank that recomputes.

A side effect: inside a region an operator's output requires grad even where nothing
feeding it does (the anchor), as a region's output would where any parameter does.
"""

from __future__ import annotations

import torch

from .meta import CHECKPOINT_BIT

#: the innermost saved-tensor hooks (pack, unpack), or None: ``top_hooks(False)``
top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                    lambda ignore_disabled: None)
_MODULE = "torch.utils.checkpoint"


def region() -> int:
    """:data:`~gpudist.meta.CHECKPOINT_BIT` where this call runs inside a non-reentrant
    checkpoint region (its forward or its recomputation) under grad mode, else 0. In the
    forward the region's early stop is turned off (see the module docstring). ~0.1 us."""
    hooks = top_hooks(False)
    if hooks is None or not torch.is_grad_enabled():
        return 0
    pack = hooks[0]
    if getattr(pack, "__module__", "") != _MODULE:
        return 0
    pack = getattr(pack, "__wrapped__", pack)  # (the recomputation's is dynamo-disabled)
    code = getattr(pack, "__code__", None)
    names = code.co_freevars if code is not None else ()
    if "frame" in names:  # the region's forward (_checkpoint_hook's pack hook)
        frame = pack.__closure__[names.index("frame")].cell_contents
        if getattr(frame, "early_stop", None) is not False:
            frame.early_stop = False
    elif "target_frame_ref" not in names:  # neither form: a torch this was not made for
        raise RuntimeError(
            "gpudist: torch.utils.checkpoint(..., use_reentrant=False) of this torch "
            f"version ({torch.__version__}) is not supported (its hooks are not the ones "
            "gpudist knows); use use_reentrant=True")
    return CHECKPOINT_BIT


def mark(like: torch.Tensor) -> torch.Tensor:
    """The marker a node recorded in a region saves: an empty leaf that requires grad
    (so the node is recorded even where the block requires none), on ``like``'s device."""
    return torch.empty(0, dtype=like.dtype if like.is_floating_point() else torch.float32,
                       device=like.device, requires_grad=True)


class _Anchor(torch.autograd.Function):
    """Identity on ``x``, recorded because ``m`` requires grad; no gradient goes back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, m: torch.Tensor):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return None, None


def anchor(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a block that requires grad (a layer's input inside a region), where it is
    a floating-point block that does not yet; else ``x``."""
    if x.requires_grad or not (x.is_floating_point() or x.is_complex()):
        return x
    return _Anchor.apply(x, mark(x))
