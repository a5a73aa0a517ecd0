"""The real SmolLM2-135M-Instruct (GGUF, Q4_1) through our loader, model and torch back end, against
transformers reading the same file."""

from __future__ import annotations

import torch

from sits.runtime.models.gguf_cache import cache_root
from tests.support.model_driver import PagedKVCache, PagedSequence, greedy_generate, run_step

NEW_TOKENS = 16

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
]
PLAIN_PROMPTS = ["def fibonacci(n):\n    "]


def _prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    chats = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in CONVERSATIONS]
    return chats + [tok.encode(p) for p in PLAIN_PROMPTS]


def _hf_greedy(hf_model, prompt: list[int], eos_id: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id,
        )
    return out[0, len(prompt):].tolist()


def test_loaded_model_describes_itself(smollm2):
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.source.startswith("embedded:")
    assert smollm2.device == torch.device("cpu") and smollm2.dtype == torch.float32
    config = smollm2.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (30, 576, 9, 3, 64)
    assert config.tie_word_embeddings
    assert smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    assert smollm2.tokenizer.eos_token_ids == frozenset({2})
    assert smollm2.model.cos_sin_cache.dtype == torch.float32


def test_conversion_is_cached_under_the_cache_dir(smollm2_checkpoint_dir):
    assert smollm2_checkpoint_dir.is_relative_to(cache_root())
    names = {p.name for p in smollm2_checkpoint_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "model.safetensors.index.json"} <= names
    assert not [p for p in smollm2_checkpoint_dir.parent.iterdir() if p.name.startswith(".")], "temp dirs left"


def test_prefill_logits_match_transformers(smollm2, hf_smollm2):
    prompt = _prompts(smollm2)[1]
    cache = PagedKVCache(smollm2.model, num_blocks=16, block_size=8)
    ours = run_step(smollm2.model, cache, [(PagedSequence(prompt), len(prompt))])[0]
    with torch.inference_mode():
        reference = hf_smollm2(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=1e-4)


def test_greedy_generation_matches_transformers(smollm2, hf_smollm2):
    """All prompts batched together (chunked prefills over 4-token blocks, then decodes over the paged
    cache) give exactly transformers' greedy tokens for each prompt generated alone. EOS is masked in
    both, as min_new_tokens does in transformers."""
    prompts = _prompts(smollm2)
    eos = smollm2.tokenizer.eos_token_id
    ours = greedy_generate(smollm2.model, prompts, NEW_TOKENS, block_size=4, prefill_chunk=16,
                           suppress_ids=frozenset({eos}))
    for prompt, generated in zip(prompts, ours, strict=True):
        assert generated == _hf_greedy(hf_smollm2, prompt, eos), smollm2.tokenizer.decode(prompt)
    assert "Paris" in smollm2.tokenizer.decode(ours[0])  # and the answer is sensible
