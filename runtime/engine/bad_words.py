"""vLLM's `bad_words` as token-id sequences: resolved once, where a request is validated.

Free of torch and numpy, so the API server resolves a request's bad words with the tokenizer it
already holds; the engine's per-step masks are in `token_masks.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from sits.runtime.engine.request import SamplingParams, SamplingParamsError


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """The token-id sequences a list of bad words bans, by vLLM's rule.

    Each word, leading whitespace stripped, is encoded as it is and with one leading space; the
    spaced form is added only when it starts with another token and has as many tokens (a
    tokenizer that marks a word's start differently), so that a word is banned at the start of the
    text and after a space alike.

    Raises:
        SamplingParamsError (param "bad_words"): a word that encodes to no tokens.
    """
    token_ids: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise SamplingParamsError("bad_words", f"bad_words entry {word!r} has no tokens")
        token_ids.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            token_ids.append(list(spaced))
    return token_ids


def resolve_bad_words(params: SamplingParams, tokenizer: Any, vocab_size: int) -> None:
    """Fill `params.bad_words_token_ids` from `params.bad_words` (validated params; done once, and
    ids given are kept as they are).

    Raises:
        SamplingParamsError (param "bad_words"): a word without tokens, or with an id the model
            does not have.
    """
    if not params.bad_words or params.bad_words_token_ids is not None:
        return
    token_ids = bad_words_token_ids(params.bad_words, tokenizer)
    bad = next((t for word in token_ids for t in word if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplingParamsError("bad_words", f"bad_words encode to token id {bad}, outside the model's "
                                               f"vocabulary (size {vocab_size})")
    params.bad_words_token_ids = token_ids
