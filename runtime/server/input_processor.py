"""From an API request to validated engine requests, checked once, at the edge (both generation endpoints).

`/v1/chat/completions` and `/v1/completions` open and end the same way; only their prompts differ:

1. `open_request`: the model (a 404 also for one kept from the tenant), readiness (503), parameter
   combinations and the prefix-cache salt (400s), before any work.
2. The endpoint compiles its output grammar, reserves admission and builds its prompts' token ids.
3. `engine_requests`: each prompt's output budget within the context the tenant may use, and its
   `ValidatedSamplingParams` (every parameter checked against the vocabulary, bad words resolved off
   the event loop). The engine trusts them and only asserts invariants (`sits.runtime.engine.validated`).
4. `EngineRequests.stream` runs them; `respond` returns the stream as SSE events or the whole answer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sits.runtime.engine.request import RequestOutput, StructuredOutputSpec
from sits.runtime.engine.validated import ValidatedSamplingParams
from sits.runtime.server.event_stream import EventStreamResponse
from sits.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sits.runtime.server.request_ids import new_request_id
from sits.runtime.server.sampling import output_budget, resolve_bad_words_off_loop, sampling_params
from sits.runtime.server.serving import ClientGone, ServingContext, collect_unless_disconnected, merge_streams
from sits.runtime.server.tenant import request_allowed_models, request_cache_salt, request_priority

GenerationRequest = ChatCompletionRequest | CompletionRequest
MergedStream = AsyncIterator[tuple[int, RequestOutput]]  # (prompt index, snapshot) of every engine request


@dataclass(frozen=True)
class RequestOpening:
    """What every generation request settles first.

    Attributes:
        arrival: time.perf_counter() when the handler began (the start of TTFT).
        lora: the LoRA adapter the model id names; None for the base model.
        cache_salt: the prefix-cache salt of the request's prompts (`request_cache_salt`).
        priority: the tenant's scheduling priority (0 to 3).
    """

    arrival: float
    lora: str | None
    cache_salt: str | None
    priority: int


def open_request(ctx: ServingContext, body: GenerationRequest, request: Request) -> RequestOpening:
    """The checks both endpoints run first, in this order, before any work for the request: the model
    (404, the same for a model kept from the tenant), readiness (503), parameter combinations (400), the
    cache salt (400 for a shared prefix the tenants file does not allow)."""
    arrival = time.perf_counter()
    lora = ctx.check_model(body.model, request_allowed_models(request))
    ctx.check_ready()
    body.check_combination()
    salt = request_cache_salt(request, body.shared_prefix)
    return RequestOpening(arrival=arrival, lora=lora, cache_salt=salt, priority=request_priority(request))


@dataclass(frozen=True)
class EngineRequests:
    """One API request as engine requests, checked: one per prompt, each with n choices.

    Attributes:
        response_id: the OpenAI response id (`<prefix>-<uuid7 hex>`); one prompt runs under it, several
            under `<response_id>-<prompt index>`.
        prompts: each prompt's token ids (non-empty, inside the vocabulary and the context).
        params: each prompt's sampling params, validated (max_tokens set: its output budget).
    """

    response_id: str
    prompts: list[list[int]]
    params: list[ValidatedSamplingParams]

    def stream(self, ctx: ServingContext, tenant: str, opening: RequestOpening) -> MergedStream:
        """Run every engine request; their snapshots merged as (prompt index, output)."""
        ids = [self.response_id] if len(self.prompts) == 1 else [
            f"{self.response_id}-{i}" for i in range(len(self.prompts))]
        return merge_streams([ctx.generate(prompt, params, request_id, tenant, opening.arrival, opening.priority,
                                           opening.cache_salt, opening.lora)
                              for prompt, params, request_id in zip(self.prompts, self.params, ids, strict=True)])


async def engine_requests(ctx: ServingContext, body: GenerationRequest, prompts: list[list[int]], *, limit: int,
                          requested: int | None, default: int | None, limit_param: str, prompt_name: str,
                          logprobs: int | None, prompt_logprobs: int | None,
                          grammar: StructuredOutputSpec | None, id_prefix: str) -> EngineRequests:
    """The engine requests of `prompts`, validated once.

    Args:
        limit: the longest sequence (prompt + output tokens) the tenant may run (`context_limit`).
        requested, default: the output tokens asked for (None: `default`, else all that fits).
        limit_param, prompt_name: what a context-length 400 names.
        logprobs, prompt_logprobs: the engine's counts of top logprobs (None: off).
        grammar: the output grammar, already compiled (None: free text).
        id_prefix: "chatcmpl" or "cmpl".
    Raises:
        OpenAIError (400): a prompt that leaves no room, or more tokens requested than fit.
        SamplingParamsError (400 naming the parameter): a value out of range.
    """
    budgets = [output_budget(len(ids), requested, limit, default=default, param=limit_param,
                             prompt_name=prompt_name) for ids in prompts]
    params = [sampling_params(body, max_tokens=budget, logprobs=logprobs, vocab_size=ctx.vocab_size,
                              prompt_logprobs=prompt_logprobs, structured_output=grammar) for budget in budgets]
    await resolve_bad_words_off_loop(params, ctx.tokenizer, ctx.vocab_size)
    return EngineRequests(response_id=new_request_id(id_prefix), prompts=prompts, params=params)


async def respond(request: Request, requests: EngineRequests, stream: MergedStream, *, streaming: bool,
                  events: Callable[[MergedStream], AsyncIterator[str]],
                  whole: Callable[[dict[int, RequestOutput]], dict]) -> Response:
    """The answer of a generation request: `events` as SSE (`EventStreamResponse`: an error after the 200
    becomes an error event, then `data: [DONE]`), or, once every engine request finished, `whole` of the final
    outputs (prompt index -> output) as JSON; 499 when the client left first."""
    headers = {"x-request-id": requests.response_id}
    if streaming:
        return EventStreamResponse(events(stream), request.scope.setdefault("state", {}), headers)
    try:
        finals = await collect_unless_disconnected(stream, request)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(whole(finals), headers=headers)
