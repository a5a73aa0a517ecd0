#!/usr/bin/env bash
# Diagnostics on one CUDA machine, in one go: where decode time goes (torch profiler) and where the
# served ITL tail comes from (the offline engine's steps, one by one, in a closed loop).
#
#   benchmarks/gpu_profile_run.sh [LOG_DIR]          (default: $OUT, else ./gpu-profile-logs)
#   STEPS="prof1 prof32" benchmarks/gpu_profile_run.sh
#
# Steps:
#   prof1, prof32  benchmarks/profile_decode.py: Llama-3-8B shape, bf16, 2,048-token context, batch 1 / 32
#                  (every profile_decode step also prints the host's phases per step; prof256, mixed256-N and
#                  prof448fp8 write their CPU + CUDA timeline as LOG_DIR/STEP.trace.json.gz)
#   prof256        the same at batch 256, 1,024-token context (the served 256-stream runs' decode batch)
#   mixed256-N     prof256 with N prompt tokens in every step (mixed256-768: the decode budget's chunk beside
#                  256 decodes), through the piecewise CUDA graphs; mixed256-N-eager: the same steps eager
#                  (--piecewise-graph-max-tokens 0); wall against GPU busy is the time the GPU waits for the host
#   pwtests        the piecewise graphs' tests, captured and replayed (tests/runtime/test_triton_backend.py)
#   prof448fp8     the same at fp8 throughput: fp8 weights + fp8 KV cache, batch 448, 3,072-token context
#                  (the middle of a 2,048 / 2,048 run), 10 steps
#   prof32fp8      fp8 weights + fp8 KV cache at batch 32, 2,048-token context (the fp8-b32 bench's decode);
#                  prof32fp8-pdl: the same with programmatic dependent launch (SITS_PDL=1: the next kernel
#                  launches when this one's programs exit); prof32fp8-pdlearly: SITS_PDL=early (right away)
#   trace256       benchmarks/bench_step_trace.py: 256 in flight, 1,024 / 512, 512 prompts, default budget
#   trace32        the same for the bf16 step's run of gpu_engine_run.sh: 32 prompts of 2,048 / 512 at once
#                  (prefill steps apart from decode-only ones: where the end-to-end seconds go)
#   prefill4x2048  profile_decode.py over that run's prefill steps: 4 new 2,048-token prompts beside one decode
#                  a step (the 8,192-token budget), kernels by GPU time
#   trace256-capN[-minM]  the same with --max-prefill-tokens-with-decodes N [--prefill-cap-min-decodes M]
#                  (e.g. trace256-cap2048, trace256-cap1024-min64; cap0 turns the device's default off)
#   attn-rope      benchmarks/bench_attention_decode.py --rope: the decode RoPE + KV write fused into decode attention
#                  against rope_and_cache_write + the kernel, batches 1 / 32 / 256, bf16 and fp8 caches, bit for bit
#   attn-small     benchmarks/bench_attention_decode.py --small-batch: the decode attention's split count at batches
#                  1-16 (bf16 and fp8 caches), every count against the chosen one, and the fused merge beside
#                  the two launches at each count (ATTN_ARGS=--quick: batch 1 only; ATTN_ARGS="--batches=1,32
#                  --contexts=256,2048 --bf16": other batches and contexts, the bf16 cache only)
#   argmax         benchmarks/bench_argmax.py: greedy sampling's vocabulary argmax against torch.argmax
#   trace448fp8    the fp8-2k2k bench's run step by step (fp8 weights + fp8 cache, 448 prompts of 2,048 / 2,048
#                  at once): decode-only step times apart from mixed ones; trace448fp8-tableoff: the same with
#                  SITS_FP8_GEMM_TABLE=off (every fp8 GEMM on precise Triton)
#   ncu            Nsight Compute on the decode step's kernels one launch each (benchmarks/ncu_decode_kernels.py:
#                  the four projections as the small-M table routes them, and decode attention, at batches
#                  $NCU_M, default 1,32; real clocks, caches flushed): LOG_DIR/ncu.log, ncu.csv, ncu.ncu-rep
#   gemvsk         the stream-K small-M GEMM (an equal share of the weight per program): its tests on the GPU, then
#                  benchmarks/bench_gemm_small_m_streamk.py against the launch the table routes each projection to
#                  and cuBLAS, then the same for the folded-norm forms (--fold: what a folded decode step runs)
#   gemv           benchmarks/bench_gemm_small_m.py: the bf16 small-M direct GEMM (each config, then the autotuned
#                  pick) and its gate_up + SiLU·mul fusion against cuBLAS (+ silu_mul) on Llama-3-8B's projections at
#                  M = 1..64, and at M = 1..8 the decoder norm fused into qkv / gate_up + SiLU·mul against rms_norm then
#                  cuBLAS or the direct kernel, CUDA graphs; writes LOG_DIR/gemv.json and the winners' table (every op,
#                  the norm ops included) LOG_DIR/small_m_gemm_table.json (copy it to kernels/small_m_gemm_table.json);
#                  GEMV_ARGS adds flags (e.g. "--m 1,32 --no-configs --budget-s 200")
#   gemvnorm       gemv for the projections a decoder norm feeds only (qkv, gate_up; M = 1..8, the autotuned picks,
#                  GEMV_ARGS adds flags) and its norm ops merged over the committed table
#                  (benchmarks/merge_small_m_table.py): LOG_DIR/small_m_gemm_table.json, read by the -gemv steps
#   normtests      tests/kernels/test_gemm_small_m_norm.py: the fused norm + small-M GEMM on the GPU
#   prof1-gemv, prof32-gemv  prof1 / prof32 with that table installed (SITS_SMALL_M_GEMM): run after gemv in the
#                  same call, or give the table's path as SMALL_M_TABLE (LOG_DIR is emptied between calls); any
#                  batch takes these suffixes (prof8-gemv; prof8-base: batch 8 with the committed table);
#                  -fused (prof1-fused, prof1-gemv-fused, ...): with the decode attention's fused split merge
#                  (SITS_DECODE_FUSED_MERGE=1); -pdl (prof1-pdl, prof32-pdl, prof1-gemv-pdl, ...): the decode
#                  kernels launched with programmatic dependent launch (SITS_PDL=1, sits.kernels.pdl);
#                  -pdlearly (prof1-pdlearly, ...): SITS_PDL=early, the next kernel launched right after the wait;
#                  -splitN (prof1-split128, prof1-fused-split128, ...): decode attention splits keep at least N tokens
#                  (SITS_DECODE_SPLIT_TOKENS, a multiple of 16; default 256); -rope0 / -rope1 (prof1-rope0,
#                  prof32-rope0, prof32fp8-rope0, ...): the decode rows' RoPE + KV write as a launch of its own
#                  before attention / fused into the decode kernel (SITS_DECODE_FUSED_ROPE; default:
#                  attention_decode.FUSED_ROPE_DEFAULT)
#                  -fmlp (prof1-fmlp): a folded layer's MLP as one persistent launch (SITS_FUSED_MLP=1,
#                  runtime/models/fused_mlp.py)
#                  -fold0 (prof1-fold0, prof32-fold0): the decoder norms as launches of their own
#                  (SITS_FOLD_NORMS=0; by default they are folded into the projections, runtime/models/norm_fold.py)
#                  -mmlN (prof1-mml131072, prof4-mml32768): --max-model-len N, so the CUDA graphs' block tables (and
#                  the bound their decode attention is told) span N tokens while the context stays 2,048
#                  -gb1 / -gb0 (prof1-mml131072-gb1, ...): decode graphs of batch sizes that split contexts captured
#                  at several context bounds, a step replaying the smallest that holds its contexts / at
#                  max_model_len alone (SITS_DECODE_GRAPH_BOUNDS; default: attention/triton.py GRAPH_BOUNDS_DEFAULT)
#                  -f32act (prof1-f32act, prof32-f32act): --activation-dtype float32, whose decode projections now
#                  run the small-M kernels on float32 rows (two terms a tile) instead of mixed_linear's three launches
#                  -hvNAME (prof1-hvswap_g_f, prof32-hvbase_f, ...): the bf16 cache's decode attention inner loop
#                  NAME (SITS_DECODE_VARIANT, a key of decode_schedules.HALF_DECODE_VARIANTS; default "base")
#   f32xtests      tests/kernels/test_gemm_small_m_float32_x.py on the GPU: every config the autotuner keeps for a
#                  float32 x compiles and gives the float32 product (bf16 weights)
#   foldtests      the folded norms' kernels (tests/kernels/test_gemm_small_m_fold.py) and the split-K kernel
#                  they extend, then the engine with and without them teacher-forced (tests/gpu/test_norm_fold.py)
#   ropetests      the fused decode RoPE + KV write against the two launches, bit for bit (bf16 and fp8 caches,
#                  autotuned and fixed schedules), through the engine, and captured in CUDA graphs
#   hvtests        decode attention's inner loops over a bf16 cache (tests/kernels/test_attention_decode_half_variants.py:
#                  each against the reference, and fused RoPE bit for bit at the Llama layout)
#   attntests      every decode attention test module on the GPU (the split kernel, fused RoPE, fused merge, inner
#                  loops) and the engine's decode graphs (split counters, context bounds), failures listed (-rf)
#   l2pf           benchmarks/bench_l2_prefetch.py: a projection's weight prefetched into L2 during the small
#                  kernels before it (attention + o_proj, norm + qkv, norm + gate_up), against the same chain
#                  without (2026-12-03: a loss, the prefetch launch holds the stream; benchmarks/RESULTS.md), and
#                  the prefetch on a stream beside the attention (2026-12-04: a loss too)
#   l2rows         bench_l2_prefetch.py --quick: gate_up's weight-row prefixes prefetched into L2 on a stream
#                  beside the attention and o_proj, against the same chain without; and what a landed prefix
#                  saves gate_up alone, and the prefixes marked evict-last (first the prefetch kernels' GPU tests);
#                  2026-12-05 on an H100: a loss (benchmarks/RESULTS.md)
#   floor          benchmarks/bench_stream_floor.py: a kernel that only reads a batch-1 decode layer's bytes (each
#                  projection's weight, the live K / V, lm_head) against cuBLAS on the same weight, the fixed cost
#                  per launch fitted, and a step's floor under one kernel per operation
#   fused-floor    benchmarks/bench_fused_floor.py: a decode layer's five reads in one persistent launch with grid
#                  barriers between them (the next phase's first tiles loaded before each wait), against five kernels
#                  back to back and one read of the same bytes: what one launch a layer could save at batch 1
#   fmlptests      tests/kernels/test_fused_mlp.py on the GPU: the fused MLP launch against its two launches, bit for
#                  bit, at Llama-3-8B's shapes (the whole cooperative grid) and replayed from a CUDA graph
#   fused-mlp      benchmarks/bench_fused_mlp.py: the engine's folded batch-1 MLP in one persistent launch with a grid
#                  barrier (sits.kernels.fused_mlp, five configs, some with the L2 prefetch before the barrier),
#                  against the engine's two launches at the table's configs
#   attn-l2        benchmarks/bench_attention_decode_l2.py: decode attention at batches 1 and 4 with its K / V cold against
#                  already in L2, autotuned and at each bf16 schedule: the most a prefetch of K / V could take off
#   attn-bound     benchmarks/bench_attention_decode_bound.py: decode attention at batches 1 and 4 told a 131,072-token
#                  bound (a CUDA graph's max_model_len) against the context's, autotuned, at the tight launch's
#                  tiles and with the fused merge: what the long bound's extra 2.7 µs a layer at batch 1 comes from;
#                  and at the decode graphs' smallest context bound that holds the context (SITS_DECODE_GRAPH_BOUNDS=1)
#   ncu-attn       Nsight Compute on decode attention alone (ncu_decode_kernels.py --attention-only, batch $NCU_M,
#                  default 1) with the warp-state samples per SASS instruction (SourceCounters, a sample every 32
#                  cycles): LOG_DIR/ncu-attn.log, ncu-attn-source.csv (the source page), ncu-attn.ncu-rep
#   pdltests       tests/kernels/test_pdl.py: the decode chain with and without PDL in a CUDA graph, bit for bit
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh "${1:-}" gpu-profile-logs
STEPS=${STEPS:-"prof1 prof32 trace256"}
COMMON="--config ${BENCH_CONFIG:-llama-3-8b} --peer none --log-level warning"
for step in $STEPS; do
  start=$(date +%s)
  case $step in
    prof1) timeout 200 python3 benchmarks/profile_decode.py $COMMON --batch 1 --input-len 2048 ;;
    prof32) timeout 200 python3 benchmarks/profile_decode.py $COMMON --batch 32 --input-len 2048 ;;
    prof256) timeout 240 python3 benchmarks/profile_decode.py $COMMON --batch 256 --input-len 1024 --steps 20 \
      --chrome-trace "$LOG_DIR/$step.trace.json.gz" ;;
    mixed256-*) tokens=${step#mixed256-}; eager=""
      case $tokens in *-eager) tokens=${tokens%-eager}; eager="--piecewise-graph-max-tokens 0" ;; esac
      timeout 240 python3 benchmarks/profile_decode.py $COMMON --batch 256 --input-len 1024 --steps 20 \
      --mixed-prompt-tokens "$tokens" $eager --chrome-trace "$LOG_DIR/$step.trace.json.gz" ;;
    pdltests) PYTHONSAFEPATH=1 timeout 240 python3 -m pytest tests/kernels/test_pdl.py -q -s -p no:cacheprovider \
      --confcutdir=tests/kernels ;;
    ropetests) PYTHONSAFEPATH=1 timeout 500 python3 -m pytest tests/kernels/test_attention_decode_rope.py \
      tests/runtime/test_decode_fused_rope.py tests/gpu/test_decode_fused_rope_graphs.py -q -s -p no:cacheprovider \
      --confcutdir=tests ;;
    attntests) PYTHONSAFEPATH=1 timeout 590 python3 -m pytest tests/kernels/test_attention_decode.py \
      tests/kernels/test_attention_decode_rope.py tests/kernels/test_attention_decode_fused.py \
      tests/kernels/test_attention_decode_half_variants.py tests/runtime/test_triton_split_counters.py \
      tests/runtime/test_decode_graph_bounds.py -q -rf -p no:cacheprovider --confcutdir=tests ;;
    hvtests) PYTHONSAFEPATH=1 timeout 400 python3 -m pytest tests/kernels/test_attention_decode_half_variants.py -q \
      -p no:cacheprovider --confcutdir=tests/kernels ;;
    pwtests) PYTHONSAFEPATH=1 timeout 240 python3 -m pytest tests/runtime/test_triton_backend.py -q -s \
      -p no:cacheprovider --confcutdir=tests -k "piecewise or padded" ;;
    prof448fp8) timeout 400 python3 benchmarks/profile_decode.py $COMMON --batch 448 --input-len 3072 \
      --quantization fp8 --kv-cache-dtype fp8 --steps 10 --chrome-trace "$LOG_DIR/$step.trace.json.gz" ;;
    prof32fp8|prof32fp8-*) pdl=""; rope=""
      case $step in *-pdlearly*) pdl=early ;; *-pdl*) pdl=1 ;; esac
      case $step in *-rope0*) rope=0 ;; *-rope1*) rope=1 ;; esac
      SITS_PDL="$pdl" SITS_DECODE_FUSED_ROPE="$rope" timeout 300 \
      python3 benchmarks/profile_decode.py $COMMON --batch 32 --input-len 2048 \
      --quantization fp8 --kv-cache-dtype fp8 ;;
    trace32) timeout 300 python3 benchmarks/bench_step_trace.py $COMMON --batch 32 --input-len 2048 \
      --output-len 512 --prompts 32 --json "$LOG_DIR/$step.json" ;;
    prefill4x2048) timeout 300 python3 benchmarks/profile_decode.py $COMMON --batch 1 --input-len 2048 \
      --mixed-prompt-tokens 2048 --mixed-prompts 4 --max-num-batched-tokens 8256 --steps 6 ;;
    trace256) timeout 300 python3 benchmarks/bench_step_trace.py $COMMON --batch 256 --input-len 1024 \
      --output-len 512 --prompts 512 --host-phases --json "$LOG_DIR/$step.json" ;;
    attn-rope) timeout 400 python3 benchmarks/bench_attention_decode.py --rope --json "$LOG_DIR/attn-rope.json" \
      ${ATTN_ARGS:-} ;;
    attn-small) timeout 600 python3 benchmarks/bench_attention_decode.py --small-batch --json "$LOG_DIR/attn-small.json" \
      ${ATTN_ARGS:-} ;;
    l2pf) timeout 300 python3 benchmarks/bench_l2_prefetch.py --json "$LOG_DIR/l2pf.json" ;;
    l2rows) PYTHONSAFEPATH=1 timeout 120 python3 -m pytest tests/kernels/test_l2_prefetch.py -q -p no:cacheprovider \
      --confcutdir=tests/kernels -rf
      timeout 300 python3 benchmarks/bench_l2_prefetch.py --quick --json "$LOG_DIR/l2rows.json" ;;
    floor) timeout 300 python3 benchmarks/bench_stream_floor.py --json "$LOG_DIR/floor.json" ;;
    fused-floor) timeout 240 python3 benchmarks/bench_fused_floor.py --json "$LOG_DIR/fused-floor.json" ;;
    fused-mlp) timeout 240 python3 benchmarks/bench_fused_mlp.py --json "$LOG_DIR/fused-mlp.json" ;;
    fmlptests) PYTHONSAFEPATH=1 timeout 240 python3 -m pytest tests/kernels/test_fused_mlp.py -q -p no:cacheprovider \
      --confcutdir=tests/kernels ;;
    argmax) timeout 120 python3 benchmarks/bench_argmax.py --json "$LOG_DIR/argmax.json" ;;
    trace448fp8) timeout 400 python3 benchmarks/bench_step_trace.py $COMMON --batch 448 --input-len 2048 \
      --output-len "${TRACE448_OUTPUT_LEN:-2048}" --prompts 448 --quantization fp8 --kv-cache-dtype fp8 \
      --warmup-output-len 4 --host-phases --json "$LOG_DIR/$step.json" ;;
    trace448fp8-tableoff) SITS_FP8_GEMM_TABLE=off timeout 400 python3 benchmarks/bench_step_trace.py $COMMON \
      --batch 448 --input-len 2048 --output-len "${TRACE448_OUTPUT_LEN:-2048}" --prompts 448 --quantization fp8 \
      --kv-cache-dtype fp8 --warmup-output-len 4 \
      --host-phases --json "$LOG_DIR/$step.json" ;;
    gemv) timeout 600 python3 benchmarks/bench_gemm_small_m.py --json "$LOG_DIR/gemv.json" \
      --table "$LOG_DIR/small_m_gemm_table.json" ${GEMV_ARGS:-} ;;
    gemvnorm) timeout 600 python3 benchmarks/bench_gemm_small_m.py --json "$LOG_DIR/gemvnorm.json" \
      --proj qkv,gate_up --m 1,2,4,8 --no-configs --table "$LOG_DIR/gemvnorm-table.json" ${GEMV_ARGS:-} \
      && python3 benchmarks/merge_small_m_table.py kernels/small_m_gemm_table.json "$LOG_DIR/gemvnorm-table.json" \
      "$LOG_DIR/small_m_gemm_table.json" norm_linear,norm_silu_mul ;;
    gemvsk) PYTHONSAFEPATH=1 timeout 200 python3 -m pytest tests/kernels/test_gemm_small_m_streamk.py -q \
      -p no:cacheprovider --confcutdir=tests/kernels; timeout 300 python3 benchmarks/bench_gemm_small_m_streamk.py \
      ${GEMVSK_ARGS:-} && timeout 300 python3 benchmarks/bench_gemm_small_m_streamk.py --fold ${GEMVSK_ARGS:-} ;;
    ncu) ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 400 "$ncu_bin" --profile-from-start off --clock-control none --cache-control all -f -o "$LOG_DIR/ncu" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats \
        python3 benchmarks/ncu_decode_kernels.py --m "${NCU_M:-1,32}" \
        && "$ncu_bin" --import "$LOG_DIR/ncu.ncu-rep" --page details \
        && "$ncu_bin" --import "$LOG_DIR/ncu.ncu-rep" --page details --csv >"$LOG_DIR/ncu.csv" ;;
    attn-bound) timeout 300 python3 benchmarks/bench_attention_decode_bound.py --json "$LOG_DIR/attn-bound.json" ;;
    attn-l2) timeout 300 python3 benchmarks/bench_attention_decode_l2.py --json "$LOG_DIR/attn-l2.json" ;;
    ncu-attn) ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 300 "$ncu_bin" --profile-from-start off --clock-control none --cache-control all -f -o "$LOG_DIR/ncu-attn" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section SourceCounters --warp-sampling-interval 0 \
        python3 benchmarks/ncu_decode_kernels.py --m "${NCU_M:-1}" --attention-only \
        && "$ncu_bin" --import "$LOG_DIR/ncu-attn.ncu-rep" --page details \
        && "$ncu_bin" --import "$LOG_DIR/ncu-attn.ncu-rep" --page source --csv --print-source sass \
          >"$LOG_DIR/ncu-attn-source.csv" ;;
    foldtests) PYTHONSAFEPATH=1 timeout 400 python3 -m pytest tests/kernels/test_gemm_small_m_fold.py \
      tests/kernels/test_gemm_small_m_splitk.py -q -p no:cacheprovider \
      --confcutdir=tests/kernels && PYTHONSAFEPATH=1 timeout 300 python3 -m pytest tests/gpu/test_norm_fold.py -q -s \
      -p no:cacheprovider --confcutdir=tests/gpu ;;
    normtests) PYTHONSAFEPATH=1 timeout 240 python3 -m pytest tests/kernels/test_gemm_small_m_norm.py -q -s \
      -p no:cacheprovider --confcutdir=tests/kernels ;;
    f32xtests) PYTHONSAFEPATH=1 timeout 300 python3 -m pytest tests/kernels/test_gemm_small_m_float32_x.py -q \
      -p no:cacheprovider --confcutdir=tests/kernels ;;
    prof[0-9]*-*) batch=${step#prof}; batch=${batch%%-*}; table=""; fused=""; pdl=""; split=""; rope=""
      case $step in *-gemv*) table="${SMALL_M_TABLE:-$LOG_DIR/small_m_gemm_table.json}" ;; esac
      case $step in *-split*) split=${step##*-split}; split=${split%%-*} ;; esac
      case $step in *-fused*) fused=1 ;; esac
      case $step in *-pdlearly*) pdl=early ;; *-pdl*) pdl=1 ;; esac
      case $step in *-rope0*) rope=0 ;; *-rope1*) rope=1 ;; esac
      fold=""; case $step in *-fold0*) fold=0 ;; esac
      fmlp=""; case $step in *-fmlp*) fmlp=1 ;; esac
      bounds=""; case $step in *-gb0*) bounds=0 ;; *-gb1*) bounds=1 ;; esac
      extra=""; case $step in *-mml*) extra=${step##*-mml}; extra="--max-model-len ${extra%%-*}" ;; esac
      case $step in *-f32act*) extra="$extra --activation-dtype float32" ;; esac
      variant=""; case $step in *-hv*) variant=${step##*-hv}; variant=${variant%%-*} ;; esac
      SITS_SMALL_M_GEMM="$table" SITS_DECODE_FUSED_MERGE="$fused" SITS_PDL="$pdl" SITS_DECODE_SPLIT_TOKENS="$split" \
      SITS_DECODE_FUSED_ROPE="$rope" SITS_FOLD_NORMS="$fold" SITS_DECODE_VARIANT="$variant" \
      SITS_DECODE_GRAPH_BOUNDS="$bounds" SITS_FUSED_MLP="$fmlp" timeout 200 \
      python3 benchmarks/profile_decode.py $COMMON --batch "$batch" --input-len 2048 $extra ;;
    trace256-cap*) budget=${step#trace256-cap}; cap=${budget%%-min*}; least=0
      [ "$budget" != "$cap" ] && least=${budget##*-min}
      timeout 300 python3 benchmarks/bench_step_trace.py $COMMON --batch 256 --input-len 1024 \
      --output-len 512 --prompts 512 --max-prefill-tokens-with-decodes "$cap" --prefill-cap-min-decodes "$least" ;;
    *) echo "unknown step $step" ;;
  esac >"$LOG_DIR/$step.log" 2>&1
  echo "== $step: exit $? in $(( $(date +%s) - start )) s" | tee -a "$LOG_DIR/summary.md"
  tail -45 "$LOG_DIR/$step.log" >>"$LOG_DIR/summary.md"
done
cat "$LOG_DIR/summary.md"
