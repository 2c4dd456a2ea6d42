#!/bin/bash
# A/B: old (30330c3) vs new (HEAD) in turn, two rounds, 2 ranks, huge pages
export OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for ver in old new; do
    dir=/tmp/s6/old; [ $ver = new ] && dir=/work/main
    for b in mpi gloo; do
      (cd $dir && timeout 900 $PY -m bench layers --backend $b --ranks 2 --no-ws1 --layers conv2d_chan linear batchnorm2d conv2d --repeats 10 --huge-pages --no-progress --out /tmp/s6/ab/$ver-r$round > /dev/null 2>&1)
      (cd $dir && timeout 900 $PY -m bench primitives --backend $b --ranks 2 --prims broadcast sumreduce allsumreduce reducescatter --sizes 64KiB 1MiB 16MiB 64MiB --repeats 15 --no-hint-compare --huge-pages --no-progress --out /tmp/s6/ab/$ver-r$round > /dev/null 2>&1)
      echo "$(date +%T) done $round $ver $b"
    done
  done
done
