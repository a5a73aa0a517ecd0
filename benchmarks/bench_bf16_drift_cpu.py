"""How far bf16 drifts from float32 on real weights, for scale: transformers in bf16 and the float32 engine with
bf16-rounded weights, each against the float32 SITS engine (CPU, SmolLM2-135M-Instruct, the GPU parity prompts).

    PYTHONSAFEPATH=1 python benchmarks/bench_bf16_drift_cpu.py

Greedy is the argmax of each system's own logits with EOS masked for 48 tokens, as in
tests/gpu/test_real_model_parity.py (transformers' `generate` is not used: its processors may pick another token).
Prints, per system, how many of the 8 answers equal the float32 engine's and each answer's common prefix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(next(i for i, p in enumerate(sys.path) if "site-packages" in p), str(Path(__file__).parents[1]))

from tests.gpu import test_real_model_parity as parity  # noqa: E402


def transformers_greedy(dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = parity.gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, cache, out = torch.tensor([prompt]), None, []
            for _ in range(parity.NEW_TOKENS):
                step = model(ids, past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                logits = step.logits[0, -1].float()
                logits[parity.EOS_IDS] = float("-inf")
                out.append(int(logits.argmax()))
                ids = torch.tensor([[out[-1]]])
            answers.append(out)
    return answers


def main() -> int:
    reference_engine = parity.engine("cpu", "float32", "torch", "none", True)
    prompts = parity.prompts(reference_engine.tokenizer)
    reference = [tokens for tokens, _ in parity.generate(reference_engine, prompts, one_at_a_time=False)]
    rounded = parity.engine("cpu", "float32", "torch", "none", True)
    with torch.no_grad():
        for param in rounded.loaded_model.model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    systems = {
        "float32 engine, weights rounded to bf16": [t for t, _ in parity.generate(rounded, prompts, False)],
        "transformers bf16": transformers_greedy(torch.bfloat16, prompts),
        "transformers float32": transformers_greedy(torch.float32, prompts),
    }
    for name, answers in systems.items():
        prefixes = [parity.common_prefix(a, r) for a, r in zip(answers, reference, strict=True)]
        same = sum(a == r for a, r in zip(answers, reference, strict=True))
        print(f"{name}: {same}/{len(reference)} identical to the float32 engine over {parity.NEW_TOKENS} tokens, "
              f"common prefixes {prefixes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
