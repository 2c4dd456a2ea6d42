#!/bin/bash
R=${1:-3}
for i in $(seq 1 $R); do
  for t in old new; do
    d=/work/main; [ $t = old ] && d=${OLD:-/tmp/old}
    (cd $d && OMP_NUM_THREADS=1 timeout 600 /work/main/.venv/bin/python -m bench primitives --backend mpi --ranks 2 --prims sumreduce broadcast --sizes 64KiB 1MiB --repeats 60 --no-hint-compare --huge-pages --no-progress --out ${OUT:-/tmp/abs}/$t-r$i > /dev/null 2>&1)
  done
done
