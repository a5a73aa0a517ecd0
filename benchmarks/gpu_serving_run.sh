#!/usr/bin/env bash
# Served against offline on one CUDA machine, in one go: the Llama-3-8B shape with random weights
# (`sits serve --load-format dummy`), `sits bench serve` through HTTP against offline `sits bench` of the
# same engine in the same run. Each step has its own time limit and runs even when an earlier one failed.
#
#   benchmarks/gpu_serving_run.sh [LOG_DIR]        (default: $OUT, else ./gpu-serving-logs)
#   STEPS="c256 c32" benchmarks/gpu_serving_run.sh
#
# Steps (most important first):
#   c256   random 1,024 in / 512 out: offline `sits bench --batch 256`, then served at --max-concurrency 256
#          with $C256_PROMPTS prompts (default 1,024)
#   c32    2,048 / 512: offline batch 32, served at concurrency 32 ($C32_PROMPTS, default 128)
#   c1     2,048 / 128: offline batch 1, served at concurrency 1 ($C1_PROMPTS, default 12)
#   budget c256 served again with --max-prefill-tokens-with-decodes $BUDGET_ALT (default 2048)
#   c256-2, c32-2, ... (any suffix)  the same step again under its own name, for the spread between pairs
# Extra engine flags for every step: $ENGINE_ARGS. The summary (each step's figures and ratio) is printed
# last and written to LOG_DIR/summary.md, with each served run's engine steps by class (the engine
# process's SITS_ENGINE_STEP_TRACE, in LOG_DIR/<step>-steps/; benchmarks/step_trace_report.py). The
# server's packages: where the image lacks them, run benchmarks/gpu_wheels.sh beforehand and carry .whl
# (installed into /tmp/sits-site before the first step).
set -u
LOG_DIR=${1:-${OUT:-gpu-serving-logs}}
mkdir -p "$LOG_DIR"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TRITON_CACHE_AUTOTUNING=1
if ! python3 -c "import sits.runtime.engine.engine" 2>/dev/null; then
  SHIM=$(mktemp -d)  # no installed package (an offline GPU image): map sits.* onto the repository folders
  mkdir -p "$SHIM/sits" && touch "$SHIM/sits/__init__.py"
  for part in kernels runtime operator; do ln -s "$ROOT/$part" "$SHIM/sits/$part"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import fastapi, uvicorn, xgrammar" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  # an offline GPU image without the server's packages: the wheels benchmarks/gpu_wheels.sh fetched (carry .whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sits-site \
    .whl/*.whl && export PYTHONPATH="/tmp/sits-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Fail in seconds, not after each step's offline run, when `sits serve` could not start here.
if ! missing=$(python3 -c "import sits.runtime.server.app, uvicorn, httptools, xgrammar" 2>&1); then
  echo "gpu_serving_run.sh: the server cannot start on this machine (run benchmarks/gpu_wheels.sh and carry .whl):"
  echo "$missing" | tail -n 1
  exit 3
fi
CONFIG=${CONFIG:-llama-3-8b}
VOCAB=$(python3 -c "from sits.runtime.models.presets import preset_config as p; print(p('$CONFIG').vocab_size)")
SITS="python3 -m sits.runtime"
ENGINE_ARGS=${ENGINE_ARGS:-}
SUMMARY="$LOG_DIR/summary.md"
STEPS=${STEPS:-"c256 c32 c1 budget"}

offline() {  # name batch in out
  timeout "${OFFLINE_TIMEOUT:-240}" $SITS bench --config "$CONFIG" --batch "$2" --input-len "$3" --output-len "$4" \
    --peer none --max-num-seqs "$2" $ENGINE_ARGS --json "$LOG_DIR/$1-offline.json" >"$LOG_DIR/$1-offline.log" 2>&1
}

