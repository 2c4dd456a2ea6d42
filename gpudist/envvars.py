"""The ``GPUDIST_*`` environment variables, read one way: a value that is not one of the
accepted forms is a :class:`~gpudist.errors.LaunchError` naming the variable and what it
takes (a bare ``ValueError`` from ``float()`` before; ``off`` turned a flag on)."""

from __future__ import annotations

import math
import os
from functools import partial

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
           maximum: float = math.inf, integer: bool = False, infinite: bool = False
           ) -> float:
    """A number at least ``minimum`` (above it if ``strict``) and at most ``maximum``,
    finite unless ``infinite`` (``inf``: never, e.g. no diagnostics); an int if
    ``integer``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        v = None
    bad = (v is None or math.isnan(v) or (math.isinf(v) and not (infinite and v > 0))
           or v < minimum or (strict and v == minimum) or (v > maximum and math.isfinite(v)))
    if bad:
        kind = "an integer" if integer else "a number"
        bound = f"above {minimum:g}" if strict else f"at least {minimum:g}"
        if maximum < math.inf:
            bound += f" and at most {maximum:g}"
        raise LaunchError(f"environment variable {name}={raw!r}: use {kind} {bound}"
                          + (" (or inf)" if infinite else ""))
    return v


def choice(name: str, default: str | None, *, choices: tuple[str, ...]) -> str | None:
    """One of ``choices`` (any case; unset or empty: ``default``)."""
    raw = os.environ.get(name)
    if not raw or not raw.strip():
        return default
    if raw.strip().lower() not in choices:
        raise LaunchError(f"environment variable {name}={raw!r}: use one of "
                          f"{', '.join(choices)}")
    return raw.strip().lower()


# every setting with its form and range (the defaults stay where each is used): read them
# through setting(); check_all() reads them all at once (gpudist.init() calls it before it
# joins anything, so a bad value stops the rank that has it there, not half-way in)
SETTINGS = {
    "GPUDIST_COMM_TIMEOUT": partial(number, minimum=1.0, maximum=1e8),
    "GPUDIST_DIAG_AFTER": partial(number, infinite=True),
    "GPUDIST_SPIN_S": partial(number, infinite=True),
    "GPUDIST_NAP_MAX_S": partial(number, maximum=1.0),
    "GPUDIST_HOT_SPIN_S": partial(number, maximum=1.0),
    "GPUDIST_PLAN_CACHE": partial(number, minimum=1, integer=True),
    "GPUDIST_EXIT_TEARDOWN_S": partial(number, minimum=1, maximum=86400, integer=True),
    "GPUDIST_CHECK_CALLS": flag,
    "GPUDIST_CHECK_EVERY": partial(number, minimum=0, maximum=1 << 40, integer=True),
    "GPUDIST_FORCE_STAGING": flag,
    "GPUDIST_MPI_PERSISTENT": flag,
    "GPUDIST_MPI_CUDA_AWARE": flag,
    "GPUDIST_PACKER_AUTOTUNE": flag,
    "GPUDIST_PACKER": partial(choice, choices=("torch", "numba", "cupy")),
    "GPUDIST_GLOO_WAIT": partial(choice, choices=("auto", "block", "nap")),
}


def setting(name: str, default):
    """The value of setting ``name`` (``default`` where it is not set)."""
    return SETTINGS[name](name, default)


def check_all() -> None:
    """Read every setting above: a bad value raises its LaunchError here."""
    for name, read in SETTINGS.items():
        read(name, None)
