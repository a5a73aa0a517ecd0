#!/usr/bin/env bash
# Runs the kernel tests (the GPU-only bf16/fp8 cases included) and the kernel benchmarks on a CUDA machine.
#
#   benchmarks/run_kernel_gpu_suite.sh [LOG_DIR]            (default: ./kernel-gpu-logs)
#   STEPS="tests attention_decode" benchmarks/run_kernel_gpu_suite.sh
#
# Steps: "tests" and the bench_<name>.py names (attention_decode attention_prefill rmsnorm silu_mul
# rope_kv_write fp8_gemm int8_gemm). Each step has its own time limit so one slow step cannot eat the
# others'. tests.log and bench.log land in LOG_DIR; the benchmark tables end bench.log.
set -u
LOG_DIR=${1:-kernel-gpu-logs}
mkdir -p "$LOG_DIR"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if ! python3 -c "import sits.kernels" 2>/dev/null; then
  # No installed package (an offline GPU image): map sits.kernels onto the kernels folder.
  SHIM=$(mktemp -d)
  mkdir -p "$SHIM/sits" && touch "$SHIM/sits/__init__.py" && ln -s "$ROOT/kernels" "$SHIM/sits/kernels"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests attention_decode attention_prefill rmsnorm silu_mul rope_kv_write fp8_gemm int8_gemm"}
for step in $STEPS; do
  start=$(date +%s)
  if [ "$step" = tests ]; then
    PYTHONSAFEPATH=1 timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest tests/kernels -q -n "${TEST_WORKERS:-8}" \
      --confcutdir=tests/kernels -p no:cacheprovider --durations=15 >"$LOG_DIR/tests.log" 2>&1
    rc=$?
    tail -n 25 "$LOG_DIR/tests.log"
  else
    echo "=== bench_$step" >>"$LOG_DIR/bench.log"
    timeout "${BENCH_TIMEOUT:-150}" python3 "benchmarks/bench_$step.py" >>"$LOG_DIR/bench.log" 2>&1
    rc=$?
  fi
  echo "step $step rc=$rc in $(($(date +%s) - start)) s"
done
