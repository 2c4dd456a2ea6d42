#!/bin/bash
# The README's 2-core table (eleventh session): every suite once per backend, 2 ranks,
# huge pages, run from the repository root. Results in bench/results/2core-s11-2026-11-29/.
here=bench/results/2core-s11-2026-11-29
run() { OMP_NUM_THREADS=1 timeout 1200 .venv/bin/python -m bench "$@" --no-progress --huge-pages > /dev/null 2>&1 || echo "failed: $*"; }
for b in mpi gloo; do
  run halo --backend $b --ranks 2 --repeats 100 --out $here/halo
  run primitives --backend $b --ranks 2 --sizes 64KiB 1MiB 64MiB --repeats 40 --no-hint-compare --out $here/primitives
  run layers --backend $b --ranks 2 --no-ws1 --repeats 10 --out $here/layers \
    --layers conv2d conv2d_chan maxpool2d avgpool2d upsample2d batchnorm2d linear
done
