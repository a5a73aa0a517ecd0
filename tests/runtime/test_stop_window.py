"""The held-back tail of stop strings (`detokenizer.held_back_length`) scans only the window a stop
string could start in: the same answer as checking every prefix, whatever the text's length."""

from __future__ import annotations

import random

from sits.runtime.engine.detokenizer import held_back_length


def every_prefix(text: str, stop: list[str]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string, by checking every length."""
    return max((length for s in stop for length in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:length])), default=0)


def test_matches_checking_every_prefix():
    rng = random.Random(19)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
        assert held_back_length(text, stop) == every_prefix(text, stop), (text, stop)


def test_long_texts_and_stop_strings_at_the_limit():
    stop = ["a" * 1023 + "b", "xyz", "a" * 10 + "c"]
    text = "q" * 200_000 + "a" * 5000  # a long output ending in many a's: 1023 of them may start the first
    assert held_back_length(text, stop) == 1023
    assert held_back_length(text + "x", stop) == 1
    assert held_back_length(text + "b", stop) == 0
    assert held_back_length("", stop) == 0 and held_back_length("abc", ["x"]) == 0
