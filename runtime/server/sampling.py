"""From an OpenAI request to the engine's SamplingParams (validated here, once), its output grammar, and
the token budget of one prompt (`sits.runtime.server.input_processor` puts them together)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request

from sits.runtime.engine.bad_words import resolve_bad_words
from sits.runtime.engine.request import SamplingParams, StructuredOutputSpec
from sits.runtime.engine.structured_output import (
    JSON_OBJECT,
    choice_spec,
    grammar_spec,
    json_schema_spec,
    regex_spec,
)
from sits.runtime.engine.validated import ValidatedSamplingParams
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.grammar_compiler import ClientLeft, GrammarCompiler
from sits.runtime.server.input_limits import context_length_error, prompt_fills_context
from sits.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from sits.runtime.server.protocol_structured import GUIDED_CONSTRAINTS
from sits.runtime.server.serving import ClientGone, until_disconnected

SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator accepts


def output_budget(prompt_tokens: int, requested: int | None, max_model_len: int, *, default: int | None,
                  param: str, prompt_name: str) -> int:
    """How many tokens to generate: the request's limit, else `default`, else all that fits.

    Raises a 400 (code context_length_exceeded) when the prompt alone fills the context, or when the
    prompt plus the requested tokens do not fit (what OpenAI and vLLM answer).
    """
    if prompt_tokens >= max_model_len:
        raise prompt_fills_context(max_model_len, prompt_tokens, prompt_name, param=prompt_name)
    room = max_model_len - prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise context_length_error(
            max_model_len, f"you requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
            f"{prompt_name}, {requested} in the completion)",
            f"reduce the length of the {prompt_name} or completion", param=param)
    return requested


def sampling_params(request: ChatCompletionRequest | CompletionRequest, *, max_tokens: int,
                    logprobs: int | None, vocab_size: int,
                    prompt_logprobs: int | None = None,
                    structured_output: StructuredOutputSpec | None = None) -> ValidatedSamplingParams:
    """SamplingParams for the request, validated here once (SamplingParamsError names the param: a
    400) against the model's vocabulary, so a stream never starts for a request the engine would
    refuse; the engine trusts them (`sits.runtime.engine.validated`). `structured_output`: the
    request's output grammar, already compiled (`compile_output_constraint`)."""
    if request.seed is not None and not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]:
        raise invalid_request(f"seed must fit in 64 bits, got {request.seed}", param="seed")
    params = ValidatedSamplingParams(
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
        structured_output=structured_output,
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


async def compile_output_constraint(request: Request, spec: StructuredOutputSpec | None, tenant: str) -> None:
    """Make the request's output grammar ready in the engine's cache before the request takes any
    admission slot (`sits.runtime.server.grammar_compiler`): over a limit, refused by xgrammar or
    too slow to compile is a 400 naming the field it came from; a tenant compiling too many at
    once gets a 429; a client that leaves meanwhile stops the compile (raises ClientGone)."""
    if spec is None:
        return
    compiler: GrammarCompiler = request.app.state.grammar_compiler
    try:
        await compiler.compile(spec, tenant, lambda: until_disconnected(request))
    except ClientLeft:
        request.state.client_gone = True
        raise ClientGone from None


async def resolve_bad_words_off_loop(params: Sequence[SamplingParams], tokenizer: Any, vocab_size: int) -> None:
    """Tokenize the requests' `bad_words` in a worker thread (never on the event loop) and give every
    params the result; the engine then finds them resolved. SamplingParamsError (a 400) for a word
    without tokens."""
    if not params or not params[0].bad_words:
        return
    first = params[0]
    await asyncio.to_thread(resolve_bad_words, first, tokenizer, vocab_size)
    for other in params[1:]:
        other.bad_words_token_ids = first.bad_words_token_ids
