"""Incremental detokenization with the real SmolLM2 tokenizer, and stop strings spanning tokens."""

from __future__ import annotations

import pytest

from sits.runtime.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    TextAccumulator,
    find_stop_string,
    held_back_length,
)
from sits.runtime.models.embedded import embedded_gguf_path
from sits.runtime.models.gguf_cache import cached_checkpoint_dir
from sits.runtime.models.tokenizer import Tokenizer

PROMPT = "Say something:"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_directory(cached_checkpoint_dir(embedded_gguf_path(), progress=False))


def stream(tokenizer: Tokenizer, text: str, **accumulator_args) -> tuple[list[str], TextAccumulator, list[int]]:
    """Feed text's tokens one at a time; return the deltas."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    accumulator = TextAccumulator(IncrementalDetokenizer(tokenizer, prompt), **accumulator_args)
    deltas = [accumulator.add_tokens([token]) for token in ids]
    return deltas, accumulator, ids


@pytest.mark.parametrize(
    "text",
    ["Hello 😀 world 你好世界", "naïve café 🎉🎉 ✓ — «ok»", "日本語のテキスト 👩‍👩‍👧 done", " leading space\nand\ttabs"],
)
def test_multibyte_characters_are_never_split(tokenizer, text):
    deltas, accumulator, ids = stream(tokenizer, text)
    # Several of these characters span 2-4 tokens, each of which alone decodes to U+FFFD.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids) or text.isascii()
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert accumulator.text == text


def test_text_waits_for_the_rest_of_a_character(tokenizer):
    ids = tokenizer.encode("A😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = [detokenizer.add_tokens([t]) for t in ids]
    assert pieces[0] == "A"
    assert pieces[1:-1] == [""] * (len(ids) - 2)  # the emoji's leading bytes: nothing yet
    assert pieces[-1] == "😀"


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    eos = next(iter(tokenizer.eos_token_ids))
    hidden = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [eos]
    assert "".join(hidden.add_tokens([t]) for t in ids) == "Hi"
    assert "".join(shown.add_tokens([t]) for t in ids) == "Hi" + tokenizer.decode([eos], skip_special_tokens=False)


def test_stop_string_spanning_tokens_is_held_back_then_cut(tokenizer):
    text = "The answer is 42. END of text that must not appear"
    deltas, accumulator, ids = stream(tokenizer, text, stop=["END of"])
    released = "".join(deltas)
    assert released == "The answer is 42. "
    assert accumulator.stopped_by == "END of"
    # " END" arrived before " of": it was held back, never released and then taken back.
    end_token = tokenizer.encode(" END", add_special_tokens=False)
    assert len(end_token) == 1 and end_token[0] in ids
    assert all("END" not in d for d in deltas)
    assert accumulator.text == "The answer is 42. "


def test_stop_string_can_be_kept_in_the_output(tokenizer):
    deltas, accumulator, _ = stream(tokenizer, "one, two, three, four", stop=["three"], include_stop_str_in_output=True)
    assert "".join(deltas) == accumulator.text == "one, two, three"


def test_text_that_stops_looking_like_a_stop_string_is_released(tokenizer):
    deltas, accumulator, _ = stream(tokenizer, "an ENDLESS story", stop=["END!"])
    assert accumulator.stopped_by is None
    assert "".join(deltas) + accumulator.add_tokens([], final=True) == "an ENDLESS story"


def test_held_back_text_is_flushed_when_the_completion_ends(tokenizer):
    ids = tokenizer.encode("wait for EN", add_special_tokens=False)
    accumulator = TextAccumulator(IncrementalDetokenizer(tokenizer, []), stop=["END"])
    streamed = "".join(accumulator.add_tokens([t]) for t in ids)
    assert streamed == "wait for "
    assert accumulator.add_tokens([], final=True) == "EN"
    assert accumulator.text == "wait for EN"


def test_stop_check_can_be_deferred_until_min_tokens(tokenizer):
    ids = tokenizer.encode("STOP and go STOP", add_special_tokens=False)
    accumulator = TextAccumulator(IncrementalDetokenizer(tokenizer, []), stop=["STOP"])
    first = accumulator.add_tokens(ids[:1], check_stop=False)
    rest = "".join(accumulator.add_tokens([t]) for t in ids[1:])
    assert accumulator.stopped_by == "STOP"
    assert first + rest == "STOP and go "


def test_stop_string_helpers():
    assert held_back_length("hello EN", ["END"]) == 2
    assert held_back_length("hello E", ["XX", "END"]) == 1
    assert held_back_length("hello", ["END"]) == 0
    assert held_back_length("abcab", ["abcabd"]) == 5
    assert find_stop_string("xx STOP yy END", ["END", "STOP"], 0) == (3, "STOP")
    assert find_stop_string("xx STOP yy", ["STOP"], 8) is None  # ended before the new text
    assert find_stop_string("xx STOP", ["STOP"], 6) == (3, "STOP")  # completed by the new text
