"""The OpenAI request bodies the server accepts (pydantic, validated at the edge).

Types are strict (a string is not a number), so `"max_tokens": "5"` is a 400 naming `max_tokens`
rather than a silent conversion. Unknown fields are ignored, as vLLM does, so clients written for
other OpenAI-compatible servers keep working. Range checks that SamplingParams already knows
(temperature, top_p, penalties, ...) stay there: one rule, one place.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from sits.runtime.server import protocol_structured as structured
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.input_limits import check_bad_words, check_stop_strings
from sits.runtime.server.protocol_base import StrictModel as _Strict
from sits.runtime.server.protocol_base import collapsed
from sits.runtime.server.protocol_chat import ChatTemplateOptions, PromptTruncation
from sits.runtime.server.protocol_tools import NamedToolChoice, ToolCall, ToolDefinition, validated_tools

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "NamedToolChoice", "ResponseFormat",
           "ToolCall", "ToolDefinition", "validated_tools"]

MAX_LOGPROBS = 20
_TOKEN_ID = re.compile(r"-?[0-9]+")  # a token id as a JSON key spells it (SamplingParams refuses a negative one)


def _logprobs_count(value: int | None, info: ValidationInfo) -> int | None:
    """Field validator of a logprobs count (prompt_logprobs, top_logprobs, completions' logprobs):
    None or 0..MAX_LOGPROBS; a 400 naming the field otherwise."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{info.field_name} must be between 0 and {MAX_LOGPROBS}, got {value}")
    return value


def _token_limit(least: int) -> Callable[[int | None, ValidationInfo], int | None]:
    """Field validator of a token limit (max_tokens, max_completion_tokens): None or at least
    `least`; a 400 saying the field must be at least 1 otherwise (max_tokens lets 0 through to
    `check_combination`, which allows it only with echo)."""

    def check(value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < least:
            raise ValueError(f"{info.field_name} must be at least 1, got {value}")
        return value

    return check


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: the schema the output must follow."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema.schema (the JSON schema of the output)')
        return self


class _SamplingFields(_Strict):
    """Fields both endpoints share; vLLM's extras (top_k, min_p, ...) come through `extra_body`."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[int, float] | None = None  # JSON keys are strings: "50256" -> 50256 (`_logit_bias`)
    response_format: ResponseFormat | None = None  # vLLM accepts it on /v1/completions too
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: each prompt token's logprob and its top k (not streamed, as in vLLM)
    prompt_logprobs: int | None = None
    # vLLM's: only these token ids may be sampled; words the output never contains (`token_masks.py`)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # SITS: the prompt may hit (and fill) the shared-prefix pool of every tenant (a 400 without one)
    shared_prefix: bool = False
    # vLLM's output constraints (`protocol_structured.py`): at most one of these and response_format
    structured_outputs: structured.StructuredOutputsParams | None = None
    guided_json: structured.SchemaObject = None
    guided_regex: str | None = None
    guided_choice: structured.Choices = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: structured.WhitespacePattern = None
    guided_decoding_backend: structured.Backend = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            check_stop_strings(value)
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            check_stop_strings(value)
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("response_format", "structured_outputs", mode="wrap")
    @classmethod
    def _response_format(cls, value: Any, handler: Any) -> Any:
        """Any fault inside response_format (or structured_outputs) is a 400 naming it (as OpenAI names it)."""
        try:
            return handler(value)
        except ValidationError as error:
            raise collapsed(error) from None

    @field_validator("allowed_token_ids", "bad_words", mode="wrap")
    @classmethod
    def _token_lists(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        """A wrong item is a 400 naming the list itself (emptiness, ranges and the vocabulary are
        SamplingParams' and the engine's checks)."""
        try:
            value = handler(value)
        except ValidationError as error:
            raise collapsed(error) from None
        if info.field_name == "bad_words":
            check_bad_words(value)
        return value

    # 0 passes here: /v1/completions allows it with echo (`check_combination` says where)
    _max_tokens = field_validator("max_tokens")(_token_limit(0))
    _prompt_logprobs_range = field_validator("prompt_logprobs")(_logprobs_count)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        """OpenAI's map of token id (a string of an integer, as JSON keys are) to a bias; a 400 naming
        logit_bias otherwise. The range ([-100, 100]), the 300-entry cap and the vocabulary are
        checked by SamplingParams and the engine."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        biases = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key)):
                raise ValueError(f"invalid key {key!r}: keys must be token ids (integers as strings)")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"the bias of token {key} must be a number, got {bias!r}")
            biases[int(key)] = float(bias)
        return biases

    def check_combination(self) -> None:
        """Rules across fields (a 400 naming the param); single-field rules are validators."""
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        structured.check_one_constraint(self)  # response_format, structured_outputs, guided_*: at most one

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; content may be a string or a list of text parts (images are not supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[ToolCall] | None = None  # an assistant message: the calls it made

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | list):
            raise ValueError("content must be a string or a list of text parts")
        if isinstance(value, list):
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(ChatTemplateOptions, PromptTruncation, _SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: the rendered prompt's special tokens (the template writes its own), and echo, which
    # starts the reply with the last message's text when that is an assistant message
    add_special_tokens: bool = False
    echo: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # None: "auto" when tools are given, else "none" (`effective_tool_choice`)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    _max_completion_tokens = field_validator("max_completion_tokens")(_token_limit(1))
    _top_logprobs_range = field_validator("top_logprobs")(_logprobs_count)

    @field_validator("tools", mode="wrap")
    @classmethod
    def _tools(cls, value: Any, handler: Any) -> Any:
        return validated_tools(value, handler)

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice(cls, value: Any, handler: Any) -> Any:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {value!r}')
        try:
            return handler(value)
        except ValidationError as error:
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}') from error

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """What tool_choice means here: "auto" when tools are given without one (OpenAI's default)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_combination(self) -> None:
        super().check_combination()
        if self.max_tokens == 0:
            raise invalid_request("max_tokens must be at least 1, got 0", "max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.check_rendering()
        self._check_tool_choice()

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise invalid_request("tool_choice is only allowed when tools are given", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools or ()}:
            raise invalid_request(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                  "the tools", "tool_choice")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise invalid_request("response_format cannot be combined with a tool_choice that forces a call: "
                                  "the call's arguments already follow the function's schema", "response_format")

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(PromptTruncation, _SamplingFields):
    """`prompt` is a string, a list of strings (a batch), a list of token ids, or a list of those."""

    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def is_ids(item: Any) -> bool:
            return isinstance(item, list) and bool(item) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return value
            if all(isinstance(item, str) for item in value) or all(is_ids(item) for item in value):
                return value
        raise ValueError("prompt must be a string, a non-empty list of strings, "
                         "a non-empty list of token ids, or a list of token-id lists")

    _logprobs_range = field_validator("logprobs")(_logprobs_count)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def check_combination(self) -> None:
        super().check_combination()
        if self.best_of is not None and self.best_of != self.n:
            raise invalid_request("best_of other than n is not supported", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request("max_tokens must be at least 1, got 0 (0 is allowed only with echo, which "
                                  "returns the prompt without generating)", "max_tokens")
        if self.echo_only and self.min_tokens > 0:
            raise invalid_request(f"min_tokens ({self.min_tokens}) must not exceed max_tokens (0)", "min_tokens")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine collects: prompt_logprobs, else with echo the logprobs asked."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch: each entry one prompt, text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(t, int) for t in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)
