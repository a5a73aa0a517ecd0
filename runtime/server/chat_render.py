"""Chat messages as HF chat templates read them: torch-free, so `sits router` renders a prompt
exactly as the replicas do (and hashes the same prefix blocks)."""

from __future__ import annotations

import json
from typing import Any

from sits.runtime.server.protocol import ChatMessage


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as HF chat templates read it: OpenAI's "developer" is the system prompt for
    models trained without it, and a call's arguments are an object (templates `tojson` them)."""
    entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                             "content": message.text()}
    if message.name:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": call.type,
                                "function": {"name": call.function.name,
                                             "arguments": _arguments_object(call.function.arguments)}}
                               for call in message.tool_calls]
    return entry


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text the client sent
