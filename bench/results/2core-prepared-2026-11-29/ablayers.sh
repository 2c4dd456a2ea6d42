#!/bin/bash
# A/B of bench layers: old tree ($OLD) and this tree, in turn
R=${1:-2}
for i in $(seq 1 $R); do
  for t in old new; do
    d=/work/main; [ $t = old ] && d=${OLD:-/tmp/old}
    (cd $d && OMP_NUM_THREADS=1 timeout 900 /work/main/.venv/bin/python -m bench layers --backend mpi --ranks 2 --no-ws1 --layers conv2d conv2d_chan batchnorm2d linear --repeats 10 --huge-pages --no-progress --out ${OUT:-/tmp/abl}/$t-r$i > /dev/null 2>&1)
  done
done
