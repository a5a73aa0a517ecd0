#!/usr/bin/env bash
# The tensor-parallel benchmark in one call on a 2-GPU machine: TP=1 and TP=2 in the same run.
#
#   benchmarks/bench_tensor_parallel.sh [extra bench_tensor_parallel.py flags]
#
# Works with or without an installed `sits` package (an offline GPU image maps the folders).
# NCCL settings come from the environment when set there (NCCL_NVLS_ENABLE=0 stays as the host set it).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if ! python3 -c "import sits.runtime.parallel" 2>/dev/null; then
  SHIM=$(mktemp -d)
  mkdir -p "$SHIM/sits" && touch "$SHIM/sits/__init__.py"
  ln -s "$ROOT/kernels" "$SHIM/sits/kernels" && ln -s "$ROOT/runtime" "$SHIM/sits/runtime"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
nvidia-smi topo -m 2>/dev/null || true
exec python3 benchmarks/bench_tensor_parallel.py --tp-sizes 1,2 --json "${OUT:-.}/bench_tensor_parallel.json" "$@"
