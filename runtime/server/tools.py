"""Tool calling on /v1/chat/completions, as vLLM serves it.

`tool_choice` decides how a completion becomes tool calls:
- "none": plain text (the tools are still rendered into the prompt, as OpenAI does);
- a named function: the output is constrained to that function's parameters schema and is the
  arguments of one call;
- "required": the output is constrained to `[{"name": <a tool>, "parameters": <its schema>}, ...]`
  (one or more items; vLLM's shape) and each item is a call;
- "auto": the model decides; a tool-call parser (`--tool-call-parser`) reads its calls out of
  the text. Without one "auto" is a 400, as in vLLM.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from sits.runtime.engine.request import StructuredOutputSpec
from sits.runtime.engine.structured_output import json_schema_spec
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.hermes import HermesParser, ParsedCall, parse_hermes
from sits.runtime.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition

ToolMode = Literal["none", "named", "required", "auto"]
EMPTY_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}}


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    """A function's arguments schema; a function without parameters takes an empty object."""
    return tool.function.parameters or EMPTY_ARGUMENTS_SCHEMA


def required_schema(tools: list[ToolDefinition]) -> dict[str, Any]:
    """An array of one or more calls, each the name of one tool with arguments valid for it."""
    variants = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                "parameters": arguments_schema(tool)},
                 "required": ["name", "parameters"]} for tool in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's completions become messages: the mode, its grammar, its parser."""

    mode: ToolMode
    name: str | None = None  # the function of a named tool_choice
    schema: dict[str, Any] | None = None  # what the output is constrained to (named, required)

    def structured_output(self) -> StructuredOutputSpec | None:
        return None if self.schema is None else json_schema_spec(self.schema)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole completion and its finish_reason."""
        calls: list[ParsedCall] = []
        content: str | None = text
        if self.mode == "named":
            calls, content = [ParsedCall(self.name or "", text)], None
        elif self.mode == "required":
            calls = parse_required(text) or []
            content = None if calls else text
        elif self.mode == "auto":
            content, calls = parse_hermes(text)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [openai_call(call) for call in calls]
        return message, calls_finish(finish_reason, bool(calls), self.mode)

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self)


def plan_tool_calls(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; "auto" without a parser configured is a 400 that says how to enable it."""
    choice = body.effective_tool_choice
    tools = body.tools or []
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)  # checked by the protocol
        return ToolPlan("named", tool.function.name, arguments_schema(tool))
    if choice == "required":
        return ToolPlan("required", schema=required_schema(tools))
    if choice == "auto" and tools:
        if tool_call_parser is None:
            raise invalid_request(
                '"auto" tool choice requires the server to be started with --enable-auto-tool-choice and '
                '--tool-call-parser (e.g. hermes); send tool_choice "required", "none" or a named function instead',
                "tool_choice" if body.tool_choice is not None else "tools")
        return ToolPlan("auto")
    return ToolPlan("none")


def parse_required(text: str) -> list[ParsedCall] | None:
    """The calls of a "required" completion, or None when it is not the complete array."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


def openai_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": new_tool_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def calls_finish(finish_reason: str | None, called: bool, mode: ToolMode) -> str | None:
    """"tool_calls" when the completion ended by itself with calls; "length" and "abort" stay.

    A named tool_choice ends with "stop", as OpenAI answers it (and vLLM since it aligned with
    OpenAI): the client forced that call, so the call is the ordinary end of the turn.
    """
    if not called or finish_reason != "stop" or mode == "named":
        return finish_reason
    return "tool_calls"


class ToolCallStream:
    """One choice's stream: text deltas in, OpenAI chat deltas out (content or tool_calls fragments).

    A call opens with a delta carrying its index, id, type and name (arguments ""), then its
    arguments follow in fragments: as generated for a named call, whole once parsed otherwise.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls = 0
        self._text: list[str] = []
        self._hermes = HermesParser() if plan.mode == "auto" else None

    def feed(self, text_delta: str) -> list[dict[str, Any]]:
        mode = self.plan.mode
        if mode == "none":
            return [{"content": text_delta}] if text_delta else []
        if mode == "named":
            deltas = [] if self.calls else self._open_call(self.plan.name or "")
            return deltas + ([self._arguments(text_delta)] if text_delta else [])
        if mode == "required":
            self._text.append(text_delta)
            return []
        return self._events(self._hermes.feed(text_delta))

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the choice ends (a "required" completion's calls, a held tag)."""
        if self.plan.mode == "auto":
            return self._events(self._hermes.finish())
        if self.plan.mode == "required":
            text = "".join(self._text)
            calls = parse_required(text)
            if calls is None:
                return [{"content": text}] if text else []
            return self._events(calls)
        if self.plan.mode == "named" and not self.calls:
            return self._open_call(self.plan.name or "")
        return []

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return calls_finish(finish_reason, self.calls > 0, self.plan.mode)

    def _events(self, events: list[str | ParsedCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                deltas.append({"content": event})
            else:
                deltas += self._open_call(event.name) + [self._arguments(event.arguments)]
        return deltas

    def _open_call(self, name: str) -> list[dict[str, Any]]:
        self.calls += 1
        return [{"tool_calls": [{"index": self.calls - 1, "id": new_tool_call_id(), "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _arguments(self, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": fragment}}]}
