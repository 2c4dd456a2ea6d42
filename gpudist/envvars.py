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


def choice(name: str, choices: tuple[str, ...]) -> str | None:
    """One of ``choices`` (unset or empty: None)."""
    raw = os.environ.get(name)
    if not raw or not raw.strip():
        return None
    if raw.strip().lower() not in choices:
        raise LaunchError(f"environment variable {name}={raw!r}: use one of "
                          f"{', '.join(choices)}")
    return raw.strip().lower()


# the settings a process reads, each with its parser: check_all() reads them all at once
# (gpudist.init() calls it before it joins anything, so a bad value stops every rank that
# has it there, not half-way into the process group)
SETTINGS = {
    "GPUDIST_COMM_TIMEOUT": lambda n: number(n, 120.0, minimum=1.0, maximum=1e8),
    "GPUDIST_DIAG_AFTER": lambda n: number(n, 2.0, infinite=True),
    "GPUDIST_SPIN_S": lambda n: number(n, 0.04, infinite=True),
    "GPUDIST_NAP_MAX_S": lambda n: number(n, 1e-4, maximum=1.0),
    "GPUDIST_PLAN_CACHE": lambda n: number(n, 8, minimum=1, integer=True),
    "GPUDIST_EXIT_TEARDOWN_S": lambda n: number(n, 10, minimum=1, maximum=86400,
                                                integer=True),
    "GPUDIST_CHECK_CALLS": lambda n: flag(n, False),
    "GPUDIST_FORCE_STAGING": lambda n: flag(n, False),
    "GPUDIST_MPI_PERSISTENT": lambda n: flag(n, True),
    "GPUDIST_MPI_CUDA_AWARE": lambda n: flag(n, False),
    "GPUDIST_PACKER_AUTOTUNE": lambda n: flag(n, False),
    "GPUDIST_PACKER": lambda n: choice(n, ("torch", "numba", "cupy")),
}


def check_all() -> None:
    """Read every setting above: a bad value raises its LaunchError here."""
    for name, read in SETTINGS.items():
        read(name)
