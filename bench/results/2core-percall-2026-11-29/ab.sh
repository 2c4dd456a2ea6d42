#!/bin/bash
# A/B: old (ddb500b, the session's start) vs new (HEAD), alternated; MPI, 2 ranks
set -e
for r in 1 2 3; do
 for v in old new; do
  d=/tmp/s8/old; [ $v = new ] && d=/work/main
  (cd $d && .venv/bin/python -m bench primitives --backend mpi --ranks 2 --sizes 64KiB 1MiB --repeats 100 --no-hint-compare --no-progress --huge-pages --out /tmp/s8/res/$v-r$r >/dev/null 2>&1)
 done
done
