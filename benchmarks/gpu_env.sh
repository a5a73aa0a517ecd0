# Sourced by the GPU scripts (gpu_engine_run.sh, gpu_profile_run.sh) from the repository root as
#   . benchmarks/gpu_env.sh "${1:-}" DEFAULT_LOG_DIR
# LOG_DIR: the first argument, else $OUT, else the default (created); ROOT: the repository root; unbuffered
# logs, Triton's autotune results kept on disk, and, where no package is installed (an offline GPU image),
# sits.* mapped onto the repository folders; where the image has no GGUF reader and .whl is carried
# (benchmarks/gpu_wheels.sh), gguf installed from it.
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
# The GGUF reader of the real-model steps (parity, tests) on an offline GPU image that lacks it: the wheel
# benchmarks/gpu_wheels.sh fetched, when .whl is carried (gguf itself imports only what the image has).
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sits-gguf \
    .whl/gguf-*.whl && export PYTHONPATH="/tmp/sits-gguf${PYTHONPATH:+:$PYTHONPATH}"
fi
