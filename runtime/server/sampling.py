"""From an OpenAI request to the engine's SamplingParams, and the token budget of one prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sits.runtime.engine.client import EngineClient
from sits.runtime.engine.request import SamplingParams, StructuredOutputSpec
from sits.runtime.engine.structured_output import (
    JSON_OBJECT,
    choice_spec,
    grammar_spec,
    json_schema_spec,
    regex_spec,
)
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from sits.runtime.server.protocol_structured import GUIDED_CONSTRAINTS

SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator accepts


def output_budget(prompt_tokens: int, requested: int | None, max_model_len: int, *, default: int | None,
                  param: str, prompt_name: str) -> int:
    """How many tokens to generate: the request's limit, else `default`, else all that fits.

    Raises a 400 (code context_length_exceeded) when the prompt alone fills the context, or when the
    prompt plus the requested tokens do not fit (what OpenAI and vLLM answer).
    """
    if prompt_tokens >= max_model_len:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_name} "
            f"has {prompt_tokens} tokens, which leaves no room to generate. Please shorten the {prompt_name}.",
            param=prompt_name, code="context_length_exceeded")
    room = max_model_len - prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise invalid_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {prompt_name}, {requested} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion.",
            param=param, code="context_length_exceeded")
    return requested


def sampling_params(request: ChatCompletionRequest | CompletionRequest, *, max_tokens: int,
                    logprobs: int | None, vocab_size: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for the request, validated (SamplingParamsError names the param: a 400) —
    against the model's vocabulary too when `vocab_size` is given, so a stream never starts for
    a request the engine would refuse."""
    if request.seed is not None and not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]:
        raise invalid_request(f"seed must fit in 64 bits, got {request.seed}", param="seed")
    params = SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stop=request.stop_list,
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=request.logit_bias or None,
        structured_output=structured_output(request),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
    )
    params.validate(vocab_size=vocab_size)
    return params


# vLLM's constraint names -> the engine's spec of a value sent in the request field `source`
_SPECS: dict[str, Callable[[Any, str], StructuredOutputSpec]] = {
    "json": json_schema_spec,
    "regex": regex_spec,
    "choice": choice_spec,
    "grammar": grammar_spec,
    "json_object": lambda _, source: StructuredOutputSpec("json_object", source=source),
}


def structured_output(request: ChatCompletionRequest | CompletionRequest) -> StructuredOutputSpec | None:
    """The engine's spec of the request's output constraint: response_format (None for text),
    structured_outputs or a guided_* parameter (the protocol let at most one through); its `source`
    is the field sent, so whatever the grammar engine refuses is a 400 naming it. In a chat whose
    tool_choice forces a call, structured_outputs and guided_* are 400s, as response_format is."""
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            return JSON_OBJECT
        schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
        return json_schema_spec(schema)
    if request.structured_outputs is not None:
        name, value = request.structured_outputs.constraint()
        param, spec = "structured_outputs", _SPECS[name](value, f"structured_outputs.{name}")
    else:
        param = next((name for name in GUIDED_CONSTRAINTS if getattr(request, name) is not None), "")
        if not param:
            return None
        spec = _SPECS[param.removeprefix("guided_")](getattr(request, param), param)
    if isinstance(request, ChatCompletionRequest) and _forces_tool_call(request):
        raise invalid_request(f"{param} cannot be combined with a tool_choice that forces a call: the call's "
                              "arguments already follow the function's schema", param)
    return spec


def _forces_tool_call(request: ChatCompletionRequest) -> bool:
    choice = request.tool_choice
    return choice == "required" or isinstance(choice, NamedToolChoice)


async def compile_response_format(engine: EngineClient, params: SamplingParams) -> None:
    """Compile the request's grammar in a worker thread, before the request reaches the engine: a
    schema, regex or grammar the grammar engine refuses is a 400 naming the field it came from
    (never a stream that fails), and the engine then finds the grammar in its cache instead of
    compiling on its own thread."""
    if params.structured_output is None:
        return
    await asyncio.to_thread(engine.compile_grammar, params.structured_output)
