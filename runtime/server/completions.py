"""POST /v1/completions: raw prompts (text, token ids, or a batch of either), streamed or whole.

Each prompt of a batch is its own engine request; choice `index` is `prompt_index * n + i`, as in
OpenAI's API.

`echo` (OpenAI's legacy semantics, as vLLM serves them): a choice's text is the prompt's text then
the completion; with `logprobs` its logprobs cover the prompt's tokens (the first with null
logprob and top_logprobs) then the generated ones, and a stream's first chunk of each choice
carries the prompt. `max_tokens: 0` with echo returns the prompt and its logprobs alone
(finish_reason "length", 0 completion tokens): the engine runs the prompt and generates one token
that is dropped, as vLLM does. vLLM's `prompt_logprobs` adds each choice's `prompt_logprobs`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sits.runtime.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from sits.runtime.server.input_processor import MergedStream, engine_requests, open_request, respond
from sits.runtime.server.logprobs import LogprobFormatter
from sits.runtime.server.protocol import CompletionRequest
from sits.runtime.server.responses import finish_text, sse, usage
from sits.runtime.server.sampling import compile_output_constraint, structured_output
from sits.runtime.server.serving import ClientGone, ServingContext
from sits.runtime.server.stream_usage import running_usage, wants_continuous_usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Completions:
    """Tokenizes each prompt and runs one engine request per prompt (n choices each)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.logprobs = LogprobFormatter(ctx.tokenizer)

    async def prompt_token_ids(self, body: CompletionRequest, room: int) -> list[list[int]]:
        """Each prompt's token ids, cut to its last tokens under truncate_prompt_tokens (`room`: the
        most a prompt may keep with -1, the context minus the tokens to generate)."""
        prompts = body.prompts()
        param = "prompt"
        for prompt in prompts:  # every prompt checked before any is tokenized
            if isinstance(prompt, str):
                self.ctx.check_text(prompt, param)
            else:
                self.ctx.check_token_ids(body.truncated(prompt, room), param)
        result = []
        for prompt in prompts:
            if isinstance(prompt, str):
                token_ids = await self.ctx.encode(prompt, add_special_tokens=True, param=param)
            else:
                token_ids = prompt
            result.append(self.ctx.check_token_ids(body.truncated(token_ids, room), param))
        return result

    async def __call__(self, body: CompletionRequest, tenant: str, request: Request) -> Response:
        opening = open_request(self.ctx, body, request)
        grammar = structured_output(body)
        try:  # before any admission slot: a slow compile must not hold capacity others need
            await compile_output_constraint(request, grammar, tenant)
        except ClientGone:
            return Response(status_code=499)
        # n choices of each prompt: 503 when the server is full, 400 when it could never fit
        self.ctx.admit(request, body.n * len(body.prompts()), param="n" if body.n > 1 else "prompt")
        limit = self.ctx.context_limit(tenant)
        requested = 1 if body.echo_only else body.max_tokens  # echo alone: one token run and dropped
        prompts = await self.prompt_token_ids(body, room=limit - (requested or DEFAULT_MAX_TOKENS))
        requests = await engine_requests(
            self.ctx, body, prompts, limit=limit, requested=requested, default=DEFAULT_MAX_TOKENS,
            limit_param="max_tokens", prompt_name="prompt", logprobs=body.logprobs,
            prompt_logprobs=body.engine_prompt_logprobs, grammar=grammar, id_prefix="cmpl")
        echoes = [self._prompt_text(prompt, ids, body.truncate_prompt_tokens is not None)
                  for prompt, ids in zip(body.prompts(), prompts, strict=True)] if body.echo else []
        head = {"id": requests.response_id, "object": "text_completion", "created": int(time.time()),
                "model": opening.lora or self.ctx.model_name}
        return await respond(request, requests, requests.stream(self.ctx, tenant, opening), streaming=body.stream,
                             events=lambda stream: self._events(stream, head, body, echoes, len(prompts)),
                             whole=lambda finals: self._completion([finals[i] for i in range(len(prompts))], head,
                                                                   body, echoes))

    def _prompt_text(self, prompt: str | list[int], token_ids: list[int], truncated: bool) -> str:
        """What echo returns of a prompt: its text as sent, or the text of the token ids the model
        read (special tokens kept): ids sent, or a prompt cut by truncate_prompt_tokens."""
        if isinstance(prompt, str) and not truncated:
            return prompt
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _choice(self, prompt_index: int, n: int, choice: CompletionOutput, text: str, logprobs: Any,
                finish: str | None) -> dict[str, Any]:
        return {"index": prompt_index * n + choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish}

    def _echoed(self, body: CompletionRequest, final: RequestOutput, generated: list[TokenLogprob] | None
                ) -> dict[str, Any] | None:
        """The legacy logprobs of the prompt (when echoed) followed by the generated tokens'."""
        if body.logprobs is None:
            return None
        if not body.echo:
            return self.logprobs.completion(generated or [], body.logprobs)
        prompt = self.logprobs.echoed_prompt(final.prompt_token_ids, final.prompt_logprobs or [], body.logprobs)
        if body.echo_only:
            return prompt
        rest = self.logprobs.completion(generated or [], body.logprobs, self.logprobs.end_offset(prompt))
        return self.logprobs.joined(prompt, rest)

    def _completion(self, finals: list[RequestOutput], head: dict[str, Any], body: CompletionRequest,
                    echoes: list[str]) -> dict:
        choices = []
        for prompt_index, final in enumerate(finals):
            for choice in sorted(final.outputs, key=lambda c: c.index):
                text, finish = choice.text, finish_text(choice.finish_reason)
                if body.echo:
                    text, finish = (echoes[prompt_index], "length") if body.echo_only else (
                        echoes[prompt_index] + text, finish)
                part = self._choice(prompt_index, body.n, choice, text, self._echoed(body, final, choice.logprobs),
                                    finish)
                if body.prompt_logprobs is not None:
                    part["prompt_logprobs"] = self.logprobs.vllm_prompt(final.prompt_logprobs or [])
                choices.append(part)
        return {**head, "choices": choices, "system_fingerprint": None, "usage": self._usage(finals, body)}

    @staticmethod
    def _usage(finals: Iterable[RequestOutput], body: CompletionRequest) -> dict[str, Any]:
        counts = usage(finals)
        if body.echo_only:  # the one token the engine ran is dropped
            counts["completion_tokens"], counts["total_tokens"] = 0, counts["prompt_tokens"]
        return counts

    async def _events(self, stream: MergedStream, head: dict[str, Any], body: CompletionRequest,
                      echoes: list[str], num_prompts: int) -> AsyncIterator[str]:
        """The SSE chunks of a streamed completion, those of one engine output joined in one string (one write);
        `EventStreamResponse` adds the error event and DONE."""
        chunk_head = {**head, "system_fingerprint": None}
        continuous = wants_continuous_usage(body.stream_options)
        if body.include_usage or continuous:
            chunk_head["usage"] = None
        finished: set[tuple[int, int]] = set()
        text_offsets: dict[tuple[int, int], int] = {}
        last: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(stream):
            async for prompt_index, output in stream:
                last[prompt_index] = output
                chunks: list[str] = []
                for choice in output.outputs:
                    key = (prompt_index, choice.index)
                    first = body.echo and key not in text_offsets  # the chunk that echoes the prompt
                    if key in finished or not (first or choice.text_delta or choice.logprobs_delta
                                               or choice.finished):
                        continue
                    text, finish = choice.text_delta, finish_text(choice.finish_reason)
                    if body.echo_only:
                        text, finish = "", "length" if choice.finished else None
                    logprobs = None
                    if first:
                        text = echoes[prompt_index] + text
                        logprobs = self._echoed(body, output, choice.logprobs_delta)
                    elif body.logprobs is not None and not body.echo_only:
                        logprobs = self.logprobs.completion(choice.logprobs_delta or [], body.logprobs,
                                                            text_offsets.get(key, 0))
                    start = text_offsets.get(key, 0)  # offsets of an echo's first chunk start at 0
                    text_offsets[key] = start + sum(len(t) for t in logprobs["tokens"]) if logprobs else start
                    if choice.finished:
                        finished.add(key)
                    part = self._choice(prompt_index, body.n, choice, text, logprobs, finish)
                    chunk = {**chunk_head, "choices": [part]}
                    if continuous:  # this choice's token counts so far
                        chunk["usage"] = counts = running_usage(output, choice)
                        if body.echo_only:  # the one token the engine ran is dropped, as in _usage
                            counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
                    chunks.append(sse(chunk))
                if chunks:
                    yield "".join(chunks)
        if body.include_usage and len(last) == num_prompts:
            yield sse({**chunk_head, "choices": [], "usage": self._usage((last[i] for i in range(num_prompts)),
                                                                           body)})
