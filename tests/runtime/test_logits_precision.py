"""Logits are computed in float32 whatever the model dtype: half-precision logits tie and flip greedy picks.

On an H200 the bf16 torch back end answered SmolLM2's "What is the capital of France?" with
"L'Étoile, la Marseillaise, ..." instead of "The capital of France is Paris.": the float32 logits of
"The" and "L" are 25.33 and 25.24, but rounded to bfloat16 (a grid 0.125 apart at that size) they
can tie, and argmax then takes the lower token id. The head's product must stay in float32.
"""

from __future__ import annotations

import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import load_model
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _last_hidden(loaded, ids: list[int]) -> torch.Tensor:
    model = loaded.model
    cache = PagedKVCache(model, num_blocks=16, block_size=16)
    positions, metadata, last = build_metadata(cache, [(PagedSequence(list(ids)), len(ids))], torch.device("cpu"))
    with torch.inference_mode():
        return model(torch.tensor(ids), positions, cache.caches, metadata)[last]


def test_bf16_logits_are_the_float32_product_of_the_hidden_states(smollm2_checkpoint_dir, smollm2):
    bf16 = load_model(ModelConfig(model=str(smollm2_checkpoint_dir), device="cpu", dtype="bfloat16"),
                      TorchAttentionBackend(), progress=False)
    ids = bf16.tokenizer.encode(bf16.tokenizer.apply_chat_template(FRANCE), add_special_tokens=False)
    hidden = _last_hidden(bf16, ids)
    with torch.inference_mode():
        logits = bf16.model.compute_logits(hidden)[0]
        exact = hidden.double() @ bf16.model.lm_head.weight.double().T
    assert logits.dtype == torch.float32
    # bf16 rounding alone would be up to 2^-9 relative (0.06 near 25): stay at float32 rounding instead
    torch.testing.assert_close(logits.double(), exact[0], rtol=2e-6, atol=2e-5)
    top2 = logits.topk(2)
    assert float(top2.values[0] - top2.values[1]) > 0.0  # no tie between "The" and "L"
    with torch.inference_mode():
        reference = smollm2.model.compute_logits(_last_hidden(smollm2, ids))[0]  # the float32 model
    assert int(top2.indices[0]) == int(reference.argmax())
    assert bf16.tokenizer.decode([int(top2.indices[0])]) == "The"
