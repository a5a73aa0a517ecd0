"""N-gram (prompt lookup) speculative decoding: which sequences speculate, and their drafts.

A decoding sequence looks for the latest earlier occurrence of its last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) in its own prompt + output and proposes the k tokens
that followed it. The scheduler reserves KV slots for [last token + drafts]; the runner scores
them in one pass (`spec_verify.py`) and `update_from_output` keeps the accepted prefix plus one
token of the target's own. Positions past the accepted length are never attended to (the
sequence's computed length only advances by accepted tokens), so rejected drafts' KV slots are
simply overwritten later, and only full blocks of accepted tokens are ever hashed.

Sequences whose next token depends on more than the target's distribution over plain sampling
transforms propose no drafts and decode exactly as without speculation: logprobs or prompt
logprobs, penalties, logit_bias, allowed_token_ids, bad_words, a response_format, stop strings
(the text is checked per step, so a stop string must end a step's tokens), min_tokens not yet
reached, or a LoRA adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as TokenList

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from sits.runtime.config import SpeculativeConfig
from sits.runtime.engine.sequence import Sequence
from sits.runtime.engine.stats import SpecDecodeCounts

logger = logging.getLogger(__name__)


class NgramProposer:
    """Proposes up to k drafts by matching a sequence's suffix earlier in its own tokens.

    Args:
        num_speculative_tokens: k, the most drafts one proposal returns.
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: TokenList[int], max_drafts: int | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix.

        Args:
            token_ids: the sequence so far (prompt + output).
            max_drafts: a tighter cap than k (room left in the step or before max_tokens).
        Returns:
            0..min(k, max_drafts) draft token ids; none when no suffix of length min_n..max_n
            occurs earlier.
        """
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(token_ids)
        if limit <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0..length-n-1: every earlier occurrence, followed by >= 1 token
            windows = sliding_window_view(tokens[: length - 1], n)
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + limit].tolist()
        return []


class Speculator:
    """The scheduler's side of speculation: who speculates, how many drafts, what was accepted.

    Args:
        config: the validated `--speculative-config`.
        max_model_len: a sequence never holds more tokens than this.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        logger.info("speculative decoding on: %s", config.describe())

    def drafts_for(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts for a decoding sequence that fit the step's token `budget` (after its own token)
        and its output limits (the target adds one token of its own after the accepted drafts)."""
        if not speculates(seq):
            return []
        room = min(budget - 1, seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        return self.proposer.propose(seq.all_token_ids, room) if room > 0 else []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def counts(self) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_draft_tokens, self.num_accepted_tokens)


def speculates(seq: Sequence) -> bool:
    """Whether `seq` may take drafts this step: it decodes one known token, and nothing but the
    target's plain sampling distribution decides its next tokens (see the module docstring)."""
    params = seq.params
    return (seq.num_pending_tokens == 0 and seq.num_uncomputed_tokens == 1 and seq.lora_slot == 0
            and seq.num_output_tokens >= params.min_tokens
            and params.logprobs is None and params.prompt_logprobs is None
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias
            and params.allowed_token_ids is None and not params.bad_words and not params.bad_words_token_ids
            and params.structured_output is None and not params.stop)
