"""Decode attention on the GPU: SITS's paged split-KV kernel against SDPA over a contiguous cache.

    python benchmarks/bench_attention_decode.py [--json out.json] [--quick]
    TRITON_CACHE_AUTOTUNING=1 python benchmarks/bench_attention_decode.py --fp8 [--json out.json]
    python benchmarks/bench_attention_decode.py --fp8 --variants [--json out.json] [--quick]
    python benchmarks/bench_attention_decode.py --small-batch [--batches=1,2,4,8,16] [--contexts=2048] [--bf16]
        [--json out.json]
    python benchmarks/bench_attention_decode.py --rope [--json out.json] [--quick]

One query token per sequence, GQA 32 query / 8 KV heads, head_dim 128, bf16. The figure is the
effective bandwidth: bytes of live K and V (B * context * Hkv * D * 2 tensors * 2 bytes) over the
time. SITS reads them through block tables from a 16-token-block paged cache (blocks shuffled);
SDPA reads a contiguous [B, Hkv, S, D] cache holding exactly the live tokens (its best case).

--fp8 times SITS's kernel over an fp8 (e4m3, per-KV-head scales) cache instead, in one run: the
float16 dots (fp8_via_float16=True, the default) against the tiles upcast to bf16 (False, the
first implementation), beside the bf16 kernel at the same shape. Bandwidth counts the bytes each
kernel reads (1 byte per fp8 element, 2 per bf16 one) and is also given as a share of the H200's
4.29 TB/s (HBM_PEAK_GBPS) and of this run's measured copy bandwidth. Small cases rotate over
several block tables so the timed reads do not come from L2.

--fp8 --variants compares the fp8 kernel's inner-loop variants (FP8_DECODE_VARIANTS) and fixed
schedules (BLOCK_N, num_warps, num_stages) in one run, at batch 448 / context 3,072, 256 / 2,048,
32 / 2,048 and 1 / 2,048: per candidate its time, GB/s, share of the copy bandwidth measured in the
same run, and its max abs error against kernels/reference.py (float32) on the same fp8 cache, beside
the autotuned default and the bf16 kernel. Every candidate is compiled ahead in parallel.

--small-batch sweeps the split count where it decides the time: batches 1 to 16 (--batches=... for others) at context
2,048 (--contexts=...), bf16 and fp8 caches (--bf16: bf16 only), every split count the 128-token split granule
allows (1 to 16) beside the one `choose_num_splits` picks (the peer, same run), each timed in CUDA graphs over block
tables rotated past L2 (at batch 1 the live K and V are 8 MiB, which L2 would otherwise serve). At every split count
the fused merge (split_counters: the last split merges, one launch) is timed beside the two launches (split kernel +
merge kernel), with their ratio, and a second row per case sets the fused merge's best count against the two
launches' best; the fused outputs are checked bit for bit against the two launches'.

Each case also times the chosen split count for a launch told its contexts reach WIDE_BOUND (131,072) tokens, as
CUDA graphs captured for that max_model_len launch it, against the launch told the real context (the peer), and the
chosen count with SITS_DECODE_SPLIT_TOKENS at each of MIN_TOKENS_SWEEP (256 to 32: down to 64 splits of 32 tokens
at batch 1 and 2,048 tokens, 512 programs; the fastest reads of bench_stream_floor.py ran 8 programs a multiprocessor),
both merges, and over the bf16 cache with the decode RoPE + KV write fused in as the engine runs it. Over the bf16
cache it also times the chosen count, RoPE fused, in each inner loop of HALF_VARIANT_SWEEP (SITS_DECODE_VARIANT).

--rope times the decode RoPE + KV write fused into the kernel (rope=DecodeRope: one launch) against
rope_and_cache_write followed by the kernel (two launches), as a decode layer runs them: CUDA graphs, batches
1, 32 and 256 at context 2,048, bf16 and fp8 caches, with the output and the cache checked bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, hbm_copy_gbps, parse_args, report, rotating, time_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from sits.kernels import attention_decode, decode_schedules, decode_splits
from sits.kernels.attention_decode import (
    DEFAULT_FP8_VARIANT,
    FP8_DECODE_VARIANTS,
    DecodeRope,
    choose_num_splits,
    paged_decode_attention,
)
from sits.kernels.reference import paged_decode_attention_reference
from sits.kernels.rope_kv_write import build_cos_sin_cache, rope_and_cache_write

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
HBM_PEAK_GBPS = 4290.0  # H200 HBM3e peak
FP8_CASES = [(448, 3072), (32, 2048), (1, 2048)]  # (batch, context); 16-token blocks
MIN_ROTATED_FP8_BYTES = 256 << 20  # K + V fp8 bytes the rotated tables cover at least (> L2)
DEVICE = "cuda"


def _sdpa(q, k, v, backend=None):
    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def bench_case(batch, context, block_size, sweep_splits) -> tuple[list[Measurement], list[str]]:
    dtype = torch.bfloat16
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    peers = {
        "SDPA (default)": _sdpa(q, k, v),
        "SDPA flash": _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION),
        "SDPA efficient": _sdpa(q, k, v, SDPBackend.EFFICIENT_ATTENTION),
        "SDPA cuDNN": _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
    }
    peer_name, peer_ms, all_ms = best_peer(peers, kv_bytes)

    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device="cuda")
    k_cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.permute(0, 2, 1, 3).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    v_cache[perm] = v.permute(0, 2, 1, 3).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    flat_q = q[:, :, 0].contiguous()
    out = torch.empty_like(flat_q)
    auto = choose_num_splits(batch, NUM_KV_HEADS, context, q.device)
    split_ms = {}
    for splits in sorted({auto, *(sweep_splits if sweep_splits else ())}):
        split_ms[splits] = time_ms(
            lambda s=splits: paged_decode_attention(flat_q, k_cache, v_cache, tables, seq_lens, scale, out=out, num_splits=s)
        )
    ours_ms = split_ms[auto]
    paged_decode_attention(flat_q, k_cache, v_cache, tables, seq_lens, scale, out=out)
    reference = peers["SDPA (default)"]()[:, :, 0]
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    gbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    case = f"B{batch} ctx{context} block{block_size}"
    extra = {n: round(gbps(ms), 1) for n, ms in all_ms.items()} | {"rel_err": error, "auto_splits": auto}
    note = f"{case} splits sweep (GB/s): " + ", ".join(f"{s}: {gbps(ms):,.0f}" for s, ms in split_ms.items())
    print(note, "| peers:", extra, flush=True)
    row = Measurement(case, "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms, extra)
    return [row], [note]


def _fp8_caches(batch, context, block_size):
    """bf16 paged K/V, their fp8 copies (torch's cast, per-KV-head scales amax / 448) and `copies`
    block-table sets over disjoint shuffled blocks. Returns (bf16 pair, fp8 pair, scales, tables)."""
    blocks_per_seq = context // block_size
    fp8_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    copies = max(1, -(-MIN_ROTATED_FP8_BYTES // fp8_bytes))
    num_blocks = copies * batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    bf16 = [torch.randn(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    scales, fp8 = [], []
    for cache in bf16:
        scale = cache.abs().amax(dim=(0, 1, 3)).float() / 448.0
        scales.append(scale)
        fp8.append((cache.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn))
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    tables = [t.view(batch, blocks_per_seq) for t in perm.chunk(copies)]
    return bf16, fp8, scales, tables


def bench_fp8_case(batch, context, block_size, copy_gbps) -> tuple[Measurement, str]:
    """fp8 float16 dots (ours) against fp8 upcast to bf16 (peer), with the bf16 kernel beside."""
    scale = HEAD_DIM**-0.5
    (k16, v16), (k8, v8), (ks, vs), tables = _fp8_caches(batch, context, block_size)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    outs = {name: torch.empty_like(q) for name in ("f16", "upcast", "bf16")}

    def kernel(name):
        def call(i):
            if name == "bf16":
                return paged_decode_attention(q, k16, v16, tables[i], seq_lens, scale, out=outs[name])
            return paged_decode_attention(q, k8, v8, tables[i], seq_lens, scale, out=outs[name], k_scale=ks,
                                          v_scale=vs, fp8_via_float16=name == "f16")
        return rotating(call, len(tables))

    ms = {name: time_ms(kernel(name)) for name in outs}
    for name in outs:  # the last call of each used different tables: recompute on table set 0
        kernel(name)()
    fp8_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    gbps = {name: (2 * fp8_bytes if name == "bf16" else fp8_bytes) / (t * 1e-3) / 1e9 for name, t in ms.items()}
    rel = lambda a, b: ((outs[a].float() - outs[b].float()).norm() / outs[b].float().norm()).item()  # noqa: E731
    extra = {f"{n}_gbps": round(g, 1) for n, g in gbps.items()} | {
        f"{n}_of_peak": round(g / HBM_PEAK_GBPS, 3) for n, g in gbps.items()
    } | {f"{n}_of_copy": round(g / copy_gbps, 3) for n, g in gbps.items()} | {
        f"{n}_ms": round(t, 4) for n, t in ms.items()
    } | {"f16_vs_upcast_rel_err": rel("f16", "upcast"), "f16_vs_bf16_rel_err": rel("f16", "bf16"), "copies": len(tables)}
    case = f"B{batch} ctx{context} block{block_size}"
    note = (f"{case}: fp8 f16 dots {gbps['f16']:,.0f} GB/s ({gbps['f16'] / HBM_PEAK_GBPS:.2f} of 4.29 TB/s), "
            f"fp8 upcast to bf16 {gbps['upcast']:,.0f} GB/s ({gbps['upcast'] / HBM_PEAK_GBPS:.2f}), "
            f"bf16 {gbps['bf16']:,.0f} GB/s ({gbps['bf16'] / HBM_PEAK_GBPS:.2f}); ms {extra['f16_ms']} / "
            f"{extra['upcast_ms']} / {extra['bf16_ms']}; rel err f16 vs upcast {extra['f16_vs_upcast_rel_err']:.2e}, "
            f"vs bf16 {extra['f16_vs_bf16_rel_err']:.2e}")  # fmt: skip
    print(note, flush=True)
    row = Measurement(case, "GB/s", gbps["f16"], gbps["upcast"], "fp8 upcast to bf16", ms["f16"], ms["upcast"], extra)
    return row, note


def fp8_main(args):
    copy_gbps = hbm_copy_gbps()
    rows, notes = [], [f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s"]
    for batch, context in FP8_CASES[:1] if args.quick else FP8_CASES:
        row, note = bench_fp8_case(batch, context, 16, copy_gbps)
        rows.append(row)
        notes.append(note)
        torch.cuda.empty_cache()
    report("Decode attention over an fp8 KV cache, 32 q / 8 kv heads, head_dim 128 (GB/s of bytes read)", rows,
           args.json, notes)


# --fp8 --variants: (batch, context) cases, and the fixed schedules (BLOCK_N, num_warps, num_stages[, maxnreg]) each
# variant is timed with. Triton's pipeliner keeps about (num_stages - 2) / 2 K/V tiles in flight here (the
# block-table read takes the other stages), so the deep pipelines need 10 stages and more. "swap" needs
# BLOCK_N >= 64 at 4 warps (128 at 8) for wgmma.
VARIANT_CASES = [(448, 3072), (256, 2048), (32, 2048), (1, 2048)]
# A first run over all variants (2026-12-02, H200) put swap_g_f and swap_q8x2_p_f ahead at every batch
# >= 32, with 32-token / 2-warp and 64-token / 4-warp / 8-stage tiles, and showed deeper pipelines
# losing; so the sweep now looks around those (fewer stages, 1-warp programs) with base as the reference.
VARIANT_SCHEDULES = {
    "base": [(64, 4, 6)],
    "swap_g": [(32, 2, 8), (64, 4, 8)],
    "base_g_f": [(32, 2, 8), (64, 4, 8)],
    "swap_g_f": [(16, 1, 6), (16, 1, 8), (32, 2, 6), (32, 2, 8), (32, 2, 10), (32, 2, 12), (64, 2, 8), (64, 4, 6),
                 (64, 4, 8), (128, 4, 6), (128, 4, 8)],
    "swap_q8x2_p_f": [(64, 4, 6), (64, 4, 8), (128, 4, 6)],
}
REFERENCE_SEQS = 4  # sequences checked against the float32 reference per case
AUTOTUNED = "autotuned"


@dataclass(frozen=True)
class Candidate:
    """One timed launch: an fp8 variant with a fixed schedule (or the autotuner's), and a split count
    (None: the launcher's choice); variant "bf16" is the bf16-cache kernel."""

    variant: str
    schedule: tuple[int, ...] | None = None
    num_splits: int | None = None

    @property
    def label(self) -> str:
        sched = AUTOTUNED if self.schedule is None else "/".join(map(str, self.schedule))  # BLOCK_N/warps/stages
        return f"{self.variant} {sched} s{self.num_splits or 'auto'}"


def _candidate_call(c: Candidate, q, caches, tables, seq_lens, out) -> Callable[..., torch.Tensor]:
    """call(i, compile_only=False): c's launch over block-table set i."""
    (k16, v16), (k8, v8), (ks, vs) = caches
    scale = HEAD_DIM**-0.5

    def call(i, compile_only=False):
        if c.variant == "bf16":
            return paged_decode_attention(q, k16, v16, tables[i], seq_lens, scale, out=out, num_splits=c.num_splits,
                                          compile_only=compile_only)
        return paged_decode_attention(q, k8, v8, tables[i], seq_lens, scale, out=out, num_splits=c.num_splits,
                                      k_scale=ks, v_scale=vs, fp8_variant=c.variant, schedule=c.schedule,
                                      compile_only=compile_only)
    return call


def _precompile(calls: list[Callable[..., object]]) -> None:
    """Compile every call's kernel in parallel threads (Triton's AsyncCompileMode), where available."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: each candidate compiles on its first launch
        return
    try:
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in calls:
                try:
                    call(0, compile_only=True)
                except Exception as error:  # noqa: BLE001 - reported again when the candidate runs
                    print(f"  precompile failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
    except Exception as error:  # noqa: BLE001 - the candidates then compile on their first launch
        print(f"  parallel precompile stopped: {type(error).__name__}: {str(error)[:200]}", flush=True)


def _time_candidates(cands, case, q, caches, tables, seq_lens, reference, copy_gbps) -> list[dict]:
    """Times each candidate (after a parallel precompile); returns one result dict per candidate."""
    out = torch.empty_like(q)
    calls = [_candidate_call(c, q, caches, tables, seq_lens, out) for c in cands]
    _precompile(calls)
    batch, context = case
    fp8_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    results = []
    for c, call in zip(cands, calls, strict=True):
        try:
            ms = time_ms(rotating(call, len(tables)))
            call(0)
            diff = out[:REFERENCE_SEQS].float() - reference
            error, rel = diff.abs().max().item(), (diff.norm() / reference.norm()).item()
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is reported, not fatal
            print(f"B{batch} ctx{context} | {c.label} | FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        read = 2 * fp8_bytes if c.variant == "bf16" else fp8_bytes
        gbps = read / (ms * 1e-3) / 1e9
        tuned = ""
        if c.schedule is None and c.variant != "bf16":
            best = getattr(attention_decode._decode_split_kernel, "best_config", None)
            tuned = f" (autotuner chose {best})" if best is not None else ""
        print(f"B{batch} ctx{context} {c.label}: {ms:.4f} ms {gbps:,.0f} GB/s ({gbps / copy_gbps:.3f} of copy) "
              f"err {error:.1e} rel {rel:.1e}{tuned}", flush=True)
        results.append({"case": f"B{batch} ctx{context}", "variant": c.variant, "schedule": c.schedule,
                        "num_splits": c.num_splits, "ms": ms, "gbps": gbps, "of_copy": gbps / copy_gbps,
                        "of_peak": gbps / HBM_PEAK_GBPS, "max_abs_err": error, "rel_err": rel})
    return results


def _best_per_variant(results: list[dict], count: int = 1) -> dict[str, list[dict]]:
    """The `count` fixed-schedule results of each fp8 variant with the most GB/s."""
    ranked: dict[str, list[dict]] = {}
    for r in sorted(results, key=lambda r: -r["gbps"]):
        if r["schedule"] is not None and len(ranked.setdefault(r["variant"], [])) < count:
            ranked[r["variant"]].append(r)
    return ranked


def variants_case(case, copy_gbps, earlier: list[dict]) -> list[dict]:
    """All candidates at one (batch, context): each variant's schedules with the launcher's split count
    (at batch 1 only the two best schedules per variant of the earlier cases, with 8 and 16 splits), then
    at batch 32 the three fastest again with 2 and 4 splits."""
    batch, context = case
    bf16, fp8, scales, tables = _fp8_caches(batch, context, 16)
    caches = (bf16, fp8, scales)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    rows = slice(0, REFERENCE_SEQS)
    reference = paged_decode_attention_reference(q[rows], *fp8, tables[0][rows], seq_lens[rows], HEAD_DIM**-0.5,
                                                 k_scale=scales[0], v_scale=scales[1]).float()
    cands = list(dict.fromkeys([Candidate("base"), Candidate(DEFAULT_FP8_VARIANT), Candidate("bf16")]))
    if batch >= 32 or not earlier:
        cands += [Candidate(v, s) for v, schedules in VARIANT_SCHEDULES.items() for s in schedules]
    else:
        tops = [r for best in _best_per_variant(earlier, 2).values() for r in best]
        cands += list(dict.fromkeys(Candidate(r["variant"], r["schedule"], n) for r in tops for n in (None, 16)))
    results = _time_candidates(cands, case, q, caches, tables, seq_lens, reference, copy_gbps)
    if batch == 32:
        fastest = sorted((r for r in results if r["schedule"] is not None), key=lambda r: -r["gbps"])[:3]
        again = [Candidate(r["variant"], r["schedule"], n) for r in fastest for n in (2, 4)]
        results += _time_candidates(again, case, q, caches, tables, seq_lens, reference, copy_gbps)
    del bf16, fp8, caches
    torch.cuda.empty_cache()
    return results


def variants_main(args):
    copy_gbps = hbm_copy_gbps()
    print(f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s; variants {sorted(FP8_DECODE_VARIANTS)}", flush=True)
    results: list[dict] = []
    for case in VARIANT_CASES[:1] if args.quick else VARIANT_CASES:
        try:
            results += variants_case(case, copy_gbps, results)
        except Exception as exc:  # noqa: BLE001 - keep the other cases' figures
            print(f"case {case} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"\n### Summary: per variant its two best BLOCK_N/warps/stages s<splits>: ms, GB/s of fp8 bytes read, "
          f"share of the {copy_gbps:,.0f} GB/s copy, max abs err vs the float32 reference", flush=True)
    rows = []
    for case in dict.fromkeys(r["case"] for r in results):
        mine = [r for r in results if r["case"] == case]
        for variant in dict.fromkeys(("base", DEFAULT_FP8_VARIANT, "bf16")):
            tuned = next((r for r in mine if r["variant"] == variant and r["schedule"] is None), None)
            if tuned:
                print(f"{case} {variant} autotuned: {tuned['ms']:.4f} ms {tuned['gbps']:,.0f} ({tuned['of_copy']:.3f})")
        default = next((r for r in mine if r["variant"] == "base" and r["schedule"] is None), None)
        for rank, (variant, tops) in enumerate(_best_per_variant(mine, 2).items()):
            print(f"{case} {variant}: " + " | ".join(
                "/".join(map(str, r["schedule"])) + f" s{r['num_splits'] or '-'} {r['ms']:.4f} ms {r['gbps']:,.0f} "
                f"{r['of_copy']:.3f} e{r['max_abs_err']:.1e}" for r in tops))
            if rank >= 3:
                continue  # the table keeps each case's three fastest variants
            best, peer = tops[0], default or tops[0]
            extra = {k: best[k] for k in ("schedule", "num_splits", "of_copy", "of_peak", "max_abs_err", "rel_err")}
            rows.append(Measurement(f"{case} {variant}", "GB/s", best["gbps"], peer["gbps"], "fp8 base autotuned",
                                    best["ms"], peer["ms"], extra))
    report("fp8 decode attention variants, 32 q / 8 kv heads, head_dim 128 (GB/s of fp8 bytes read)", rows,
           args.json, [f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s"])
    if args.json:
        with open(os.path.splitext(args.json)[0] + "_candidates.json", "w") as f:
            json.dump({"copy_gbps": copy_gbps, "candidates": results}, f, indent=1)


SMALL_BATCHES = (1, 2, 4, 8, 16)
SMALL_SPLITS = (1, 2, 4, 8, 16)
SAME_SCHEDULE = (64, 4, 4)  # the split kernel's tiles when the fused and two-launch outputs are compared bit for bit
MIN_TOKENS_SWEEP = (256, 128, 64, 32)  # SITS_DECODE_SPLIT_TOKENS values timed at each case (the chosen count's)
WIDE_BOUND = 131_072  # max_seq_len as CUDA graphs pass it when max_model_len is Llama-3.1's context (the table's width)


def small_batch_case(batch: int, context: int, fp8: bool) -> tuple[list[Measurement], str]:
    """One batch's split-count sweep (bf16 or fp8 cache): the fastest count against the chosen one, and
    at each count the fused merge (split_counters) beside the two launches (split kernel + merge kernel)."""
    (k16, v16), (k8, v8), (ks, vs), tables = _fp8_caches(batch, context, 16)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    cache = dict(k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs) if fp8 else dict(k_cache=k16, v_cache=v16)
    counters = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device=DEVICE)
    ropes = _decode_ropes(tables, context)

    def launch(splits: int | None, fused: bool, schedule: tuple[int, ...] | None = None,
               bound: int | None = None, rope: bool = False) -> Callable[[int], torch.Tensor]:
        def call(i):
            return paged_decode_attention(q, block_tables=tables[i], seq_lens=seq_lens, scale=HEAD_DIM**-0.5, out=out,
                                          num_splits=splits, split_counters=counters if fused else None,
                                          schedule=schedule, max_seq_len=bound, rope=ropes[i] if rope else None,
                                          **cache)
        return call

    chosen = choose_num_splits(batch, NUM_KV_HEADS, context, q.device)
    counts = sorted({chosen, *SMALL_SPLITS})
    ms, fused_ms = {}, {}
    for splits in counts:  # each count's two variants back to back, so clock drift does not favour one
        ms[splits] = time_ms(rotating(launch(splits, False), len(tables)))
        # One split has no merge: the same single launch either way.
        fused_ms[splits] = time_ms(rotating(launch(splits, True), len(tables))) if splits > 1 else ms[splits]
    # The chosen plan told WIDE_BOUND tokens (as a CUDA graph captured for that max_model_len launches it): the split
    # count follows the bound, each sequence's split length its own context (`split_tokens`).
    wide_ms = time_ms(rotating(launch(None, False, bound=WIDE_BOUND), len(tables)))
    by_min_tokens = _min_tokens_sweep(launch, len(tables), rope=not fp8)
    by_variant = {} if fp8 else _half_variants_sweep(launch, len(tables))
    # At one schedule: autotuned, the two variants may pick other tiles, hence other sums inside a split.
    identical = all(torch.equal(launch(s, False, SAME_SCHEDULE)(0).clone(), launch(s, True, SAME_SCHEDULE)(0))
                    for s in counts if s > 1)
    assert counters.count_nonzero().item() == 0, "the fused merge left counters set"
    best, best_fused = min(ms, key=ms.get), min(fused_ms, key=fused_ms.get)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
    gbps = lambda t: kv_bytes / (t * 1e-3) / 1e9  # noqa: E731
    case = f"{'fp8' if fp8 else 'bf16'} B{batch} ctx{context}"
    note = (f"{case}: chosen {chosen} splits {ms[chosen] * 1e3:.1f} us (fused {fused_ms[chosen] * 1e3:.1f}), best two-launch "
            f"{best} splits {ms[best] * 1e3:.1f} us ({ms[chosen] / ms[best]:.2f}x), best fused {best_fused} splits "
            f"{fused_ms[best_fused] * 1e3:.1f} us (two-launch best / fused best {ms[best] / fused_ms[best_fused]:.2f}x); "
            f"fused bit-identical: {identical}; told {WIDE_BOUND} tokens: {wide_ms * 1e3:.1f} us "
            f"({wide_ms / ms[chosen]:.2f}x the chosen count told {context}); " + _sweeps_text(by_min_tokens, by_variant)
            + "; splits: two-launch / fused us (ratio): "
            + ", ".join(f"{s}: {ms[s] * 1e3:.1f} / {fused_ms[s] * 1e3:.1f} ({ms[s] / fused_ms[s]:.2f}x)" for s in counts))
    print(note, flush=True)
    extra = {"chosen_splits": chosen, "best_splits": best, "us_by_splits": {s: round(t * 1e3, 2) for s, t in ms.items()},
             "best_fused_splits": best_fused, "fused_bit_identical": identical,
             "fused_us_by_splits": {s: round(t * 1e3, 2) for s, t in fused_ms.items()},
             "wide_bound": WIDE_BOUND, "wide_bound_us": round(wide_ms * 1e3, 2),
             **_sweeps_extra(by_min_tokens, by_variant)}
    rows = [Measurement(case, "GB/s", gbps(ms[best]), gbps(ms[chosen]), f"chosen ({chosen} splits)", ms[best],
                        ms[chosen], extra),
            Measurement(f"{case} fused merge", "GB/s", gbps(fused_ms[best_fused]), gbps(ms[best]),
                        f"two launches ({best} splits)", fused_ms[best_fused], ms[best], extra),
            Measurement(f"{case} told {WIDE_BOUND}", "GB/s", gbps(wide_ms), gbps(ms[chosen]),
                        f"chosen ({chosen} splits) told {context}", wide_ms, ms[chosen], extra)]
    return rows, note


def _decode_ropes(tables: list[torch.Tensor], context: int) -> list[DecodeRope]:
    """A decode step's RoPE + KV write for each block table (the new token at position context - 1 of every
    sequence, its slot through that table), as the engine fuses it into decode attention."""
    batch = tables[0].shape[0]
    k, v = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=DEVICE)
    cos_sin = build_cos_sin_cache(HEAD_DIM, context + 16, device=DEVICE)
    return [DecodeRope(k, v, positions, cos_sin, t[:, (context - 1) // 16].long() * 16 + (context - 1) % 16)
            for t in tables]


@dataclass
class RopeStep:
    """A bf16 decode step of `batch` sequences at `context` tokens, as the engine launches it (the RoPE + KV write
    fused): the caches (K, V), block tables rotated past L2 (`_fp8_caches`), q [B, 32, 128], seq_lens, an output
    buffer, and each table's `DecodeRope`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[torch.Tensor]
    q: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    ropes: list[DecodeRope]


def rope_step(batch: int, context: int) -> RopeStep:
    """A `RopeStep` with random values (the bf16 caches of `_fp8_caches`)."""
    (k16, v16), _, _, tables = _fp8_caches(batch, context, 16)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return RopeStep(k16, v16, tables, q, seq_lens, torch.empty_like(q), _decode_ropes(tables, context))


@contextlib.contextmanager
def _environment(name: str, value: str):
    """The environment variable `name` set to `value` inside the block, and as it was after it."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _min_tokens_sweep(launch, tables: int, rope: bool) -> dict[int, tuple[float, float, float | None]]:
    """The chosen split count under each SITS_DECODE_SPLIT_TOKENS of MIN_TOKENS_SWEEP (the least tokens a split
    keeps, and under 128 the granule too): {N: (two-launch ms, fused-merge ms, two-launch with the RoPE + KV write
    fused in ms or None)}; the variable is restored."""
    timed = {}
    for tokens in MIN_TOKENS_SWEEP:
        with _environment(decode_splits.SPLIT_TOKENS_ENV, str(tokens)):
            timed[tokens] = (time_ms(rotating(launch(None, False), tables)), time_ms(rotating(launch(None, True), tables)),
                             time_ms(rotating(launch(None, False, rope=True), tables)) if rope else None)
    return timed


# The bf16 cache's inner loops timed at each --small-batch case (attention_decode.HALF_DECODE_VARIANTS; "base" is the
# default): the masks only on a split's last partial tile (_f), the GQA group's rows instead of 16 (_g), the tokens as
# the dots' M side (swap: wgmma from 64-token tiles at 4 warps).
HALF_VARIANT_SWEEP = ("base", "base_f", "base_g_f", "swap_g_f", "k_t")


def _half_variants_sweep(launch, tables: int) -> dict[str, float]:
    """The chosen split count, RoPE fused (as the engine runs it), under each SITS_DECODE_VARIANT of
    HALF_VARIANT_SWEEP: {name: ms}; the variable is restored."""
    timed = {}
    for name in HALF_VARIANT_SWEEP:
        with _environment(decode_schedules.HALF_VARIANT_ENV, name):
            timed[name] = time_ms(rotating(launch(None, False, rope=True), tables))
    return timed


def _sweeps_text(by_min_tokens: dict, by_variant: dict) -> str:
    """The two sweeps of a --small-batch case for its note (times in µs)."""
    text = ("splits keeping at least N tokens, two-launch / fused merge / RoPE fused (as the engine runs it) us: "
            + ", ".join(f"{n}: " + " / ".join("-" if t is None else f"{t * 1e3:.1f}" for t in times)
                        for n, times in by_min_tokens.items()))
    if by_variant:
        text += "; bf16 inner loops at the chosen count, RoPE fused, us: " + ", ".join(
            f"{name}: {t * 1e3:.1f}" for name, t in by_variant.items())
    return text


def _sweeps_extra(by_min_tokens: dict, by_variant: dict) -> dict:
    """The two sweeps of a --small-batch case for its rows' extra fields (µs)."""
    return {"min_tokens_us": {n: [None if t is None else round(t * 1e3, 2) for t in times]
                              for n, times in by_min_tokens.items()},
            "half_variant_us": {name: round(t * 1e3, 2) for name, t in by_variant.items()}}


def small_batch_main(args, batches: tuple[int, ...] = SMALL_BATCHES, contexts: tuple[int, ...] = (2048,),
                     caches: tuple[bool, ...] = (False, True)):
    rows, notes = [], []
    for fp8 in caches:
        for batch in batches[:1] if args.quick else batches:
            for context in contexts:
                case_rows, note = small_batch_case(batch, context, fp8)
                rows += case_rows
                notes.append(note)
    report("Decode attention at small batches: best split count against the chosen one; the fused merge's best "
           "against the two launches' best", rows, args.json, notes)


def rope_case(batch: int, context: int, fp8: bool) -> tuple[Measurement, str]:
    """One decode layer's RoPE + KV write + attention: fused (one launch) against the two launches."""
    (k16, v16), (k8, v8), (ks, vs), tables = _fp8_caches(batch, context, 16)
    caches = dict(k_cache=k8, v_cache=v8) if fp8 else dict(k_cache=k16, v_cache=v16)
    scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
    qkv = torch.randn(batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    q, k, v = (t.view(batch, -1, HEAD_DIM) for t in qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                                                                  NUM_KV_HEADS * HEAD_DIM], dim=-1))
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    positions = (seq_lens - 1).long()
    table = build_cos_sin_cache(HEAD_DIM, context + 16, device=DEVICE)
    out = torch.empty_like(q)

    def slots(i):  # the new token's slot through block table i
        return tables[i][:, (context - 1) // 16].long() * 16 + (context - 1) % 16

    slot_sets = [slots(i) for i in range(len(tables))]

    def two(i):
        rope_and_cache_write(q, k, v, positions, table, **caches, slot_mapping=slot_sets[i], **scales)
        return paged_decode_attention(q, block_tables=tables[i], seq_lens=seq_lens, scale=HEAD_DIM**-0.5, out=out,
                                      **caches, **scales)

    def fused(i):
        rope = DecodeRope(k, v, positions, table, slot_sets[i])
        return paged_decode_attention(q, block_tables=tables[i], seq_lens=seq_lens, scale=HEAD_DIM**-0.5, out=out,
                                      rope=rope, **caches, **scales)

    fused_ms = time_ms(rotating(fused, len(tables)))
    two_ms = time_ms(rotating(two, len(tables)))  # rotates q and k in place: timed after the fused path
    qkv.normal_()  # one step of each from the same inputs and caches, compared
    saved = qkv.clone(), caches["k_cache"].clone(), caches["v_cache"].clone()
    expected = two(0).clone(), caches["k_cache"].clone(), caches["v_cache"].clone()
    qkv.copy_(saved[0]), caches["k_cache"].copy_(saved[1]), caches["v_cache"].copy_(saved[2])
    got = fused(0).clone(), caches["k_cache"], caches["v_cache"]
    identical = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, expected, strict=True))
    case = f"{'fp8' if fp8 else 'bf16'} B{batch} ctx{context}"
    note = (f"{case}: fused RoPE + KV write {fused_ms * 1e3:.1f} us, two launches {two_ms * 1e3:.1f} us "
            f"({two_ms / fused_ms:.2f}x); bit-identical: {identical}")
    print(note, flush=True)
    return Measurement(f"{case} fused RoPE", "us", fused_ms * 1e3, two_ms * 1e3, "rope_and_cache_write + kernel",
                       fused_ms, two_ms, {"bit_identical": identical}), note


