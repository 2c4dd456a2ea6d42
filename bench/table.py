"""Markdown tables from the suites' CSVs (what bench/RESULTS.md quotes): primitives as
ratio vs size, halo and layers as rows. A ratio reads ``1.07x (p 1.05 [1.02-1.09])``: the
ratio of the medians, then the paired ratio (median of the per-repeat ratios) and its
~95 % interval, where the CSV has them."""

from __future__ import annotations

import argparse
from pathlib import Path

from .plot import _read


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def primitives(rows: list[dict], mode: str, col: str = "ratio") -> list[str]:
    """Ratio vs size per primitive; ``col`` "ratio_autograd": fwd+adj against the raw pair
    behind autograd."""
    sel = [r for r in rows if r["mode"] == mode and r["hint"] == "True" and r.get(col)]
    sizes = sorted({int(r["bytes"]) for r in sel})
    out = ["| primitive | backend | " + " | ".join(_size(s) for s in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    for prim in dict.fromkeys(r["primitive"] for r in sel):
        by = {int(r["bytes"]): r for r in sel if r["primitive"] == prim}
        cells = [("-" if s not in by else _paired(by[s]) if col == "ratio" else
                  f"{float(by[s][col]):.2f}x") for s in sizes]
        out.append(f"| {prim} | {sel[0]['backend']} | " + " | ".join(cells) + " |")
    return out


def _paired(r: dict) -> str:
    """'ratio' of medians, with the paired ratio and its interval where the row has them."""
    s = f"{float(r['ratio']):.2f}x"
    if r.get("paired") not in (None, ""):
        s += f" (p {float(r['paired']):.2f} [{float(r['paired_lo']):.2f}-" \
             f"{float(r['paired_hi']):.2f}])"
    return s


def rows_table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            if c == "ratio":
                cells.append(_paired(r))
                continue
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


# issue #14's bars: (suite, case, mode or None, smallest size in bytes or None) -> ratio
TARGETS = [
    ("halo", "exchange", None, None, 1.10),
    ("halo", "exchange+adjoint", None, None, 1.10),
    ("layers", "conv2d", None, None, 1.05),
    ("layers", "conv2d_chan", None, None, 1.10),
    ("layers", "maxpool2d", None, None, 1.10),
    ("layers", "avgpool2d", None, None, 1.10),
    ("layers", "upsample2d", None, None, 1.10),
    ("primitives", None, "fwd", 1 << 20, 1.05),
    ("primitives", None, "fwd+adj", 1 << 20, 1.05),
    ("primitives", None, "fwd", 64 << 10, 1.30),
    ("primitives", None, "fwd+adj", 64 << 10, 1.30),
]


def _verdict(r: dict, bar: float) -> str:
    """met (the paired ratio's whole ~95 % interval at or under the bar), not met (all of
    it above), or unclear (it holds the bar); the ratio of medians where no pairs exist."""
    if r.get("paired") in (None, ""):
        return "met" if float(r["ratio"]) <= bar else "not met"
    if float(r["paired_hi"]) <= bar:
        return "met"
    return "not met" if float(r["paired_lo"]) > bar else "unclear"


def targets(by_kind: dict[str, list[dict]]) -> list[str]:
    """One row per measured case that issue #14 sets a bar for, with the verdict."""
    out = ["| suite | case | backend | ranks | measured | target | verdict |",
           "|---|---|---|---|---|---|---|"]
    for kind, case, mode, size, bar in TARGETS:
        for r in by_kind.get(kind, []):
            if kind == "halo":
                name, hit = r["mode"], r["mode"] == case
            elif kind == "layers":
                name, hit = r["case"], r["case"] == case and int(r["ranks"]) > 1
            else:  # a primitive at exactly this size (>= 1 MiB: every size from it on)
                b = int(r["bytes"])
                name = f"{r['primitive']} {_size(b)} {r['mode']}"
                hit = (r["mode"] == mode and r["hint"] == "True"
                       and (b >= size if size >= 1 << 20 else b == size))
            if hit:
                out.append(f"| {kind} | {name} | {r['backend']} | {r.get('ranks', '')} | "
                           f"{_paired(r)} | <= {bar:.2f}x | {_verdict(r, bar)} |")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", nargs="+", default=["results"],
                   help="folder(s) of the suites' CSVs")
    p.add_argument("--mode", default="fwd", help="primitives: fwd or fwd+adj")
    p.add_argument("--col", default="ratio", choices=["ratio", "ratio_autograd"],
                   help="primitives: vs the raw pair, or (fwd+adj) vs it behind autograd")
    p.add_argument("--targets", action="store_true",
                   help="one checklist of issue #14's bars (halo, layers, primitives) with "
                        "a verdict per measured case, instead of the tables")


def _csvs(srcs: list[str]) -> list[Path]:
    """The suites' CSVs in the folders ``srcs`` (not their subfolders: a run's A/B
    folders stay out); a missing folder, or none holding any, is an error rather than an
    empty table."""
    found = []
    for src in srcs:
        if not Path(src).is_dir():
            raise SystemExit(f"bench table: --src {src!r} is not a folder")
        found += sorted(Path(src).glob("*.csv"))
    if not found:
        raise SystemExit(f"bench table: no CSV files in {srcs} (a run's CSVs in subfolders "
                         f"such as halo/ and primitives/: pass those folders)")
    return found


def main(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    if args.targets:
        by_kind: dict[str, list[dict]] = {}
        for csvp in _csvs(args.src):
            by_kind.setdefault(csvp.stem.split("_")[0], []).extend(_read(csvp))
        lines = targets(by_kind)
        verdicts = [ln.rsplit("|", 2)[1].strip() for ln in lines[2:]]
        print("\n".join(lines))
        print("\n" + ", ".join(f"{v}: {verdicts.count(v)}"
                               for v in ("met", "unclear", "not met")))
        return
    for csvp in _csvs(args.src):
        rows = _read(csvp)
        kind = csvp.stem.split("_")[0]
        if not rows or (kind != "primitives" and kind not in COLS):
            continue
        lines = primitives(rows, args.mode, args.col) if kind == "primitives" else \
            rows_table(rows, COLS[kind])
        print(f"\n{csvp}\n")
        print("\n".join(lines))
