"""When a sequence stops, decided here and nowhere else in the engine core.

Checked for every token appended to a sequence (`Scheduler.update_from_output`), in this order:
  1. once min_tokens output tokens exist: an EOS token (unless ignore_eos) or one of the
     request's stop_token_ids ends it with "stop" (the token is not part of the text);
  2. max_tokens output tokens (the limit `add_request` resolved: the request's max_tokens, or what
     max_model_len and the tenant's room in the cache leave), or max_model_len tokens in all, end
     it with "length";
  3. under a response_format, its grammar matcher takes the new tokens; a grammar that ended (a
     complete document whose stop token was taken under ignore_eos, or a token it refused) ends
     it with "stop".
The scheduler asks `pending_token_is_last` before scheduling a sequence whose last token is still
on its way to the host (async scheduling): a token that will end it by length needs no next step.

Stop strings are decided on text, where the text is decoded (the output processor); aborts come
from the client side. Both finish sequences through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from collections.abc import Iterable

from sits.runtime.engine.sequence import Sequence, SequenceStatus


class StopChecker:
    """Engine-side stop conditions of one model.

    Args:
        eos_token_ids: tokens that end a sequence unless its params say ignore_eos.
        max_model_len: a sequence holding this many tokens (prompt + output) ends by length.
    """

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token_id: int) -> tuple[SequenceStatus | None, bool]:
        """Whether `token_id`, just appended to `seq`, ends it.

        Returns:
            (the finished status, or None to go on; True when the token itself ended it, so its
            text is not returned). Sets `seq.stop_reason` for a stop token id.
        """
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED, True
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED, True
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, False
        if seq.grammar is not None and seq.grammar.catch_up(seq.output_token_ids):
            return SequenceStatus.FINISHED_STOPPED, True
        return None, False

    def pending_token_is_last(self, seq: Sequence) -> bool:
        """The tokens still on their way to the host will end `seq` by length (max_tokens or
        max_model_len), so scheduling another step for it would compute a token nobody gets."""
        pending = seq.num_pending_tokens
        return (seq.num_output_tokens + pending >= seq.max_tokens
                or len(seq.all_token_ids) + pending >= self.max_model_len)
