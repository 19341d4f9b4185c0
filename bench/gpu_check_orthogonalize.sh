#!/usr/bin/env bash
# The orthogonalizer's GPU check, for one H200, in under 5 minutes: the CUDA tests of the
# kernels (Gram Newton-Schulz, batch-independent bits, sums of squares, the products), then
# bench/orthogonalize.py's whole-orthogonalizer timings on the workloads' shapes and the
# resident step with today's products path against the batch-dependent one.
#
#   bash bench/gpu_check_orthogonalize.sh LOG_DIR
#
# Logs and JSON land in LOG_DIR (summary.txt first). TUNE=1 times every kernel config first
# (closer to a training run, several minutes more on a fresh machine); by default each kernel
# takes its first config, so the step's A/B compares paths, not tunings. GNS_WHEEL=path
# installs the gram-newton-schulz wheel (no dependencies) so that its tests and the package
# column run.
set -u
out=${1:?usage: bash bench/gpu_check_orthogonalize.sh LOG_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export MUON_OFFLOAD_CACHE_DIR="$out/tune-cache"
export MUON_OFFLOAD_AUTOTUNE=${TUNE:-0}
summary="$out/summary.txt"
: > "$summary"
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, note the outcome
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc ($((SECONDS - t0)) s)$([ $rc = 124 ] && echo ', cut at the time limit')" \
        | tee -a "$summary"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$summary" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >> "$summary" 2>&1
if [ -n "${GNS_WHEEL:-}" ]; then
    stage pip 20 python -m pip install --no-deps -q "$GNS_WHEEL"
fi
stage tests 140 python -m pytest -q -m cuda -rfEs -s \
    tests/test_batch_invariance.py tests/test_kernels_gram_newton_schulz.py \
    tests/test_kernels_sumsq.py tests/test_kernels_normalize.py tests/test_kernels_muon.py \
    tests/test_kernels_orthogonalize.py
tail -n 3 "$out/tests.log" >> "$summary"
stage bench_methods 80 python bench/orthogonalize.py --section methods \
    --out "$out/orthogonalize_methods.json"
stage bench_step 45 python bench/orthogonalize.py --section step --step-rounds 5 \
    --out "$out/resident_step.json"
grep -h "resident step" "$out/bench_step.log" >> "$summary"
