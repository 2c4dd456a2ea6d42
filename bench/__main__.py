"""``python -m bench {primitives,kernels,halo,layers,scaling,plot,table} [options]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .common import want_huge_pages

    want_huge_pages(argv)  # before torch starts
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    from . import halo, layers, plot, primitives, scaling, table

    suites = {"primitives": primitives, "halo": halo, "layers": layers, "scaling": scaling,
              "plot": plot, "table": table}
    for name, mod in suites.items():
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_args(sp)
    sub.add_parser("kernels", help="pack/unpack kernels vs contiguous copy (bench.kernels)",
                   add_help=False)
    if argv and argv[0] == "kernels":
        try:
            from . import kernels
        except ImportError as e:
            print(f"bench kernels: bench/kernels.py is not available ({e})")
            raise SystemExit(2) from None
        raise SystemExit(kernels.main(argv[1:]) or 0)
    args = p.parse_args(argv)
    suites[args.cmd].main(args, argv[1:])


if __name__ == "__main__":
    main()
