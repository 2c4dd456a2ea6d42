"""The ``GPUDIST_*`` environment variables, read one way: a value that is not one of the
accepted forms is a :class:`~gpudist.errors.LaunchError` naming the variable and what it
takes (a bare ``ValueError`` from ``float()`` before; ``off`` turned a flag on)."""

from __future__ import annotations

import math
import os

from .errors import LaunchError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def flag(name: str, default: bool) -> bool:
    """A yes/no setting: 1/true/yes/on or 0/false/no/off (any case; empty: no)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise LaunchError(f"environment variable {name}={raw!r}: use 1/true/yes/on or "
                      f"0/false/no/off")


def number(name: str, default: float, *, minimum: float = 0.0, strict: bool = False,
           integer: bool = False) -> float:
    """A number at least ``minimum`` (above it if ``strict``), finite; an int if
    ``integer``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        v = None
    bad = v is None or not math.isfinite(v) or v < minimum or (strict and v == minimum)
    if bad:
        kind = "an integer" if integer else "a number"
        bound = f"above {minimum:g}" if strict else f"at least {minimum:g}"
        raise LaunchError(f"environment variable {name}={raw!r}: use {kind} {bound}")
    return v
