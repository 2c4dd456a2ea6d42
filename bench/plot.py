"""Draw PNGs from the suites' CSVs: bandwidth vs size (primitives), time ratios (halo,
layers), time and efficiency vs ranks (scaling)."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def _read(p: Path) -> list[dict]:
    with p.open() as f:
        return list(csv.DictReader(f))


def plot_all(src: Path, dst: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dst.mkdir(parents=True, exist_ok=True)
    made = []
    for csvp in sorted(src.glob("*.csv")):
        rows = _read(csvp)
        if not rows:
            continue
        name = csvp.stem
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if name.startswith("primitives"):
            for prim in dict.fromkeys(r["primitive"] for r in rows):
                sel = [r for r in rows if r["primitive"] == prim and r["mode"] == "fwd"
                       and r["hint"] == "True"]
                x = [int(r["bytes"]) for r in sel]
                line, = ax.plot(x, [float(r["gpudist_busbw_GBs"]) for r in sel], "o-",
                                label=f"{prim} gpudist")
                ax.plot(x, [float(r["raw_busbw_GBs"]) for r in sel], "x--",
                        color=line.get_color(), label=f"{prim} raw")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes")
            ax.set_ylabel("busbw (GB/s), forward")
        elif name.startswith("scaling"):
            for kind in ("weak", "strong"):
                sel = [r for r in rows if r["case"] == kind]
                if sel:
                    ax.plot([int(r["ranks"]) for r in sel],
                            [float(r.get("efficiency") or "nan") for r in sel], "o-", label=kind)
            ax.set_xlabel("ranks")
            ax.set_ylabel("parallel efficiency")
        else:
            labels = [f"{r.get('case', '')} {r.get('mode', '')} n={r.get('ranks', '')}"
                      f"{' hint' if r.get('hint') == 'True' else ''}" for r in rows]
            ax.barh(labels, [float(r["ratio"]) for r in rows])
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_xlabel("time ratio gpudist / reference")
        ax.set_title(name)
        ax.legend(fontsize=7) if ax.get_legend_handles_labels()[0] else None
        fig.tight_layout()
        out = dst / f"{name}.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        made.append(out)
    return made


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default="results", help="folder with the suites' CSVs")
    p.add_argument("--out", default=None, help="PNG folder (default: --src)")


def main(args, argv) -> None:
    made = plot_all(Path(args.src), Path(args.out or args.src))
    for m in made:
        print(f"wrote {m}")
    if not made:
        print(f"no CSVs under {args.src}")
