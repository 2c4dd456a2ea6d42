"""``python -m gpudist.halo``: print the halo geometry of a 1-D layout.

Example::

    python -m gpudist.halo --size 20 --workers 6 --kernel 2 --stride 2 --draw
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import HaloError
from .geometry import HaloGeometry, WorkerHalo

LEGEND = ("legend: '#' bulk used, 'x' bulk trimmed (extra), 'h' halo from a neighbour, "
          "'p' global padding, 'o' root of an output window")


def _rng(iv: tuple[int, int]) -> str:
    return f"{iv[0]}..{iv[1] - 1}" if iv[1] > iv[0] else "-"


def table(geo: HaloGeometry) -> str:
    """A text table, one row per worker."""
    head = ["worker", "outputs", "out range", "inputs", "bulk", "reads", "halo L", "halo R",
            "extra L", "extra R", "pad L", "pad R"]
    rows = []
    for w in geo.per_worker:
        r = w.reads
        rows.append([str(w.index), str(w.n_outputs), _rng(w.outputs), str(w.n_inputs),
                     _rng(w.bulk), f"{r[0]}..{r[1]}" if r else "-", str(w.left_halo),
                     str(w.right_halo), str(w.left_extra), str(w.right_extra),
                     str(w.pad_left), str(w.pad_right)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(wd) for h, wd in zip(head, widths))]
    lines.append("  ".join("-" * wd for wd in widths))
    lines += ["  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _cells(geo: HaloGeometry, w: WorkerHalo, lo: int, hi: int) -> tuple[str, str]:
    s, pl = geo.stride, geo.padding[0]
    inp, out = [], []
    roots = {j * s - pl for j in range(*w.outputs)}
    r = w.reads
    for i in range(lo, hi):
        if w.trimmed[0] <= i < w.trimmed[1]:
            c = "#"
        elif w.bulk[0] <= i < w.bulk[1]:
            c = "x"
        elif w.halo_left[0] <= i < w.halo_left[1] or w.halo_right[0] <= i < w.halo_right[1]:
            c = "h"
        elif r is not None and r[0] <= i <= r[1] and (i < 0 or i >= geo.size):
            c = "p"
        else:
            c = "." if 0 <= i < geo.size else " "
        inp.append(c)
        out.append("o" if i in roots else " ")
    return "".join(inp), "".join(out)


def draw(geo: HaloGeometry) -> str:
    """An ASCII picture: per worker, the global input axis and its output window roots."""
    lo, hi = -geo.padding[0], geo.size + geo.padding[1]
    label = max(len(f"worker {geo.workers - 1}"), 6)
    digits = "".join(str(abs(i) % 10) for i in range(lo, hi))
    tens = "".join("-" if i < 0 else (str(i // 10 % 10) if i >= 10 else " ") for i in range(lo, hi))
    lines = [LEGEND, "index".ljust(label) + " " + tens, " " * label + " " + digits]
    for w in geo.per_worker:
        a, b = _cells(geo, w, lo, hi)
        lines.append(f"worker {w.index}".ljust(label) + " " + a)
        lines.append(" " * label + " " + b)
    return "\n".join(lines)


def save_png(geo: HaloGeometry, path: str) -> None:  # pragma: no cover - needs matplotlib
    """The same picture as :func:`draw`, drawn with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = {"#": "#4c72b0", "x": "#dddddd", "h": "#dd8452", "p": "#c44e52"}
    lo, hi = -geo.padding[0], geo.size + geo.padding[1]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * (hi - lo) + 2), 0.6 * geo.workers + 1))
    for w in geo.per_worker:
        y = geo.workers - 1 - w.index
        a, b = _cells(geo, w, lo, hi)
        for i, (c, o) in enumerate(zip(a, b)):
            if c in colors:
                ax.add_patch(Rectangle((lo + i, y), 1, 0.6, color=colors[c], ec="k", lw=0.3))
            if o == "o":
                ax.plot(lo + i + 0.5, y + 0.3, "k.")
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.2, geo.workers)
    ax.set_yticks([geo.workers - 1 - i + 0.3 for i in range(geo.workers)])
    ax.set_yticklabels([f"worker {i}" for i in range(geo.workers)])
    ax.set_xlabel("global input index")
    ax.set_title(f"n={geo.size} P={geo.workers} k={geo.kernel} s={geo.stride} "
                 f"d={geo.dilation} pad={geo.padding}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpudist.halo",
                                 description="Halo geometry of one dimension over P workers.")
    ap.add_argument("--size", "-n", type=int, required=True, help="global input length n")
    ap.add_argument("--workers", "-P", type=int, required=True, help="number of workers P")
    ap.add_argument("--kernel", "-k", type=int, required=True, help="kernel size k")
    ap.add_argument("--stride", "-s", type=int, default=1)
    ap.add_argument("--dilation", "-d", type=int, default=1)
    ap.add_argument("--padding", "-p", type=int, nargs="+", default=[0], metavar="P",
                    help="padding: one value (both sides) or LEFT RIGHT")
    ap.add_argument("--draw", action="store_true", help="print an ASCII picture")
    ap.add_argument("--png", metavar="FILE", help="also save the picture as a PNG (matplotlib)")
    a = ap.parse_args(argv)
    if len(a.padding) > 2:
        ap.error("--padding takes one or two values")
    pad = (a.padding[0], a.padding[-1])
    try:
        geo = HaloGeometry(a.size, a.workers, a.kernel, a.stride, a.dilation, pad)
    except HaloError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"n={geo.size} P={geo.workers} kernel={geo.kernel} stride={geo.stride} "
          f"dilation={geo.dilation} padding={geo.padding} -> {geo.output_size} outputs")
    print(table(geo))
    if a.draw:
        print()
        print(draw(geo))
    if a.png:
        from pathlib import Path

        try:
            Path(a.png).parent.mkdir(parents=True, exist_ok=True)
            save_png(geo, a.png)
        except (OSError, ImportError) as e:
            print(f"error: cannot write {a.png}: {e}", file=sys.stderr)
            return 2
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
