#!/usr/bin/env bash
# The prepared checks for a lent GPU machine (one H100/H200, 16 CPU cores, no network): two
# phases that each fit one 10-minute call (their steps' limits add up to 8 minutes at most),
# or both at once. Results (CSV/JSON, logs) are written under /tmp/device/PHASE (the GPU
# benches' under /tmp/device/PHASE/gpu) and come back as one
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
#   HUGE_PAGES=1 bash bench/device_check.sh cpu16   # the CPU tables on huge pages
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
# The image's site-packages are added with site.addsitedir (their own .pth files work).
if compgen -G ".whl/*.whl" >/dev/null; then
    if $PY -m venv --without-pip /tmp/venv &&
        $PY -c "import site; [print(f'import site; site.addsitedir({p!r})')
                             for p in site.getsitepackages()]" >"$(/tmp/venv/bin/python -c \
            'import site; print(site.getsitepackages()[0])')/image.pth" &&
        /tmp/venv/bin/python -m pip install -q --no-index --no-deps --ignore-installed \
            --no-compile --no-cache-dir .whl/*.whl; then
        PY=/tmp/venv/bin/python
    else
        echo "WARNING: the carried wheels did not install (wrong Python?); the image's" \
            "python runs as it is, MPI steps may fail" >&2
    fi
else
    echo "WARNING: no .whl/ (make device-wheels): the MPI steps will fail" >&2
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
END=${DEADLINE_S:-540}  # seconds from the script's start (bash's SECONDS), set-up included
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
    step gpu-suite "${GPU_SUITE_S:-240}" $PY -m pytest -v -rA --durations=0 -m gpu tests \
        -p no:cacheprovider
}
gpu_benches() {
    step gpu-layers-ws1 90 $PY -m bench layers --device cuda --backend gloo --ranks 1 \
        --no-progress --out "$RES/gpu" --tag cuda
    step gpu-kernels 60 $PY -m bench kernels --device cuda --out "$RES/gpu"
    step gpu-layers-2r 90 $PY -m bench layers --device cuda --backend gloo --ranks 2 \
        --no-ws1 --layers conv2d maxpool2d upsample2d --repeats 10 --no-progress \
        --out "$RES/gpu" --tag cuda
}
# HUGE_PAGES=1: the CPU tables with torch's allocator on transparent huge pages (bench
# --huge-pages; files tagged _hp), to compare with a run without
HP=() && [ "${HUGE_PAGES:-0}" = 1 ] && HP=(--huge-pages --tag hp)
cpu_tables() {  # cpu_tables BACKEND
    step "halo-$1" 40 $PY -m bench halo --backend "$1" --ranks 4 --no-progress --out "$RES" \
        ${HP[@]+"${HP[@]}"}
    step "layers-$1" 130 $PY -m bench layers --backend "$1" --ranks 4 --no-ws1 \
        --repeats 10 --no-progress --out "$RES" ${HP[@]+"${HP[@]}"}
    step "primitives-$1" 70 $PY -m bench primitives --backend "$1" --ranks 4 \
        --sizes 64KiB 1MiB 64MiB --repeats 15 --no-hint-compare --no-progress --out "$RES" \
        ${HP[@]+"${HP[@]}"}
}
case "$PHASE" in
gpu) gpu_suite; gpu_benches ;;
cpu16) cpu_tables mpi; cpu_tables gloo ;;
all)  # two lanes at once: the CPU tables on the first half of the cores, the GPU work
    # on the second half (unpinned, and said so, where taskset cannot)
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (nproc reads OMP_*)
    half=$((cores / 2))
    pin() {
        [ "$half" -ge 1 ] && taskset -pc "$1" "$BASHPID" >/dev/null ||
            echo "WARNING: lane not pinned (to $1; $cores cores)"
    }
    (LANE=-cpu; pin "0-$((half - 1))"; cpu_tables mpi; cpu_tables gloo; exit $FAILED) \
        >"$RES/lane-cpu.txt" 2>&1 &
    lanes=($!)
    (LANE=-gpu; pin "$half-$((2 * half - 1))"; gpu_suite; gpu_benches; exit $FAILED) \
        >"$RES/lane-gpu.txt" 2>&1 &
    lanes+=($!)
    for pid in "${lanes[@]}"; do wait "$pid" || FAILED=1; done
    cat "$RES/lane-gpu.txt" "$RES/lane-cpu.txt" ;;
esac
: >"$OUT/$PHASE-tables.md"
tables() {  # tables DIR [--targets]: bench's tables of the results in DIR, time-limited
    for mode in "${@:2}" "" "--mode fwd+adj"; do
        # shellcheck disable=SC2086
        timeout 60 $PY -m bench table --src "$1" $mode >>"$OUT/$PHASE-tables.md" 2>&1 || true
    done
}
[ "$PHASE" = gpu ] || tables "$RES" --targets  # (#14's bars: CPU ranks, one per core)
[ -d "$RES/gpu" ] && tables "$RES/gpu"
tar czf "$OUT/$PHASE.tar.gz" -C /tmp/device "$PHASE"
rm -f "$OUT/$PHASE-cpu.tar.gz" "$OUT/$PHASE-gpu.tar.gz"
ls -l "$OUT"
exit "$FAILED"
