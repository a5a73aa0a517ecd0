"""What a request asks for and what the engine gives back.

These dataclasses are the contract between the server, the engine and the scheduler. They hold
plain Python values only (no tensors), so the scheduler never sees the model and the server never
sees the KV cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter (a 400 at the edge)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a completion's text must be, enforced token by token: OpenAI's `response_format`, or
    vLLM's `structured_outputs` (and its older `guided_*` parameters).

    Attributes:
        kind: "json_object" (any JSON object), "json_schema" (JSON valid against a schema), "regex"
            (text the regular expression matches whole), "choice" (exactly one of a list of strings)
            or "grammar" (text derived from an EBNF grammar's `root` rule, xgrammar's dialect).
        text: what the kind is built from: the schema as compact JSON (keys in the client's order,
            which is the order properties are generated in), the regex, the grammar (for "choice",
            the grammar of the choices' string literals); None for json_object.
        source: the request field the constraint came from, dotted ("response_format.json_schema.schema",
            "structured_outputs.regex", "guided_choice"): errors name it, and a 400 names its first
            part. Not part of equality, so (kind, text) alone keys the engine's grammar cache.
    """

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    text: str | None = None
    source: str = field(default="response_format", compare=False)

    @property
    def param(self) -> str:
        """The request parameter a 400 about this constraint names."""
        return self.source.split(".", 1)[0]


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop (OpenAI / vLLM semantics).

    Attributes:
        n: completions to generate from one prompt (each its own sequence; they share the prompt's
            cached blocks).
        max_tokens: the most tokens to generate per completion; None means up to max_model_len.
        min_tokens: EOS and stop token ids are masked until this many tokens were generated.
        temperature: 0 means greedy.
        top_p, top_k, min_p: nucleus, top-k (0 or -1: off) and min-p filtering.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        repetition_penalty: multiplicative (HF semantics) over prompt and output tokens; 1 is off.
        presence_penalty, frequency_penalty: additive (OpenAI semantics) over output tokens.
        stop: strings that end generation; the stop string is not returned.
        stop_token_ids: token ids that end generation (besides EOS unless ignore_eos).
        include_stop_str_in_output: return the matched stop string too.
        ignore_eos: keep generating past EOS.
        logprobs: None for none; k >= 0 for the chosen token's logprob plus the top k.
            They come from the model's raw logits, before min_tokens, logit_bias and penalties
            (vLLM's default `raw_logprobs` mode).
        prompt_logprobs: None for none; k >= 0 for each prompt token's logprob (given the tokens
            before it), its rank and the top k (`prompt_logprobs.py`; completion 0 of n collects
            them, and it takes no prefix-cache hits). `RequestOutput.prompt_logprobs` holds them.
        skip_special_tokens: leave special tokens out of the returned text.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling
            (OpenAI semantics; greedy picks see it too); at most 300 entries, OpenAI's cap. None
            or empty: off. The engine checks the ids against its vocabulary.
        structured_output: the output must be JSON (an object, or valid against a schema), match a
            regex, be one of some strings or follow a grammar: tokens that would break it are masked
            before sampling (`structured_output.py`); None: off.
        allowed_token_ids: vLLM's: only these ids may be sampled (every other token is masked before
            sampling, `token_masks.py`); None: off. Not empty; the engine checks them against its
            vocabulary. Logprobs stay those of the raw logits, as for logit_bias.
        bad_words: vLLM's: words the output must never contain (`token_masks.py` says how they are
            matched); at most 128 non-blank strings. None or empty: off.
        bad_words_token_ids: the token-id form of bad words: each a token sequence that must never
            appear in the output. None: the engine fills it from `bad_words` with its tokenizer
            when the request is added; given: used as it is (what callers without a tokenizer set).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutputSpec | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    MAX_N = 128
    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0  # |bias| limit
    MAX_LOGIT_BIAS_ENTRIES = 300
    MAX_BAD_WORDS = 128  # vLLM's per-request limit

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_output_tokens(self) -> bool:
        """Sampling the next token needs every output token so far on the host (penalties, a
        grammar, a bad word of several tokens): the engine does not run a step ahead while such a
        request runs. Bad words not yet turned into token ids count as several tokens."""
        if self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            return True
        if self.bad_words and self.bad_words_token_ids is None:
            return True
        return self.structured_output is not None or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first parameter that is out of range.

        `vocab_size` (when known): logit_bias, allowed_token_ids and bad_words_token_ids ids must
        be below it.
        """
        checks: list[tuple[str, bool, str]] = [
            ("n", 1 <= self.n <= self.MAX_N, f"n must be between 1 and {self.MAX_N}, got {self.n}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            ("temperature", 0.0 <= self.temperature <= 2.0,
             f"temperature must be between 0 and 2, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= -1, f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be between -2 and 2, got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}"),
            ("stop", len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "stop must be at most 16 non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)
        if self.logit_bias:
            self._validate_logit_bias(vocab_size)
        if self.allowed_token_ids is not None:
            self._validate_token_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        if self.bad_words is not None:
            self._validate_bad_words()
        for word in self.bad_words_token_ids or ():
            self._validate_token_ids("bad_words", word, vocab_size)

    @staticmethod
    def _validate_token_ids(param: str, token_ids: list[int], vocab_size: int | None) -> None:
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise SamplingParamsError(param, f"{param} must be a non-empty list of token ids")
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise SamplingParamsError(param, f"{param} must hold non-negative token ids, got {token_id!r}")
            if vocab_size is not None and token_id >= vocab_size:
                raise SamplingParamsError(param, f"{param} token id {token_id} is out of range "
                                                 f"(vocabulary size {vocab_size})")

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if not isinstance(words, list | tuple) or len(words) > self.MAX_BAD_WORDS:
            raise SamplingParamsError("bad_words", f"bad_words must be a list of at most {self.MAX_BAD_WORDS} "
                                                   "strings")
        bad = next((w for w in words if not isinstance(w, str) or not w.strip()), None)
        if bad is not None:
            raise SamplingParamsError("bad_words", f"bad_words must hold non-empty words, got {bad!r}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias or {}
        if len(bias) > self.MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError("logit_bias", f"logit_bias may hold at most {self.MAX_LOGIT_BIAS_ENTRIES} "
                                                    f"entries, got {len(bias)}")
        limit = self.MAX_LOGIT_BIAS
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be non-negative token ids, "
                                                        f"got {token_id!r}")
            if vocab_size is not None and token_id >= vocab_size:
                raise SamplingParamsError("logit_bias", f"logit_bias token id {token_id} is out of range "
                                                        f"(vocabulary size {vocab_size})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -limit <= value <= limit:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be between {-limit:g} and "
                                                        f"{limit:g}, got {value!r} for token {token_id}")


class FinishReason(enum.StrEnum):
    """Why a completion ended, spelled as the OpenAI API spells it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away or the server is draining


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 = the most likely token; set for prompt logprobs


@dataclass
class CompletionOutput:
    """One of the n completions of a request, as generated so far.

    `text` and `token_ids` are cumulative; `text_delta` / `token_ids_delta` / `logprobs_delta`
    hold only what this step added (what a stream sends).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    logprobs_delta: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time(), seconds) of one request's life."""

    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache

    def copy(self) -> RequestMetrics:
        """A copy for a snapshot (cheaper than copy.copy on the per-step path)."""
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.finished_time, self.num_cached_prompt_tokens)


@dataclass
class RequestOutput:
    """A snapshot of one request after an engine step.

    `prompt_logprobs` (when the params asked for them): one entry per prompt token, None for the
    first; every snapshot of the request carries the complete list (the same list, never changed).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    tenant: str = "default"
    prompt_logprobs: list[TokenLogprob | None] | None = None
