#!/bin/bash
# A/B: old (HEAD before) vs new (working tree), alternated; MPI, 2 ranks, primitives at 64KiB and 1MiB
set -e
for r in 1 2; do
 for v in old new; do
  d=/tmp/s7/old; [ $v = new ] && d=/work/main
  (cd $d && .venv/bin/python -m bench primitives --backend mpi --ranks 2 --sizes 64KiB 1MiB --repeats 20 --no-hint-compare --no-progress --huge-pages --out /tmp/s7/res/$v-r$r >/dev/null 2>&1)
 done
done
