# Sourced by the GPU scripts (gpu_engine_run.sh, gpu_profile_run.sh) from the repository root as
#   . benchmarks/gpu_env.sh "${1:-}" DEFAULT_LOG_DIR
# LOG_DIR: the first argument, else $OUT, else the default (created); ROOT: the repository root; unbuffered
# logs, Triton's autotune results kept on disk, and, where no package is installed (an offline GPU image),
# sits.* mapped onto the repository folders.
LOG_DIR=${1:-${OUT:-$2}}
mkdir -p "$LOG_DIR"
ROOT=$PWD
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
if ! python3 -c "import sits.runtime.engine.engine" 2>/dev/null; then
  SHIM=$(mktemp -d)
  mkdir -p "$SHIM/sits" && touch "$SHIM/sits/__init__.py"
  ln -s "$PWD/kernels" "$SHIM/sits/kernels" && ln -s "$PWD/runtime" "$SHIM/sits/runtime"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
