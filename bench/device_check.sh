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
#   bash bench/device_check.sh all     # both in one call, side by side (CPU tables on cores
#                                      # 0-7, GPU work on 8-15), every step cut to what is
#                                      # left of DEADLINE_S (default 540 s)
#
# The machine has CUDA torch, CuPy and Numba but no MPI: carry PyPI wheels in .whl/ (made
# here by `make device-wheels`, ignored by git) and name `.whl` in the call's `carry`. Its
# python3 is used as it is (its CUDA torch); gpudist runs from the checkout (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-}
case "$PHASE" in
gpu | cpu16 | all) ;;
*) echo "usage: bash bench/device_check.sh gpu|cpu16|all" >&2; exit 2 ;;
esac
OUT=${OUT:-results/device}
RES=/tmp/device/$PHASE
mkdir -p "$OUT" "$RES"
PY=${PYTHON:-python3}
# Carried wheels go into a venv over the image's packages: its mpiexec lies beside its
# python (where gpudist.launch looks) and mpi4py loads the venv's MPICH, not the image's
# Open MPI (`pip --target` drops MPICH's lib/, and mpi4py then found Open MPI: every MPI
# rank ran as a world of one).
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m venv --without-pip /tmp/venv || exit 1
    $PY -c "import site; print('\n'.join(site.getsitepackages()))" \
        >"$(/tmp/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
    /tmp/venv/bin/python -m pip install -q --no-index --no-deps --ignore-installed --no-compile \
        --no-cache-dir .whl/*.whl || exit 1
    PY=/tmp/venv/bin/python
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
END=$((SECONDS + ${DEADLINE_S:-540}))
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, go on
    local name=$1 limit=$2
    shift 2
    local left=$((END - SECONDS - 10))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped, no time left"; FAILED=1; return; fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name: $*"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$RES/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || FAILED=1
    echo "   rc=$rc, $((SECONDS - t0)) s; last lines:"
    tail -n 12 "$RES/$name.log" | sed 's/^/   | /'
    tar czf "$OUT/$PHASE${LANE:-}.tar.gz" -C /tmp/device "$PHASE"
}

gpu_suite() {
    step gpu-suite "${GPU_SUITE_S:-240}" $PY -m pytest -v -rA --durations=0 -m gpu tests -p no:cacheprovider
}
gpu_benches() {
    step gpu-layers-ws1 90 $PY -m bench layers --device cuda --backend gloo --ranks 1 \
        --no-progress --out "$RES" --tag cuda
    step gpu-kernels 60 $PY -m bench kernels --device cuda --out "$RES"
    step gpu-layers-2r 90 $PY -m bench layers --device cuda --backend gloo --ranks 2 \
        --no-ws1 --layers conv2d maxpool2d upsample2d --repeats 10 --no-progress \
        --out "$RES" --tag cuda
}
cpu_tables() {  # cpu_tables BACKEND
    step "halo-$1" 40 $PY -m bench halo --backend "$1" --ranks 4 --no-progress --out "$RES"
    step "layers-$1" 130 $PY -m bench layers --backend "$1" --ranks 4 --no-ws1 \
        --repeats 10 --no-progress --out "$RES"
    step "primitives-$1" 70 $PY -m bench primitives --backend "$1" --ranks 4 \
        --sizes 64KiB 1MiB 64MiB --repeats 15 --no-hint-compare --no-progress --out "$RES"
}
case "$PHASE" in
gpu) gpu_suite; gpu_benches ;;
cpu16) cpu_tables mpi; cpu_tables gloo ;;
all)  # two lanes at once: the CPU tables on cores 0-7, the GPU work on cores 8-15
    (LANE=-cpu; taskset -pc 0-7 $BASHPID >/dev/null; cpu_tables mpi; cpu_tables gloo
     exit $FAILED) >"$RES/lane-cpu.txt" 2>&1 &
    (LANE=-gpu; taskset -pc 8-15 $BASHPID >/dev/null; gpu_suite; gpu_benches; exit $FAILED) \
        >"$RES/lane-gpu.txt" 2>&1 &
    for job in $(jobs -p); do wait "$job" || FAILED=1; done
    cat "$RES/lane-gpu.txt" "$RES/lane-cpu.txt"
    rm -f "$OUT/$PHASE-cpu.tar.gz" "$OUT/$PHASE-gpu.tar.gz" ;;
esac
: >"$OUT/$PHASE-tables.md"
if [ "$PHASE" != gpu ]; then  # (#14's bars are for CPU ranks, one per core)
    $PY -m bench table --src "$RES" --targets >>"$OUT/$PHASE-tables.md" 2>&1 || true
fi
$PY -m bench table --src "$RES" >>"$OUT/$PHASE-tables.md" 2>&1 || true
$PY -m bench table --src "$RES" --mode fwd+adj >>"$OUT/$PHASE-tables.md" 2>&1 || true
tar czf "$OUT/$PHASE.tar.gz" -C /tmp/device "$PHASE"
ls -l "$OUT"
exit "$FAILED"
