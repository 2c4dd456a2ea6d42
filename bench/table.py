"""Markdown tables from the suites' CSVs (what bench/RESULTS.md quotes): primitives as
ratio vs size, halo and layers as rows."""

from __future__ import annotations

import argparse
from pathlib import Path

from .plot import _read


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def primitives(rows: list[dict], mode: str) -> list[str]:
    sel = [r for r in rows if r["mode"] == mode and r["hint"] == "True"]
    sizes = sorted({int(r["bytes"]) for r in sel})
    out = ["| primitive | backend | " + " | ".join(_size(s) for s in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    for prim in dict.fromkeys(r["primitive"] for r in sel):
        by = {int(r["bytes"]): r for r in sel if r["primitive"] == prim}
        cells = [f"{float(by[s]['ratio']):.2f}x" if s in by else "-" for s in sizes]
        out.append(f"| {prim} | {sel[0]['backend']} | " + " | ".join(cells) + " |")
    return out


def rows_table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            try:
                f = float(v)
                v = f"{f:.2f}x" if c.startswith("ratio") else f"{f:.3g}" if "ms" in c or \
                    "MiB" in c else v
            except ValueError:
                pass
            cells.append(str(v))
        out.append("| " + " | ".join(cells) + " |")
    return out


COLS = {
    "halo": ["backend", "mode", "gpudist_ms", "raw_pack_ms", "raw_inplace_ms",
             "raw_persist_ms", "ratio", "ratio_inplace", "ratio_persist"],
    "layers": ["case", "backend", "ranks", "partition", "global_shape", "gpudist_ms",
               "reference_ms", "ratio", "peak_mem_MiB_max_rank"],
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default="results", help="folder of the suites' CSVs")
    p.add_argument("--mode", default="fwd", help="primitives: fwd or fwd+adj")


def main(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    for csvp in sorted(Path(args.src).glob("*.csv")):
        rows = _read(csvp)
        kind = csvp.stem.split("_")[0]
        if not rows or (kind != "primitives" and kind not in COLS):
            continue
        lines = primitives(rows, args.mode) if kind == "primitives" else \
            rows_table(rows, COLS[kind])
        print(f"\n{csvp.name}\n")
        print("\n".join(lines))
