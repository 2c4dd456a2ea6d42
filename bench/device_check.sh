#!/usr/bin/env bash
# The prepared checks for a lent GPU machine (one H100/H200, 16 CPU cores, no network), in
# two phases that each fit one 10-minute call (their steps' limits add up to 8 minutes at
# most). Results (CSV/JSON, logs) are written under /tmp/device/PHASE and come back as one
# archive, $OUT/PHASE.tar.gz (the device tool returns at most 8 files), remade after every
# step (a call stopped at its limit still returns what was done), with the tables in
# $OUT/PHASE-tables.md. Exit status: 1 if a step failed or ran out of time.
#
#   bash bench/device_check.sh gpu     # the GPU suite (make test-gpu) and the GPU benches:
#                                      # every layer at world size 1 on CUDA vs torch, the
#                                      # pack kernels vs a copy, 2 ranks on one GPU (#16)
#   bash bench/device_check.sh cpu16   # #14's tables at 4 ranks, ONE RANK PER CORE (the
#                                      # dev machines have 2 cores): halo, layers,
#                                      # primitives, MPI and gloo, CPU tensors
#
# The machine has CUDA torch, CuPy and Numba but no MPI: carry PyPI wheels in .whl/ (made
# here by `make device-wheels`, ignored by git) and name `.whl` in the call's `carry`. Its
# python3 is used as it is (its CUDA torch); gpudist runs from the checkout (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-}
case "$PHASE" in
gpu | cpu16) ;;
*) echo "usage: bash bench/device_check.sh gpu|cpu16" >&2; exit 2 ;;
esac
OUT=${OUT:-results/device}
RES=/tmp/device/$PHASE
mkdir -p "$OUT" "$RES"
PY=${PYTHON:-python3}
if ! $PY -c "from mpi4py import MPI" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# one line of facts first: what ran where
$PY - <<'EOF' 2>&1 | tee "$RES/machine.txt"
import os, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      "cores", os.cpu_count())
try:
    from mpi4py import MPI
    print("mpi4py", MPI.Get_library_version().splitlines()[0])
except Exception as e:  # noqa: BLE001
    print("no mpi4py:", e)
EOF

FAILED=0
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$RES/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    echo "   rc=$rc, $((SECONDS - t0)) s; last lines:"
    tail -n 12 "$RES/$name.log" | sed 's/^/   | /'
    tar czf "$OUT/$PHASE.tar.gz" -C /tmp/device "$PHASE"
}

case "$PHASE" in
gpu)
    step gpu-suite 240 $PY -m pytest -q -m gpu tests -x -p no:cacheprovider
    step gpu-layers-ws1 90 $PY -m bench layers --device cuda --backend gloo --ranks 1 \
        --no-progress --out "$RES" --tag cuda
    step gpu-kernels 60 $PY -m bench kernels --device cuda --out "$RES"
    step gpu-layers-2r 90 $PY -m bench layers --device cuda --backend gloo --ranks 2 \
        --no-ws1 --layers conv2d maxpool2d upsample2d --repeats 10 --no-progress \
        --out "$RES" --tag cuda
    ;;
cpu16)
    for be in mpi gloo; do
        step "halo-$be" 40 $PY -m bench halo --backend "$be" --ranks 4 --no-progress \
            --out "$RES"
        step "layers-$be" 130 $PY -m bench layers --backend "$be" --ranks 4 --no-ws1 \
            --repeats 10 --no-progress --out "$RES"
        step "primitives-$be" 70 $PY -m bench primitives --backend "$be" --ranks 4 \
            --sizes 64KiB 1MiB 64MiB --repeats 15 --no-hint-compare --no-progress \
            --out "$RES"
    done
    ;;
esac
: >"$OUT/$PHASE-tables.md"
if [ "$PHASE" = cpu16 ]; then  # (#14's bars are for CPU ranks, one per core)
    $PY -m bench table --src "$RES" --targets >>"$OUT/$PHASE-tables.md" 2>&1 || true
fi
$PY -m bench table --src "$RES" >>"$OUT/$PHASE-tables.md" 2>&1 || true
$PY -m bench table --src "$RES" --mode fwd+adj >>"$OUT/$PHASE-tables.md" 2>&1 || true
tar czf "$OUT/$PHASE.tar.gz" -C /tmp/device "$PHASE"
ls -l "$OUT"
exit "$FAILED"
