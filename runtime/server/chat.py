"""POST /v1/chat/completions: the conversation through the model's chat template, streamed or whole."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sits.runtime.engine.request import RequestOutput, StructuredOutputSpec
from sits.runtime.engine.structured_output import StructuredOutputError
from sits.runtime.server.chat_render import template_message
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.input_limits import context_length_error
from sits.runtime.server.input_processor import MergedStream, engine_requests, open_request, respond
from sits.runtime.server.logprobs import LogprobFormatter
from sits.runtime.server.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from sits.runtime.server.protocol_chat import ChatTemplateOptions
from sits.runtime.server.responses import finish_text, sse, usage
from sits.runtime.server.sampling import compile_output_constraint, structured_output
from sits.runtime.server.serving import ClientGone, ServingContext
from sits.runtime.server.stream_usage import running_usage, wants_continuous_usage
from sits.runtime.server.tools import ToolPlan, plan_tool_calls


class ChatCompletions:
    """Renders messages with the tokenizer's chat template and runs one engine request (n choices).

    `tool_call_parser` (e.g. "hermes"): reads the calls of tool_choice "auto" out of the text;
    None refuses "auto", as vLLM does without --enable-auto-tool-choice.
    """

    def __init__(self, ctx: ServingContext, tool_call_parser: str | None = None) -> None:
        self.ctx = ctx
        self.logprobs = LogprobFormatter(ctx.tokenizer)
        self.tool_call_parser = tool_call_parser

    async def prompt_token_ids(self, messages: list[ChatMessage], options: ChatTemplateOptions, *,
                               add_special_tokens: bool = False,
                               tools: list[ToolDefinition] | None = None) -> list[int]:
        """The prompt exactly as transformers' apply_chat_template renders it with the same options
        (add_generation_prompt, continue_final_message, documents, chat_template_kwargs).

        /tokenize renders through here too, so its count is the chat endpoint's prompt.
        `tools` reach the template as HF's `tools` variable (rendered if the template knows how).
        """
        options.check_rendering()
        self._check_size(messages, tools, options)
        conversation = [template_message(message) for message in messages]
        tool_specs = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        # ChatTemplateError (the template rejected the conversation) is a 400 naming `messages`.
        text = self.ctx.tokenizer.apply_chat_template(conversation, tools=tool_specs, **options.template_variables())
        return await self.ctx.encode(text, add_special_tokens=add_special_tokens, param="messages", name="messages")

    def _check_size(self, messages: list[ChatMessage], tools: list[ToolDefinition] | None = None,
                    options: ChatTemplateOptions | None = None) -> None:
        """400 before rendering a conversation that cannot fit the context (or is not valid Unicode).

        Every rendered message costs at least one token (its role markers), and the texts' lengths
        are bounded by `ServingContext.max_prompt_chars`: both without the work of rendering.
        """
        limit = self.ctx.max_model_len
        if len(messages) >= limit:
            raise context_length_error(limit, f"your messages are {len(messages)} messages, which leave no room "
                                       "to generate", "send fewer messages", "messages")
        texts = [m.text() + (m.name or "") + "".join(c.function.arguments for c in m.tool_calls or ())
                 for m in messages]
        texts += [json.dumps(tool.model_dump(exclude_none=True)) for tool in tools or ()]
        if options is not None and (options.documents or options.chat_template_kwargs):
            texts.append(json.dumps([options.documents, options.chat_template_kwargs], default=str))
        self.ctx.check_text("".join(texts), "messages", "messages")

    async def __call__(self, body: ChatCompletionRequest, tenant: str, request: Request) -> Response:
        opening = open_request(self.ctx, body, request)
        tool_plan = plan_tool_calls(body, self.tool_call_parser)
        try:  # before any admission slot: a slow compile must not hold capacity others need
            grammar = await self._compile_output_grammar(body, tool_plan, tenant, request)
        except ClientGone:
            return Response(status_code=499)
        self.ctx.admit(request, body.n)  # 503 when the server is full, before any work for it
        prompt_ids = await self.prompt_token_ids(body.messages, body, add_special_tokens=body.add_special_tokens,
                                                 tools=body.tools)
        limit = self.ctx.context_limit(tenant)
        prompt_ids = body.truncated(prompt_ids, room=limit - (body.output_limit or 1))
        requests = await engine_requests(
            self.ctx, body, [prompt_ids], limit=limit, requested=body.output_limit, default=None,
            limit_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            prompt_name="messages", logprobs=body.num_logprobs, prompt_logprobs=body.prompt_logprobs,
            grammar=grammar, id_prefix="chatcmpl")
        head = {"id": requests.response_id, "created": int(time.time()), "model": opening.lora or self.ctx.model_name}
        echo = echo_text(body)
        return await respond(request, requests, requests.stream(self.ctx, tenant, opening), streaming=body.stream,
                             events=lambda stream: self._events(stream, head, body, tool_plan, echo),
                             whole=lambda finals: self._completion(finals[0], head, body, tool_plan, echo))

    async def _compile_output_grammar(self, body: ChatCompletionRequest, tool_plan: ToolPlan, tenant: str,
                                      request: Request) -> StructuredOutputSpec | None:
        """The output grammar (response_format's, structured_outputs', or a forced tool call's: a
        schema xgrammar refuses is then a 400 naming tools), compiled into the engine's cache."""
        grammar = structured_output(body)  # 400s for a constraint combined with a forced call
        tool_grammar = tool_plan.structured_output()
        if tool_grammar is None:
            await compile_output_constraint(request, grammar, tenant)
            return grammar
        try:
            await compile_output_constraint(request, tool_grammar, tenant)
        except StructuredOutputError as error:
            message = str(error).replace("response_format.json_schema.schema", "the function's parameters")
            raise invalid_request(f"the parameters schema of the tools cannot be enforced: {message}",
                                  "tools") from None
        return tool_grammar

    def _completion(self, final: RequestOutput, head: dict[str, Any], body: ChatCompletionRequest,
                    tool_plan: ToolPlan, echo: str) -> dict:
        choices = []
        for choice in sorted(final.outputs, key=lambda c: c.index):
            logprobs = None
            if body.num_logprobs is not None:
                logprobs = self.logprobs.chat(choice.logprobs or [], body.num_logprobs)
            message, finish = tool_plan.message(choice.text, finish_text(choice.finish_reason))
            if echo and message.get("content") is not None:
                message["content"] = echo + message["content"]
            choices.append({"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        response = {**head, "object": "chat.completion", "choices": choices, "system_fingerprint": None,
                    "usage": usage([final])}
        if body.prompt_logprobs is not None:  # vLLM's extension, beside the choices
            response["prompt_logprobs"] = self.logprobs.vllm_prompt(final.prompt_logprobs or [])
        return response

    async def _events(self, stream: MergedStream, head: dict[str, Any], body: ChatCompletionRequest,
                      tool_plan: ToolPlan, echo: str) -> AsyncIterator[str]:
        """The SSE chunks of a streamed chat completion, those of one engine output joined in one string (one
        write); `EventStreamResponse` adds the error event and DONE."""
        chunk_head = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
        continuous = wants_continuous_usage(body.stream_options)
        if body.include_usage or continuous:
            chunk_head["usage"] = None
        started: set[int] = set()
        finished: set[int] = set()
        tool_streams: dict[int, Any] = {}  # choice index -> ToolCallStream (content or tool-call deltas)
        last: RequestOutput | None = None
        async with contextlib.aclosing(stream):
            async for _, output in stream:
                last = output
                chunks: list[str] = []
                for choice in output.outputs:
                    if choice.index not in finished:
                        self._choice_chunks(chunks, output, choice, chunk_head, body, continuous, echo,
                                            (started, finished, tool_streams, tool_plan))
                if chunks:
                    yield "".join(chunks)
        if body.include_usage and last is not None:
            yield sse({**chunk_head, "choices": [], "usage": usage([last])})

    def _choice_chunks(self, chunks: list[str], output: RequestOutput, choice: Any, chunk_head: dict[str, Any],
                       body: ChatCompletionRequest, continuous: bool, echo: str,
                       progress: tuple[set[int], set[int], dict[int, Any], ToolPlan]) -> None:
        """Append to `chunks` those of one choice's delta: the opening (role, echo) the first time, the content
        or tool-call deltas with their logprobs, and the finish chunk at the end."""
        started, finished, tool_streams, tool_plan = progress
        head_of = chunk_head
        if continuous:  # this choice's token counts so far in each of its chunks
            head_of = {**chunk_head, "usage": running_usage(output, choice)}
        if choice.index not in started:
            started.add(choice.index)
            tool_streams[choice.index] = tool_plan.streamer()
            opening = chunk_head if not continuous else {
                **chunk_head, "usage": running_usage(output, choice, before_delta=True)}
            chunks.append(self._chunk(opening, choice.index, {"role": "assistant", "content": ""}))
            if echo:
                chunks.append(self._chunk(opening, choice.index, {"content": echo}))
        tool_stream = tool_streams[choice.index]
        if choice.text_delta or choice.logprobs_delta:
            logprobs = None
            if body.num_logprobs is not None:
                logprobs = self.logprobs.chat(choice.logprobs_delta or [], body.num_logprobs)
            # a token's logprobs go out even while its text is held (a split tag)
            deltas = tool_stream.feed(choice.text_delta) or [{"content": ""}]
            for position, delta in enumerate(deltas):
                if delta == {"content": ""} and logprobs is None:
                    continue
                chunks.append(self._chunk(head_of, choice.index, delta, logprobs=logprobs if position == 0 else None))
        if choice.finished:
            finished.add(choice.index)
            for delta in tool_stream.finish():
                chunks.append(self._chunk(head_of, choice.index, delta))
            chunks.append(self._chunk(head_of, choice.index, {},
                                      finish=tool_stream.finish_reason(finish_text(choice.finish_reason))))

    @staticmethod
    def _chunk(chunk_head: dict[str, Any], index: int, delta: dict[str, Any], *, logprobs: Any = None,
               finish: str | None = None) -> str:
        return sse({**chunk_head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish}]})



def echo_text(body: ChatCompletionRequest) -> str:
    """What vLLM's chat `echo` puts before the reply: the last message's text when the reply
    continues its role (an assistant message, e.g. with continue_final_message), else nothing."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""