def _int_list_flag(prefix: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """The integers of the last `--name=1,2,3` argument (removed from sys.argv), else `default`."""
    given = [a for a in sys.argv if a.startswith(prefix)]
    for a in given:
        sys.argv.remove(a)
    return tuple(int(v) for v in given[-1].split("=", 1)[1].split(",")) if given else default


def main():
    fp8, variants, small = "--fp8" in sys.argv, "--variants" in sys.argv, "--small-batch" in sys.argv
    rope = "--rope" in sys.argv
    small_batches, contexts = _int_list_flag("--batches=", SMALL_BATCHES), _int_list_flag("--contexts=", (2048,))
    caches = (False,) if "--bf16" in sys.argv else (False, True)
    for flag in ("--fp8", "--variants", "--small-batch", "--rope", "--bf16"):
        if flag in sys.argv:
            sys.argv.remove(flag)  # the shared parser knows only --json and --quick
    args = parse_args(__doc__)
    if rope:
        measured = [rope_case(batch, 2048, on_fp8) for on_fp8 in (False, True)
                    for batch in ((1,) if args.quick else (1, 32, 256))]
        report("Decode RoPE + KV write fused into decode attention against the two launches (microseconds per "
               "layer: a ratio below 1 means the fused launch is faster)", [m for m, _ in measured], args.json,
               [n for _, n in measured])
        return
    if small:
        small_batch_main(args, small_batches, contexts, caches)
        return
    if fp8 and variants:
        variants_main(args)
        return
    if fp8:
        fp8_main(args)
        return
    sweep = (1, 2, 4, 8, 16)
    cases = [(32, 2048, 16), (32, 2048, 64), (32, 8192, 16), (128, 2048, 16), (8, 4096, 16), (1, 16384, 16)]
    if args.quick:
        cases = cases[:1]
    rows, notes = [], []
    for batch, context, block in cases:
        r, n = bench_case(batch, context, block, sweep)
        rows += r
        notes += n
        torch.cuda.empty_cache()
    report("Decode attention, bf16, 32 q / 8 kv heads, head_dim 128", rows, args.json, notes)


if __name__ == "__main__":
    main()
