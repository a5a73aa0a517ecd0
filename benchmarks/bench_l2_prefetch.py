"""Does prefetching a projection's weight into L2 during the small kernels before it shorten a batch-1 step?

    python benchmarks/bench_l2_prefetch.py [--quick] [--json out.json]

Llama-3-8B shapes, bf16, batch 1, one NVIDIA GPU of sm_90. Each case is a short chain of a decode layer's
kernels, timed in CUDA graphs (kernel_bench_utils.time_ms), rotating over weight and KV copies of >= 256 MB
together so nothing is read from L2 that the chain itself did not bring there:

  * o: decode attention (context 2,048, 8 splits, merge) then o_proj (4,096 x 4,096, the small-M direct GEMM);
    with sits.kernels.l2_prefetch of the whole o weight (32 MiB) queued before the attention, on the same stream,
    or on a stream beside it (forked before the attention, joined before o_proj or after it);
  * qkv: the decoder's add + RMSNorm then qkv_proj (6,144 x 4,096); prefetches of 8 / 16 MiB of the weight
    queued before the norm;
  * gate_up: add + RMSNorm then gate_up + SiLU·mul (28,672 x 4,096); prefetches of 8 / 16 MiB before the norm;
  * gate_up beside: decode attention, o_proj, then gate_up + SiLU·mul, with sits.kernels.l2_prefetch_rows of
    the first 512 or 1,024 bytes of each of gate_up's 28,672 weight rows (14 / 28 MiB) on a stream beside,
    forked before the attention (or after it) and joined before gate_up; and 1,024 / 2,048 bytes with the lines
    marked evict-last (so o_proj's stream passes them by). The GEMM streams every row from its
    first column, so the prefetched bytes come off every program's HBM read. Also the row prefetch alone
    and followed by gate_up on one stream (the prefetch's grid retires once its lines landed), against
    gate_up alone: what a landed prefix saves the GEMM. `--quick` runs this case alone.

The peer of each variant is the same chain without the prefetch, in the same run; the ratio is the variant's
time over the peer's (< 1: the prefetch pays, its own launch included). Also printed: each GEMM alone with a cold
weight and with a hot one (the same weight every call: read from L2 where it fits), which bound what a
prefetch can win.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels.attention_decode import paged_decode_attention
from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_silu_mul
from sits.kernels.l2_prefetch import l2_prefetch, l2_prefetch_rows
from sits.kernels.rmsnorm import rms_norm

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
CONTEXT, BLOCK = 2048, 16
ROTATED_BYTES = 256 << 20
MIB = 1 << 20


def _copies(rows: int, cols: int) -> list[torch.Tensor]:
    count = max(2, -(-ROTATED_BYTES // (rows * cols * 2)))
    return [torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(count)]


def _attention_inputs(copies: int):
    """q [1, 32, 128], and `copies` (k_cache, v_cache, block_table) sets of one 2,048-token sequence."""
    blocks = CONTEXT // BLOCK
    sets = []
    for _ in range(copies):
        k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        table = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
        sets.append((k, torch.randn_like(k), table))
    q = torch.randn(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return q, sets


def _row(case: str, variant_ms: float, peer_ms: float, peer: str, extra: dict) -> Measurement:
    return Measurement(case, "us", variant_ms * 1e3, peer_ms * 1e3, peer, variant_ms, peer_ms, extra)


def o_case() -> tuple[list[Measurement], str]:
    weights = _copies(HIDDEN, HIDDEN)
    q, sets = _attention_inputs(len(weights))
    seq_lens = torch.full((1,), CONTEXT, dtype=torch.int32, device="cuda")
    attn_out = torch.empty_like(q)
    out = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")

    side = torch.cuda.Stream()

    def chain(prefetch: str):
        def call(i):
            stream = torch.cuda.current_stream()
            if prefetch == "stream":
                l2_prefetch(weights[i])
            elif prefetch:  # "join-before" / "join-after": on a stream of its own, forked here
                side.wait_stream(stream)
                with torch.cuda.stream(side):
                    l2_prefetch(weights[i])
            k, v, table = sets[i]
            paged_decode_attention(q, k, v, table, seq_lens, HEAD_DIM**-0.5, out=attn_out)
            if prefetch == "join-before":
                stream.wait_stream(side)
            result = small_m_gemm(attn_out.view(1, HIDDEN), weights[i], out=out)
            if prefetch == "join-after":
                stream.wait_stream(side)
            return result
        return rotating(call, len(weights))

    base, fetched = time_ms(chain("")), time_ms(chain("stream"))
    beside = {name: time_ms(chain(name)) for name in ("join-before", "join-after")}
    attention = time_ms(rotating(lambda i: paged_decode_attention(q, sets[i][0], sets[i][1], sets[i][2], seq_lens,
                                                                  HEAD_DIM**-0.5, out=attn_out), len(weights)))
    x = attn_out.view(1, HIDDEN)
    cold = time_ms(rotating(lambda i: small_m_gemm(x, weights[i], out=out), len(weights)))
    hot = time_ms(lambda: small_m_gemm(x, weights[0], out=out))
    note = (f"o: attention alone {attention * 1e3:.1f} us; o_proj cold {cold * 1e3:.1f} us, hot {hot * 1e3:.1f} us; "
            f"attention + o_proj {base * 1e3:.1f} us, with the 32 MiB prefetch {fetched * 1e3:.1f} us; on a stream "
            f"beside, joined before o_proj {beside['join-before'] * 1e3:.1f} us, after it "
            f"{beside['join-after'] * 1e3:.1f} us")
    extra = {"attention_us": attention * 1e3, "gemm_cold_us": cold * 1e3, "gemm_hot_us": hot * 1e3}
    rows = [_row("attention + o_proj, prefetch 32 MiB", fetched, base, "no prefetch", extra)]
    rows += [_row(f"attention + o_proj, prefetch 32 MiB beside, {name}", ms, base, "no prefetch", extra)
             for name, ms in beside.items()]
    return rows, note


def norm_gemm_case(name: str, rows: int, silu: bool) -> tuple[list[Measurement], str]:
    weights = _copies(rows, HIDDEN)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    stream = torch.randn(1, HIDDEN, dtype=torch.float32, device="cuda")
    norm_weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    normed = torch.empty_like(x)
    out = torch.empty(1, rows // 2 if silu else rows, dtype=torch.bfloat16, device="cuda")
    gemm = small_m_gemm_silu_mul if silu else small_m_gemm

    def chain(prefetch_mib: int):
        def call(i):
            if prefetch_mib:
                l2_prefetch(weights[i], min(prefetch_mib * MIB, weights[i].numel() * 2))
            rms_norm(x, norm_weight, 1e-5, residual=stream, out=normed, residual_out=stream)
            return gemm(normed, weights[i], out=out)
        return rotating(call, len(weights))

    base = time_ms(chain(0))
    cold = time_ms(rotating(lambda i: gemm(normed, weights[i], out=out), len(weights)))
    hot = time_ms(lambda: gemm(normed, weights[0], out=out))
    rows_out, parts = [], []
    for mib in (8, 16):
        fetched = time_ms(chain(mib))
        parts.append(f"prefetch {mib} MiB {fetched * 1e3:.1f} us")
        rows_out.append(_row(f"norm + {name}, prefetch {mib} MiB", fetched, base, "no prefetch",
                             {"gemm_cold_us": cold * 1e3, "gemm_hot_us": hot * 1e3}))
    note = (f"{name}: GEMM cold {cold * 1e3:.1f} us, hot {hot * 1e3:.1f} us; norm + GEMM {base * 1e3:.1f} us, "
            + ", ".join(parts))
    return rows_out, note


def gate_up_beside_case() -> tuple[list[Measurement], str]:
    gate_up = _copies(2 * INTERMEDIATE, HIDDEN)
    o_weights = _copies(HIDDEN, HIDDEN)
    q, sets = _attention_inputs(len(o_weights))
    seq_lens = torch.full((1,), CONTEXT, dtype=torch.int32, device="cuda")
    attn_out = torch.empty_like(q)
    o_out = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    mlp_out = torch.empty(1, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def chain(row_bytes: int, fork: str = "before", evict_last: bool = False):
        def call(i):
            stream, w = torch.cuda.current_stream(), gate_up[i % len(gate_up)]

            def fork_prefetch():
                side.wait_stream(stream)
                with torch.cuda.stream(side):
                    l2_prefetch_rows(w, row_bytes, evict_last)
            if row_bytes and fork == "before":
                fork_prefetch()
            k, v, table = sets[i]
            paged_decode_attention(q, k, v, table, seq_lens, HEAD_DIM**-0.5, out=attn_out)
            if row_bytes and fork == "after":
                fork_prefetch()
            small_m_gemm(attn_out.view(1, HIDDEN), o_weights[i], out=o_out)
            if row_bytes:
                stream.wait_stream(side)
            return small_m_gemm_silu_mul(o_out, w, out=mlp_out)
        return rotating(call, len(o_weights))

    base = time_ms(chain(0))
    rows, parts = [], [f"attention + o_proj + gate_up {base * 1e3:.1f} us"]
    for row_bytes, fork, last in ((512, "before", False), (1024, "before", False), (1024, "after", False),
                                  (1024, "before", True), (2048, "before", True)):
        ms = time_ms(chain(row_bytes, fork, last))
        mib = 2 * INTERMEDIATE * row_bytes / MIB
        how = f"{row_bytes} B a row beside{', evict-last' if last else ''}, forked {fork} the attention"
        parts.append(f"{how} ({mib:.0f} MiB) {ms * 1e3:.1f} us")
        rows.append(_row(f"attention + o_proj + gate_up, {how}", ms, base, "no prefetch", {"prefetch_mib": mib}))
    alone = time_ms(rotating(lambda i: small_m_gemm_silu_mul(o_out, gate_up[i % len(gate_up)], out=mlp_out),
                             len(gate_up)))
    for row_bytes in (512, 1024, 2048):
        def prefetch(i, n=row_bytes):
            l2_prefetch_rows(gate_up[i % len(gate_up)], n)

        def prefetch_then_gate_up(i, n=row_bytes):
            l2_prefetch_rows(gate_up[i % len(gate_up)], n)
            return small_m_gemm_silu_mul(o_out, gate_up[i % len(gate_up)], out=mlp_out)
        fetch = time_ms(rotating(prefetch, len(gate_up)))
        both = time_ms(rotating(prefetch_then_gate_up, len(gate_up)))
        parts.append(f"{row_bytes} B a row: prefetch alone {fetch * 1e3:.1f} us, then gate_up {both * 1e3:.1f} us "
                     f"(gate_up after it: {(both - fetch) * 1e3:.1f} us)")
        rows.append(_row(f"gate_up after its landed {row_bytes} B row prefixes (prefetch time taken off)",
                         both - fetch, alone, "gate_up cold", {"prefetch_us": fetch * 1e3, "chain_us": both * 1e3}))
    return rows, "gate_up beside: " + "; ".join(parts) + f"; gate_up alone, cold {alone * 1e3:.1f} us"


def main() -> None:
    args = parse_args(__doc__)
    rows, notes = [], []
    cases = (o_case, lambda: norm_gemm_case("qkv_proj", HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, False),
             lambda: norm_gemm_case("gate_up + SiLU·mul", 2 * INTERMEDIATE, True), gate_up_beside_case)
    for case in cases[-1:] if args.quick else cases:  # --quick: the gate_up-beside case alone
        case_rows, note = case()
        print(note, flush=True)
        rows += case_rows
        notes.append(note)
    report("L2 prefetch of a projection's weight during the kernels before it (batch 1, Llama-3-8B shapes)",
           rows, args.json, notes)


if __name__ == "__main__":
    main()
