"""How much of small-batch decode attention's time waits on HBM: K / V cold against K / V already in L2.

    python benchmarks/bench_attention_decode_l2.py [--batches=1,4] [--json out.json]
    (benchmarks/gpu_profile_run.sh's step `attn-l2`)

Llama-3-8B's attention (32 query / 8 KV heads, head_dim 128), a 2,048-token context in 16-token pages, bf16 cache,
the decode RoPE + KV write fused in (as the engine launches it), the split plan the kernel picks, CUDA graphs.
"cold": every call reads another block table's pages (the tables together hold more than L2), as a decode step
reads a layer's K / V once. "hot": every call reads the same pages, which the call before left in L2 (at batch 1
they are 8 MiB, L2 holds 50). The autotuned schedule first, then each shipped bf16 schedule (BLOCK_N / warps /
stages) pinned. The peer of "hot" is "cold" in the same run: cold / hot is the most that moving the K / V bytes
into L2 before the kernel needs them (a prefetch) could take off a launch; a ratio near 1 says the time goes
elsewhere (launch, the chain of dependent loads before the first K tile, the merge).
"""

from __future__ import annotations

import sys

from bench_attention_decode import NUM_KV_HEADS, _int_list_flag, rope_step
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels import decode_schedules
from sits.kernels.attention_decode import choose_num_splits, paged_decode_attention

CONTEXT = 2048


def _schedules() -> list[tuple[int, ...] | None]:
    """None (autotuned), then every shipped bf16 schedule."""
    return [None, *sorted(decode_schedules.BF16_SCHEDULES)]


def l2_case(batch: int) -> list[Measurement]:
    """Cold against hot at one batch, for each schedule."""
    step = rope_step(batch, CONTEXT)
    tables = step.tables

    def launch(schedule):
        def call(i):
            return paged_decode_attention(
                step.q,
                step.k_cache,
                step.v_cache,
                tables[i],
                step.seq_lens,
                step.q.shape[-1] ** -0.5,
                out=step.out,
                schedule=schedule,
                rope=step.ropes[i],
            )

        return call

    splits = choose_num_splits(batch, NUM_KV_HEADS, CONTEXT, step.q.device)
    rows = []
    for schedule in _schedules():
        call = launch(schedule)
        cold = time_ms(rotating(call, len(tables)))
        hot = time_ms(lambda call=call: call(0))
        name = "autotuned" if schedule is None else "/".join(map(str, schedule))
        print(
            f"B{batch} {splits} splits {name}: cold {cold * 1e3:.2f} µs, hot {hot * 1e3:.2f} µs, "
            f"cold / hot {cold / hot:.2f}",
            flush=True,
        )
        rows.append(
            Measurement(
                f"B{batch} s{splits} {name} hot", "µs", hot * 1e3, cold * 1e3, "cold (rotated)", hot, cold
            )
        )
    return rows


def main() -> None:
    batches = _int_list_flag("--batches=", (1, 4))
    args = parse_args(__doc__.split("\n")[0])
    rows = []
    for batch in batches:
        rows += l2_case(batch)
    report(
        "decode attention, K / V hot in L2 against cold (µs per layer: split kernel + merge)", rows, args.json
    )


if __name__ == "__main__":
    sys.exit(main())
