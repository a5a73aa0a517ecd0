"""Size limits of request parameters whose cost grows with their length (docs/security.md).

- `stop`: at most MAX_STOP_STRINGS strings of at most MAX_STOP_STRING_CHARS characters each. Each
  step of each sequence looks for every stop string at the end of the new text, and holds back a
  tail that could be the start of one (`detokenizer.held_back_length`), so their length is the
  engine thread's cost.
- `bad_words`: at most MAX_BAD_WORDS words of at most MAX_BAD_WORD_CHARS characters each, and
  MAX_BAD_WORDS_TOTAL_CHARS in all; they are tokenized in a worker thread, never on the event loop
  (`sampling.resolve_bad_words_off_loop`).

Beyond a limit the request is a 400 naming the parameter (pydantic validators of the protocol).
Structured-output constraints have their own, configurable bounds (`grammar_compiler.GrammarLimits`).

A request beyond the model's context is a 400 with code `context_length_exceeded`, worded in OpenAI's
way by `context_length_error` wherever it is found (too many characters or messages before tokenizing,
too many tokens after).
"""

from __future__ import annotations

from collections.abc import Sequence

from sits.runtime.server.errors import OpenAIError, invalid_request

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024
MAX_BAD_WORDS_TOTAL_CHARS = 64 * 1024


def check_stop_strings(stop: str | Sequence[str] | None) -> None:
    """ValueError (a 400 naming `stop`) for too many or too long stop strings."""
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else list(stop)
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
    longest = max((len(s) for s in strings), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters; one has {longest}")


def check_bad_words(words: Sequence[str] | None) -> None:
    """ValueError (a 400 naming `bad_words`) for too many, too long, or too much text in all."""
    if words is None:
        return
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(words)}")
    longest = max((len(word) for word in words), default=0)
    if longest > MAX_BAD_WORD_CHARS:
        raise ValueError(f"each bad_words entry may have at most {MAX_BAD_WORD_CHARS} characters; one has {longest}")
    total = sum(len(word) for word in words)
    if total > MAX_BAD_WORDS_TOTAL_CHARS:
        raise ValueError(f"bad_words may have at most {MAX_BAD_WORDS_TOTAL_CHARS} characters in all, got {total}")


def context_length_error(max_model_len: int, however: str, please: str, param: str) -> OpenAIError:
    """The 400 of a request that cannot fit the context, as OpenAI words it:
    "This model's maximum context length is N tokens. However, <however>. Please <please>."."""
    return invalid_request(f"This model's maximum context length is {max_model_len} tokens. However, {however}. "
                           f"Please {please}.", param=param, code="context_length_exceeded")


def prompt_fills_context(max_model_len: int, prompt_tokens: int, prompt_name: str, param: str) -> OpenAIError:
    """The 400 of a prompt that alone fills the context."""
    return context_length_error(max_model_len, f"your {prompt_name} has {prompt_tokens} tokens, which leaves no "
                                f"room to generate", f"shorten the {prompt_name}", param)
