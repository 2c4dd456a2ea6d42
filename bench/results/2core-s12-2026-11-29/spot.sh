#!/bin/bash
# Twelfth session's spot check (no hot-path change meant): halo exchange, primitives and
# the convolutions once per backend, 2 ranks, huge pages, run from the repository root.
here=bench/results/2core-s12-2026-11-29
run() { OMP_NUM_THREADS=1 timeout 1200 .venv/bin/python -m bench "$@" --no-progress --huge-pages > /dev/null 2>&1 || echo "failed: $*"; }
for b in mpi gloo; do
  run halo --backend $b --ranks 2 --repeats 100 --out $here/halo
  run primitives --backend $b --ranks 2 --sizes 64KiB 1MiB --repeats 40 --no-hint-compare --out $here/primitives
  run layers --backend $b --ranks 2 --no-ws1 --repeats 10 --out $here/layers --layers conv2d conv2d_chan
done
