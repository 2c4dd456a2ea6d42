"""gpudist inside ``torch.utils.checkpoint(..., use_reentrant=False)``.

That form of activation checkpointing runs the region once without keeping what its ops
save for backward, and recomputes the region when backward first unpacks one of the saved
tensors. A distributed region recomputes its collectives, so every rank taking part in
one must recompute at the same point of its backward, and recompute the same operators:

- **where**: every gpudist autograd node recorded in a region saves a marker (an empty
  tensor) and unpacks it before its adjoint communicates, so a rank recomputes no later
  than its first adjoint in the region; torch orders backward by the nodes' creation, so
  operators outside the region keep their places on every rank.
- **what**: the region's early stop (recompute only until the last saved tensor) is turned
  off for a region holding a gpudist operator: a rank whose last saved tensor comes before
  a peer's would leave its collectives after that point out.
- **refused** (a ``RuntimeError`` on every rank of the operator): a call inside a region
  that communicates but records nothing for backward (a block that requires no grad and,
  for a layer, no parameter that does; an integer block; a call under ``torch.no_grad``),
  and a layer or primitive given a plain block (its shape exchange would run again in the
  recomputation of some ranks only): a rank with nothing to unpack would not recompute it
  while its peers do.

Ranks must checkpoint alike: a call's check compares it (a bit of the grad state).
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
    checkpoint region (its forward or its recomputation, whatever the grad mode), else 0.
    In the forward the region's early stop is turned off (see the module docstring).
    ~0.1 us."""
    hooks = top_hooks(False)
    if hooks is None:
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
    """The marker a node recorded in a region saves: an empty tensor on ``like``'s
    device."""
    return torch.empty(0, device=like.device)


def refusal(what: str, why: str) -> RuntimeError:
    """The error of a call a region cannot take (see the module docstring)."""
    return RuntimeError(
        f"{what}: {why} inside torch.utils.checkpoint(..., use_reentrant=False): a rank "
        f"with nothing of it to unpack in backward would not recompute its communication "
        f"while its peers do. Let the call record for backward (a block or parameter that "
        f"requires grad, a DistTensor input, grad mode on), move it out of the region, or "
        f"use use_reentrant=True")
