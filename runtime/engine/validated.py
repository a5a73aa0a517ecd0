"""Requests checked once, at the edge: what the engine takes without checking them again.

The server's input processor (`sits.runtime.server.input_processor`) checks each API request against
the model before a stream starts: the prompt's token ids, the context (the model's, and what the
tenant's share of the KV cache holds), every sampling parameter (`SamplingParams.validate` against
the vocabulary), bad words resolved to token ids, the output grammar compiled. It hands the engine
`ValidatedSamplingParams`; `LLMEngine.add_request` then asserts invariants only.

Direct users of the engine (`sits generate`, `sits bench`, tests) pass plain `SamplingParams`, which
`LLMEngine.add_request` checks itself, once (`LLMEngine.validate_request`), with the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.runtime.engine.request import SamplingParams


@dataclass
class ValidatedSamplingParams(SamplingParams):
    """SamplingParams the edge built and checked for one request: max_tokens is set and fits the
    context with the prompt, ids are inside the vocabulary, `bad_words` are resolved to token ids."""
