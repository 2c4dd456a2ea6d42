#!/bin/bash
# A/B, gloo, 2 ranks: the session's starting code (54cd4a9) vs HEAD, alternated twice
for r in 1 2; do
 for v in old new; do
  d=/tmp/s7/old; [ $v = new ] && d=/work/main
  (cd $d && OMP_NUM_THREADS=1 .venv/bin/python -m bench halo --backend gloo --ranks 2 --repeats 20 --huge-pages --no-progress --out /tmp/s7/res2/$v-r$r >/dev/null 2>&1
   OMP_NUM_THREADS=1 .venv/bin/python -m bench primitives --backend gloo --ranks 2 --prims broadcast sumreduce allsumreduce --sizes 64KiB 1MiB --repeats 20 --no-hint-compare --huge-pages --no-progress --out /tmp/s7/res2/$v-r$r >/dev/null 2>&1)
 done
done
