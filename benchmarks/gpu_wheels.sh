#!/usr/bin/env bash
# The Python packages the served stack needs that an offline GPU image may lack, as wheels for CPython 3.12 on
# x86-64 Linux, at the versions this checkout's .venv runs. The GPU image of 2026-12-02 (torch 2.11, triton 3.6,
# transformers 5.17, aiohttp, uvloop, prometheus-client, jinja2) had none of these; without them `sits serve`
# exits at start-up there (fastapi needs opentelemetry-api, the grammar worker imports xgrammar).
#
#   benchmarks/gpu_wheels.sh [DIR]      (default: .whl, ignored by git; ~5 MB)
#
# On the GPU machine, before a step that serves (benchmarks/gpu_serving_run.sh installs them itself when DIR is
# .whl and the package cannot be imported):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -eu
DIR=${1:-.whl}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions uvicorn
httptools opentelemetry-api xgrammar apache-tvm-ffi gguf"
mkdir -p "$DIR"
pins=()
for name in $PACKAGES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$version" ] || { echo "gpu_wheels.sh: $name is not installed in $PY's environment (make setup)" >&2; exit 1; }
  pins+=("$name==$version")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
count=$(ls "$DIR"/*.whl 2>/dev/null | wc -l)
echo "gpu_wheels.sh: $count wheels in $DIR ($(du -sh "$DIR" | cut -f1)) for: ${pins[*]}"
[ "$count" -ge "${#pins[@]}" ] || { echo "gpu_wheels.sh: expected ${#pins[@]} wheels" >&2; exit 1; }
