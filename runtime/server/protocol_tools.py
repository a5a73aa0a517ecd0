"""The tool-calling parts of a chat request: function definitions, a named tool_choice, and the
calls an assistant message made earlier in the conversation (OpenAI's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from sits.runtime.server.protocol_base import StrictModel as _Strict
from sits.runtime.server.protocol_base import collapsed


class FunctionDefinition(_Strict):
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; a forced call always follows the schema

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are a JSON object, so the schema must describe one (as OpenAI requires)."""
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f'parameters must be a JSON schema of type "object", got type {value.get("type")!r}')
        return value


class ToolDefinition(_Strict):
    """OpenAI's `tools[i]`: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON document, as OpenAI sends it


class ToolCall(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def validated_tools(value: Any, handler: Any) -> Any:
    """A `tools` list's wrap validator: any fault inside is a 400 naming tools; two functions may
    not share a name."""
    try:
        tools = handler(value)
    except ValidationError as error:
        raise collapsed(error) from None
    names = [tool.function.name for tool in tools or ()]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"function names must be unique, {duplicates[0]!r} is given more than once")
    return tools
