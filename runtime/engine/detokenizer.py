"""Incremental detokenization and stop strings.

`IncrementalDetokenizer` turns a growing list of token ids into text one step at a time. A
byte-level token may end inside a multi-byte UTF-8 character (an emoji is often 2-4 tokens);
decoding it alone gives U+FFFD. So each step decodes a short window of recent tokens
(`tokens[prefix_offset:]`) and emits only what is new relative to the window's stable part, and
only once the text no longer ends in U+FFFD. The window keeps a few earlier tokens so
tokenizers whose decoding depends on the previous token (leading-space rules) stay correct.

`TextAccumulator` adds stop strings on top: a stop string may span tokens, so text that could
still be the start of one is held back until it either completes (the completion ends, the stop
string is cut off) or is ruled out (the text is released).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens kept in the first window for leading-space rules


class SupportsDecode(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes tokens as they arrive, never emitting half a character.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...)`.
        prompt_token_ids: the prompt; its last few tokens give the first output token context.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
    """

    def __init__(
        self, tokenizer: SupportsDecode, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now complete (possibly empty)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing visible) so far: wait for more
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Keep the window short: the tokens before prefix_offset are never decoded again.
        if self._prefix_offset > 0:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def add_tokens_at_once(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return all the text `add_tokens` would have returned for them one by one.

        One decode of the whole window instead of two per token. Decoding the window at once gives
        the concatenation of the per-token pieces whenever the window's text does not end inside a
        character: every piece starts and ends on a character boundary, and decoding is consistent
        across such boundaries (byte-level BPE, SentencePiece). When it does end inside one, the
        tokens are fed one by one, as a stream would have seen them.
        """
        saved = (list(self._tokens), self._prefix_offset, self._read_offset)
        text = self.add_tokens(token_ids)
        if text or len(token_ids) <= 1:
            return text
        self._tokens, self._prefix_offset, self._read_offset = saved
        return "".join(self.add_tokens([token]) for token in token_ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)


def held_back_length(text: str, stop: Sequence[str]) -> int:
    """Characters at the end of `text` that could be the start of a stop string.

    Only the last len(stop string) - 1 characters can be, so only that window is scanned, and only
    from where it holds the stop string's first character (str.find / str.startswith, in C): the
    cost per step is bounded by the stop strings' lengths (the server caps them,
    `sits.runtime.server.input_limits`), never by the length of the text generated so far.
    """
    longest = 0
    for stop_string in stop:
        window = min(len(stop_string) - 1, len(text))
        if window <= longest:
            continue
        tail = text[len(text) - window:]
        start = tail.find(stop_string[0])
        while start != -1 and window - start > longest:
            if stop_string.startswith(tail[start:]):
                longest = window - start
                break
            start = tail.find(stop_string[0], start + 1)
    return longest


def find_stop_string(text: str, stop: Sequence[str], search_from: int) -> tuple[int, str] | None:
    """The earliest stop string ending at or after `search_from`: (start index, stop string)."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        index = text.find(stop_string, max(0, search_from - len(stop_string) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop_string)
    return best


class TextAccumulator:
    """One completion's text: what was decoded, what was released, and stop strings.

    Args:
        detokenizer: decodes this completion's tokens.
        stop: stop strings; the first one to appear ends the completion.
        include_stop_str_in_output: keep the matched stop string in the text.
        defer: nobody reads the text before the completion ends (a request that does not stream
            text): without stop strings, tokens are only kept, and decoded at once at the end.
    """

    def __init__(
        self, detokenizer: IncrementalDetokenizer, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
        defer: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        self._defer = defer and not self._stop  # stop strings must be looked for as the text grows
        self._deferred: list[int] = []
        self._text = ""  # everything decoded (cut at a stop string once one matched)
        self._released = 0  # characters of _text already returned as deltas
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """The completion's text as released so far."""
        return self._text[: self._released]

    def add_tokens(self, token_ids: Sequence[int], check_stop: bool = True, final: bool = False) -> str:
        """Decode new tokens and return the text delta to release.

        Args:
            token_ids: the tokens this step added (empty to only flush).
            check_stop: look for stop strings (False while fewer than min_tokens were generated).
            final: the completion ends now; release everything held back.
        """
        if self.stopped_by is not None:
            return ""
        if self._defer:
            self._deferred += token_ids
            if not final:
                return ""
            self._text += self._detokenizer.add_tokens_at_once(self._deferred)
            self._deferred = []
            delta, self._released = self._text[self._released :], len(self._text)
            return delta
        search_from = len(self._text)
        if token_ids:
            self._text += self._detokenizer.add_tokens(token_ids)
        if self._stop and check_stop:
            match = find_stop_string(self._text, self._stop, search_from)
            if match is not None:
                index, stop_string = match
                self._text = self._text[: index + len(stop_string) if self._include_stop else index]
                self.stopped_by = stop_string
                final = True
        end = len(self._text) if final or not self._stop else len(self._text) - held_back_length(self._text, self._stop)
        end = max(end, self._released)
        delta = self._text[self._released : end]
        self._released = end
        return delta