served() {  # name concurrency prompts in out [extra serve args]
  local serve="--load-format dummy --config $CONFIG --max-num-seqs $2 --max-waiting-requests $3 \
--max-model-len $(($4 + $5 + 16)) --log-level warning $ENGINE_ARGS ${6:-}"
  SITS_ENGINE_STEP_TRACE="$LOG_DIR/$1-steps" \
  timeout "${SERVED_TIMEOUT:-300}" $SITS bench serve --launch "$serve" --num-prompts "$3" --max-concurrency "$2" \
    --random-input-len "$4" --random-output-len "$5" --vocab-size "$VOCAB" --no-progress \
    --json "$LOG_DIR/$1-served.json" >"$LOG_DIR/$1-served.log" 2>&1
}

compare() {  # name offline-json-prefix: one summary line with both figures and the ratio
  python3 - "$LOG_DIR" "$1" "$2" <<'PY' | tee -a "$SUMMARY"
import json, sys
log_dir, name, offline_name = sys.argv[1:]
try:
    off = json.load(open(f"{log_dir}/{offline_name}-offline.json"))["results"][0]
    srv = json.load(open(f"{log_dir}/{name}-served.json"))["results"]
except (OSError, KeyError, ValueError) as error:
    print(f"| {name} | missing result: {error} |")
    raise SystemExit(0)
ms = lambda d, k: 1000 * d[k]
num = lambda d, k, digits=2: "n/a" if d.get(k) is None else f"{d[k]:.{digits}f}"
print(f"| {name} | served {srv['output_throughput']:.0f} out tok/s vs offline {off['output_tok_s']:.0f} = "
      f"{srv['output_throughput'] / off['output_tok_s']:.3f}x | served ITL p50 {srv['itl_ms']['median']:.2f} ms "
      f"p99 {srv['itl_ms']['p99']:.2f} ms (p99/p50 {srv['itl_ms']['p99'] / srv['itl_ms']['median']:.2f}); offline ITL "
      f"p50 {ms(off, 'itl_p50_s'):.2f} p99 {ms(off, 'itl_p99_s'):.2f} ms | TTFT p50 {srv['ttft_ms']['median']:.0f} ms "
      f"p99 {srv['ttft_ms']['p99']:.0f} ms | failed {srv['failed']} | prefix hit rate {srv.get('prefix_cache_hit_rate')} "
      f"| preemptions {srv.get('preemptions')} | mean engine step {num(srv, 'mean_engine_step_ms')} ms | CPU cores "
      f"engine {num(srv, 'engine_cpu_cores')} API {num(srv, 'server_cpu_cores')} | tokens/chunk "
      f"{num(srv, 'output_tokens_per_chunk', 3)} |")
PY
}

echo "# GPU serving run $(date -u +%Y-%m-%dT%H:%MZ), $CONFIG, engine args: ${ENGINE_ARGS:-none}" >"$SUMMARY"
for step in $STEPS; do
  start=$(date +%s)
  s=$step  # a step again under its own name: c256-2 runs c256 and writes c256-2-*.json (the spread in one call)
  case $step in
    c256|c256-*) offline "$s" 256 1024 512; served "$s" 256 "${C256_PROMPTS:-1024}" 1024 512; compare "$s" "$s" ;;
    c32|c32-*) offline "$s" 32 2048 512; served "$s" 32 "${C32_PROMPTS:-128}" 2048 512; compare "$s" "$s" ;;
    c1|c1-*) offline "$s" 1 2048 128; served "$s" 1 "${C1_PROMPTS:-12}" 2048 128; compare "$s" "$s" ;;
    budget) served budget 256 "${C256_PROMPTS:-1024}" 1024 512 \
              "--max-prefill-tokens-with-decodes ${BUDGET_ALT:-2048}"; compare budget c256 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  [ -d "$LOG_DIR/$s-steps" ] && python3 benchmarks/step_trace_report.py "$LOG_DIR/$s-steps" \
    --json "$LOG_DIR/$s-steps.json" | tee -a "$SUMMARY"
  echo "step $step in $(($(date +%s) - start)) s" | tee -a "$SUMMARY"
done
cat "$SUMMARY"
