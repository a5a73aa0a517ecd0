"""What a long bound costs small-batch decode attention: told max_model_len tokens instead of the context's.

    python benchmarks/bench_attention_decode_bound.py [--batches=1,4] [--bound=131072] [--json out.json]
    (benchmarks/gpu_profile_run.sh's step `attn-bound`)

A CUDA graph's decode attention is told the block table's width (max_model_len) as its bound, whatever the
contexts it runs: the bound sets the split count (`plan_decode_splits`), each sequence its own split length, so a
2,048-token context under a 131,072-token bound fills 8 of 64 launched splits at batch 1. On the H200
(2026-12-05) a batch-1 decode step took 4.42 ms that way against 4.28-4.33 sized for the run, the split kernel
11.5 µs a call against 8.8. This bench tells the candidate causes apart, at Llama-3-8B's attention (32 query / 8 KV
heads, head_dim 128), a 2,048-token context in 16-token pages, bf16 cache, the RoPE + KV write fused (as the engine
launches it), K / V cold (rotated block tables), CUDA graphs; µs per layer (split kernel + merge):

  * "tight": bound = the context, autotuned (the peer of every other row);
  * "bound": bound = --bound, autotuned (its split bucket is another autotune key: it may pick other tiles);
  * "bound, tight's tiles": the same launch at the schedule "tight" picked (what the empty splits and the wider
    merge cost alone);
  * "bound, fused merge": that, merged inside the split kernel (no merge launch; the empty splits never count);
  * "graph bound": bound = the smallest of the decode graphs' context bounds (`graph_context_bounds`) that holds
    the context, autotuned: what a step replays with SITS_DECODE_GRAPH_BOUNDS=1.
"""

from __future__ import annotations

import sys

import torch
from bench_attention_decode import NUM_KV_HEADS, _int_list_flag, rope_step
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels import attention_decode
from sits.kernels.attention_decode import paged_decode_attention, plan_decode_splits
from sits.kernels.decode_splits import graph_context_bounds
from sits.kernels.launch_utils import num_sms

CONTEXT = 2048


def _followed(split_bucket: int) -> tuple[int, ...]:
    """The schedule the fused-RoPE launches of this split bucket follow (`attention_decode._FOLLOWED_SCHEDULES`)."""
    found = [s for key, s in attention_decode._FOLLOWED_SCHEDULES.items() if key[3] == split_bucket]
    assert found, f"no autotuned schedule for split bucket {split_bucket}"
    return found[-1]


def bound_case(batch: int, bound: int) -> list[Measurement]:
    """The four launches of the module docstring at one batch."""
    step = rope_step(batch, CONTEXT)
    counters = torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device=step.q.device)

    def launch(max_seq_len: int, schedule=None, fused: bool = False):
        def call(i):
            return paged_decode_attention(
                step.q,
                step.k_cache,
                step.v_cache,
                step.tables[i],
                step.seq_lens,
                step.q.shape[-1] ** -0.5,
                out=step.out,
                max_seq_len=max_seq_len,
                schedule=schedule,
                rope=step.ropes[i],
                split_counters=counters if fused else None,
            )

        return rotating(call, len(step.tables))

    sms = num_sms(step.q.device)
    tight_plan, wide_plan = (plan_decode_splits(batch, NUM_KV_HEADS, n, sms) for n in (CONTEXT, bound))
    tight_us = time_ms(launch(CONTEXT)) * 1e3
    tight_tiles = _followed(tight_plan.split_bucket)
    wide_us = time_ms(launch(bound)) * 1e3
    wide_tiles = _followed(wide_plan.split_bucket)
    pinned_us = time_ms(launch(bound, tight_tiles)) * 1e3
    fused_us = time_ms(launch(bound, tight_tiles, fused=True)) * 1e3
    graph_bound = min(b for b in graph_context_bounds(batch, NUM_KV_HEADS, bound, sms) if b >= CONTEXT)
    graph_plan = plan_decode_splits(batch, NUM_KV_HEADS, graph_bound, sms)
    graph_us = time_ms(launch(graph_bound)) * 1e3
    graph_tiles = _followed(graph_plan.split_bucket)
    print(
        f"B{batch}: tight {tight_plan.num_splits} splits, tiles {tight_tiles}: {tight_us:.2f} µs; bound {bound}: "
        f"{wide_plan.num_splits} splits (merge block {wide_plan.merge_block}), tiles {wide_tiles}: {wide_us:.2f} µs; "
        f"at tight's tiles {pinned_us:.2f}; fused merge {fused_us:.2f}; graph bound {graph_bound}: "
        f"{graph_plan.num_splits} splits, tiles {graph_tiles}: {graph_us:.2f} µs",
        flush=True,
    )
    cases = (("bound", wide_us, wide_tiles, wide_plan), ("bound, tight's tiles", pinned_us, tight_tiles, wide_plan),
             ("bound, fused merge", fused_us, tight_tiles, wide_plan),
             (f"graph bound {graph_bound}", graph_us, graph_tiles, graph_plan))
    return [Measurement(f"B{batch} {name}", "µs", us, tight_us, f"tight ({tight_plan.num_splits} splits)", us * 1e-3,
                        tight_us * 1e-3, {"schedule": tiles, "splits": plan.num_splits})
            for name, us, tiles, plan in cases]


def main() -> None:
    batches = _int_list_flag("--batches=", (1, 4))
    (bound,) = _int_list_flag("--bound=", (131_072,))
    args = parse_args(__doc__.split("\n")[0])
    rows = []
    for batch in batches:
        rows += bound_case(batch, bound)
    report(
        f"decode attention told {bound:,} tokens against the context's 2,048 (µs per layer: split kernel + merge)",
        rows,
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
