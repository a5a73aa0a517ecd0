"""Rebuilding an HF fast tokenizer (`tokenizer.json`) from a GGUF file's `tokenizer.ggml.*` metadata.

Two vocabulary kinds cover the Llama family:
- "gpt2": byte-level BPE (Llama 3, Qwen2, SmolLM2). The pre-tokenizer split depends on
  `tokenizer.ggml.pre`, as in llama.cpp (e.g. SmolLM2 splits digits one by one).
- "llama": sentencepiece BPE with byte fallback (Llama 2, Mistral 7B). When the file holds no merges
  they are recovered from the vocabulary and the token scores.
Tokens the file marks as control (type 3) become special tokens; user-defined ones (type 4)
become added tokens, so both are matched whole in text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4

# Split patterns of llama.cpp's pre-tokenizer types (the regex each vocabulary's merges were learned with).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing or of a kind we cannot rebuild."""


@dataclass
class GGUFTokenizer:
    """The rebuilt tokenizer and the `tokenizer_config.json` that goes with it."""

    tokenizer: Tokenizer
    config: dict[str, Any]


def build_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizer:
    """Rebuild the tokenizer from `tokenizer.*` metadata (key → decoded value).

    Raises:
        GGUFTokenizerError: no vocabulary, or a tokenizer model other than "gpt2" or "llama".
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError("the GGUF file holds no tokenizer vocabulary (tokenizer.ggml.tokens)")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [],
                                    metadata.get("tokenizer.ggml.pre", "default"))
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, metadata.get("tokenizer.ggml.merges"),
                                       metadata.get("tokenizer.ggml.scores"),
                                       metadata.get("tokenizer.ggml.add_space_prefix", True))
        add_bos_default = True  # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise
    else:
        raise GGUFTokenizerError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    _add_marked_tokens(tokenizer, tokens, token_types)

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and special["bos_token"] is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and special["eos_token"] is not None
    _set_post_processor(tokenizer, special, add_bos, add_eos)
    config = {**special, "add_bos_token": add_bos, "add_eos_token": add_eos}
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return GGUFTokenizer(tokenizer, config)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _SPLITS and pre != "qwen2"))
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":
        # SmolLM's vocabulary was trained with every digit on its own.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "default", "gpt2" and friends: GPT-2's own split
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None,
                       add_space_prefix: bool) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        pairs = merges_from_scores(tokens, scores or [0.0] * len(tokens))
    unk = "<unk>" if "<unk>" in vocab else None
    tokenizer = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two known tokens,
    the merge that forms a higher-scoring token first (sentencepiece merges by score)."""
    index = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                found.append((-score, index[left], index[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types, strict=True)
               if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types, strict=True)
            if k == USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _set_post_processor(tokenizer: Tokenizer, special: dict[str, str | None], add_bos: bool, add_eos: bool) -> None:
    if not (add_bos or add_eos):
        return
    bos, eos = special["bos_token"], special["eos_token"]
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    used = {t for t, on in ((bos, add_bos), (eos, add_eos)) if on}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tokenizer.token_to_id(t)) for t in used],
    )
