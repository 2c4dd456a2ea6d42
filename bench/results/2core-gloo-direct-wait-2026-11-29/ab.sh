#!/bin/bash
# A/B, gloo, 2 ranks: da36113 (point-to-point waited in a helper thread) vs HEAD (waited
# on the caller's thread, a watch thread for slow waits), alternated; $1 = rounds
OUT=${OUT:-/tmp/s9/res}
for r in $(seq ${FIRST:-1} ${1:-2}); do
 for v in old new; do
  d=/tmp/s9/old; [ $v = new ] && d=/work/main
  (cd $d && export OMP_NUM_THREADS=1 &&
   .venv/bin/python -m bench halo --backend gloo --ranks 2 --repeats 30 --huge-pages --no-progress --out $OUT/$v-r$r >/dev/null 2>&1
   .venv/bin/python -m bench primitives --backend gloo --ranks 2 --prims broadcast sumreduce --sizes 64KiB 1MiB --repeats 30 --no-hint-compare --huge-pages --no-progress --out $OUT/$v-r$r >/dev/null 2>&1
   .venv/bin/python -m bench layers --backend gloo --ranks 2 --no-ws1 --layers conv2d conv2d_chan --repeats 10 --huge-pages --no-progress --out $OUT/$v-r$r >/dev/null 2>&1)
 done
done
