#!/bin/bash
# A/B of one bench suite: the old tree ($OLD) and this tree in turn, $1 rounds; the rest of
# the arguments go to `python -m bench`. Results in $OUT/{old,new}-r<i>. The runs of this
# folder:
#   primitives (ab/, steady/): ab.sh 3 primitives --backend mpi --ranks 2 --sizes 64KiB 1MiB --repeats 60 --no-hint-compare --huge-pages
#   repartition/:  ab.sh 3 primitives --backend mpi --ranks 2 --prims repartition repartition_pack --sizes 64KiB 1MiB --repeats 60 --no-hint-compare --huge-pages
#   trees/, trees-unified/: ab.sh 3 (2) primitives --backend mpi --ranks 2 --prims sumreduce broadcast --sizes 64KiB 1MiB --repeats 60 --no-hint-compare --huge-pages
#   gloo/:         ab.sh 2 primitives --backend gloo --ranks 2 --sizes 64KiB 1MiB --repeats 40 --no-hint-compare --huge-pages
#   layers/, layers2/: ab.sh 3 layers --backend mpi --ranks 2 --no-ws1 --layers conv2d conv2d_chan batchnorm2d linear --repeats 10 --huge-pages
#   halo/:         ab.sh 3 halo --backend gloo --ranks 2 --repeats 200 --huge-pages
R=$1
shift
here=$(pwd)
for i in $(seq 1 "$R"); do
  for t in old new; do
    d=$here; [ "$t" = old ] && d=${OLD:-/tmp/old}
    (cd "$d" && OMP_NUM_THREADS=1 timeout 900 "$here/.venv/bin/python" -m bench "$@" \
       --no-progress --out "${OUT:-/tmp/ab}/$t-r$i" > /dev/null 2>&1)
  done
done
