"""The torch attention back end's bf16 rounding on a CPU, against float32 and against the previous rounding.

    PYTHONSAFEPATH=1 python benchmarks/bench_torch_bf16_cpu.py [--engine]

1. SmolLM2-135M-Instruct (the embedded GGUF), the 8 chat prompts of tests/gpu/test_real_model_parity.py with
   the float32 CPU engine's 48 greedy answers: bf16 teacher-forced over prompt + answer in one prefill each,
   as the back end computes now (attention probabilities rounded to bf16 for P·V, as the Triton kernels do)
   and with attention kept in float32 (the previous back end): argmax agreement (EOS masked), mean KL from
   float32 and |Δ logprob| of the answer tokens; and how many answer positions are float32 near-ties.
2. The random bf16 model with Llama-3-8B's head geometry of tests/runtime/test_gpu_engine.py, 4 prompts +
   512 random tokens, one prefill each: greedy agreement of the two roundings. On an H200 the Triton back end
   agreed with the previous torch back end on 98.29 % of such positions.
3. With --engine, the bf16 engine with the torch back end generates the 48 tokens of every prompt (batched)
   and is compared with the float32 engine's answers (identical answers, common prefixes). Minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(next(i for i, p in enumerate(sys.path) if "site-packages" in p), str(Path(__file__).parents[1]))

from sits.runtime.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from sits.runtime.config import ModelConfig  # noqa: E402
from sits.runtime.models.config import LlamaConfig  # noqa: E402
from sits.runtime.models.loading import load_model  # noqa: E402
from sits.runtime.models.random_model import random_loaded_model  # noqa: E402
from tests.gpu import test_real_model_parity as parity  # noqa: E402
from tests.runtime import test_gpu_engine as random_geometry  # noqa: E402
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata  # noqa: E402

NEAR_TIE = 0.1


class Float32AttentionBackend(TorchAttentionBackend):
    """The previous back end's arithmetic: attention on float32 copies whatever the model dtype (P never rounded)."""

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        out = super().forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), metadata, scale)
        return out.to(q.dtype)


@torch.inference_mode()
def prefill_logprobs(model, sequences: list[list[int]], first: list[int]) -> torch.Tensor:
    """log-softmax rows predicting tokens first[i].. of each sequence (one prefill each), concatenated [N, vocab]."""
    rows = []
    for ids, start in zip(sequences, first, strict=True):
        cache = PagedKVCache(model, num_blocks=-(-len(ids) // 16) + 1, block_size=16)
        positions, metadata, _ = build_metadata(cache, [(PagedSequence(ids), len(ids))], torch.device("cpu"))
        hidden = model(torch.tensor(ids), positions, cache.caches, metadata)
        rows.append(torch.log_softmax(model.compute_logits(hidden[start - 1:-1]).float(), dim=-1))
    return torch.cat(rows)


def real_model(answers_only: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Part 1; returns the prompts and the float32 engine's answers (for part 3)."""
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    answers = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    reference_engine.shutdown()
    if answers_only:
        return prompts, answers
    sequences, first = [p + a for p, a in zip(prompts, answers, strict=True)], [len(p) for p in prompts]
    tokens = torch.tensor([t for a in answers for t in a])
    float32 = prefill_logprobs(load_model(ModelConfig(model=None, device="cpu", dtype="float32"),
                                          TorchAttentionBackend(), progress=False).model, sequences, first)
    masked = float32.clone()
    masked[:, parity.EOS_IDS] = float("-inf")
    top2 = masked.topk(2, dim=-1).values
    print(f"SmolLM2 float32: {int((top2[:, 0] - top2[:, 1] < NEAR_TIE).sum())} of {len(tokens)} answer positions are "
          f"near-ties (top-2 logits under {NEAR_TIE} apart)")
    for name, backend in (("probabilities rounded to bf16 (now, as the kernels)", TorchAttentionBackend()),
                          ("attention kept in float32 (before)", Float32AttentionBackend())):
        model = load_model(ModelConfig(model=None, device="cpu", dtype="bfloat16"), backend, progress=False).model
        ours = prefill_logprobs(model, sequences, first)
        ours_masked = ours.clone()
        ours_masked[:, parity.EOS_IDS] = float("-inf")
        agree = int((ours_masked.argmax(-1) == tokens).sum())
        kl = (float32.exp() * (float32 - ours)).sum(-1)
        delta = (float32 - ours).gather(1, tokens[:, None]).abs()
        print(f"SmolLM2 bf16 torch back end, {name}: teacher-forced {agree}/{len(tokens)} ({agree / len(tokens):.2%}), "
              f"KL from float32 mean {kl.mean():.2e}, answer |dlogprob| mean {delta.mean():.4f} max {delta.max():.4f}")
    return prompts, answers


def random_model() -> None:
    """Part 2."""
    generator = torch.Generator().manual_seed(7)
    prompts = random_geometry.prompts()
    sequences = [p + torch.randint(3, random_geometry.SHAPE["vocab_size"], (512,), generator=generator).tolist()
                 for p in prompts]
    first = [len(p) for p in prompts]
    results = []
    for backend in (TorchAttentionBackend(), Float32AttentionBackend()):
        loaded = random_loaded_model(LlamaConfig(**random_geometry.SHAPE), backend, "cpu", torch.bfloat16, seed=11)
        with torch.no_grad():
            loaded.model.lm_head.weight.mul_(8.0)  # as the GPU test sharpens it
        results.append(prefill_logprobs(loaded.model, sequences, first))
    now, before = results
    picks = now.argmax(-1)
    same = picks == before.argmax(-1)
    delta = (now.gather(1, picks[:, None]) - before.gather(1, picks[:, None])).abs()[same]
    print(f"random bf16 model, head_dim 128, 4 query heads per KV head, 4 x 512 positions: the two roundings pick "
          f"the same token at {same.float().mean():.2%}; chosen-token |dlogprob| max {delta.max():.4f}")


def engine_identity(prompts: list[list[int]], answers: list[list[int]]) -> None:
    """Part 3."""
    bf16 = parity.engine("cpu", "bfloat16", "torch", "none", True)
    outputs = [tokens for tokens, _ in parity.generate(bf16, prompts, one_at_a_time=False)]
    bf16.shutdown()
    prefixes = [parity.common_prefix(o, a) for o, a in zip(outputs, answers, strict=True)]
    identical = sum(o == a for o, a in zip(outputs, answers, strict=True))
    print(f"bf16 engine, torch back end, batched: {identical}/{len(answers)} answers identical to the float32 "
          f"engine's over {parity.NEW_TOKENS} tokens, common prefixes {prefixes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="store_true", help="also generate with the bf16 engine (slow)")
    parser.add_argument("--engine-only", action="store_true", help="only the engine comparison")
    args = parser.parse_args()
    start = time.perf_counter()
    prompts, answers = real_model(answers_only=args.engine_only)
    if not args.engine_only:
        random_model()
    if args.engine or args.engine_only:
        engine_identity(prompts, answers)
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
