#!/usr/bin/env bash
# GPU readiness check: the Llama parity layouts and the Llama benchmark on CUDA, in one go.
#
#   bash bench/gpu_check.sh
#
# Steps (each bounded by DTORCH_GPU_CHECK_STEP_TIMEOUT seconds, default 110, so one GPU finishes in
# under 10 minutes):
#   1. with 2+ GPUs: parity, in-process backend on the real GPUs (layouts needing more GPUs are SKIPped)
#   2. parity, 8 GPUs simulated on cuda:0 (DTORCH_DTENSOR_IN_SAME_DEVICE=1)
#   3. benchmark vs the single-GPU Hugging Face forward, in-process, tp over the real GPUs
#   4. benchmark, 8 simulated GPUs (tp2 x pp2 x ulysses2)
#   5-6. with 2+ GPUs: parity and benchmark on the process backend (one worker per GPU, NCCL)
# Prints PASS/FAIL per layout and dtorch/HF time ratios; exits 1 if any step failed.
# On a machine without CUDA it prints one line saying so and exits 0 (CI runs it that way).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ -z "$ngpu" ]; then
    echo "gpu_check: cannot import torch with $PY; set PYTHON to the interpreter that has dtorch installed" >&2
    exit 2
fi
if [ "$ngpu" -eq 0 ]; then
    echo "no CUDA device: nothing to check; run bench/gpu_check.sh on a machine with an NVIDIA GPU (torch.cuda.is_available() is False here)"
    exit 0
fi

STEP_TIMEOUT="${DTORCH_GPU_CHECK_STEP_TIMEOUT:-110}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
failed=()
start=$SECONDS

step() {  # step NAME ENV... -- CMD...
    local name="$1"; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo
    echo "=== $name ($(( SECONDS - start ))s elapsed)"
    echo "    ${envs[*]} $*"
    env "${envs[@]}" timeout --kill-after=10 "$STEP_TIMEOUT" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "--- $name: timed out after ${STEP_TIMEOUT}s"
        failed+=("$name (exit $rc)")
    fi
}

# tp must divide the benchmark model's 8 heads: the largest power of two <= min(GPUs, 8)
tp=1
while [ $(( tp * 2 )) -le "$ngpu" ] && [ $(( tp * 2 )) -le 8 ]; do tp=$(( tp * 2 )); done

echo "gpu_check: $ngpu CUDA device(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
SIM=(DTORCH_DTENSOR_IN_SAME_DEVICE=1 DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE=8)
BENCH=(bench/llama_simulation.py --device cuda --seq 16 256 --repeat 3)

if [ "$ngpu" -ge 2 ]; then
    step "parity: in-process, $ngpu real GPUs" DTORCH_BACKEND=inprocess -- "$PY" tests/models/test_llama.py
else
    echo
    echo "=== parity on real GPUs: skipped, every mesh layout needs 2+ GPUs (the simulated run covers them on cuda:0)"
fi
step "parity: in-process, 8 GPUs simulated on cuda:0" DTORCH_BACKEND=inprocess "${SIM[@]}" -- "$PY" tests/models/test_llama.py
step "bench: in-process, tp=$tp on real GPUs" DTORCH_BACKEND=inprocess -- "$PY" "${BENCH[@]}" --layout "tp=$tp"
step "bench: in-process, 8 GPUs simulated on cuda:0" DTORCH_BACKEND=inprocess "${SIM[@]}" -- \
    "$PY" "${BENCH[@]}" --layout tp=2,pp=2,ulysess_cp=2
if [ "$ngpu" -ge 2 ]; then
    step "parity: process backend, NCCL, $ngpu GPUs" DTORCH_BACKEND=process -- "$PY" tests/models/test_llama.py
    step "bench: process backend, NCCL, tp=$tp" DTORCH_BACKEND=process -- "$PY" "${BENCH[@]}" --layout "tp=$tp" \
        --no-pytorch-dtensor
else
    echo
    echo "=== process backend (NCCL): skipped, it needs 2+ GPUs and this machine has 1"
fi

echo
echo "gpu_check: $(( SECONDS - start ))s in total"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_check: all steps passed"
