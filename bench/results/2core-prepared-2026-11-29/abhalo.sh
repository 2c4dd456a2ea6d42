#!/bin/bash
# A/B of bench halo on gloo (2 ranks): old tree ($OLD) and this tree, in turn
R=${1:-3}
for i in $(seq 1 $R); do
  for t in old new; do
    d=/work/main; [ $t = old ] && d=${OLD:-/tmp/old}
    (cd $d && OMP_NUM_THREADS=1 timeout 900 /work/main/.venv/bin/python -m bench halo --backend gloo --ranks 2 --repeats 200 --huge-pages --no-progress --out ${OUT:-/tmp/abh}/$t-r$i > /dev/null 2>&1)
  done
done
