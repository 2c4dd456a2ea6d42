import csv, glob, sys
base = sys.argv[1] if len(sys.argv) > 1 else "bench/results/2core-percall-2026-11-29"
fname = sys.argv[2] if len(sys.argv) > 2 else "primitives_mpi_2r.csv"
rows = {}
for v in ("old", "new"):
    for f in sorted(glob.glob(f"{base}/{v}-r*/{fname}")):
        for r in csv.DictReader(open(f)):
            key = (r.get("primitive") or r.get("layer") or r.get("case"), r.get("bytes", ""), r["mode"])
            rows.setdefault(key, {}).setdefault(v, []).append(r)
print(f"{'case':34s} {'old paired (each round)':30s} {'new paired (each round)':30s}  old ms / new ms (median of rounds)")
for k, d in rows.items():
    o = [float(r["paired"]) for r in d.get("old", [])]
    n = [float(r["paired"]) for r in d.get("new", [])]
    om = sorted(float(r["gpudist_ms"]) for r in d.get("old", []))
    nm = sorted(float(r["gpudist_ms"]) for r in d.get("new", []))
    f = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    print(f"{' '.join(k):34s} {f(o):30s} {f(n):30s}  {om[len(om)//2]*1e3:.1f} / {nm[len(nm)//2]*1e3:.1f} us")
