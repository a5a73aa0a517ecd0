"""The hermes tool-call format (Hermes, Qwen2.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

One incremental parser serves both a whole completion and a stream, so both read the same text
the same way: text outside the tags is content, each well-formed block is a call, and a block
whose JSON is malformed stays in the content as the model wrote it. Whitespace around calls
(the newlines models put around blocks) is dropped when calls are made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as a JSON document."""

    name: str
    arguments: str


def parse_call(body: str) -> ParsedCall | None:
    """The call in one block's JSON, or None when it is not `{"name": str, "arguments": ...}`."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict) or not isinstance(document.get("name"), str) or not document["name"]:
        return None
    arguments = document.get("arguments", document.get("parameters", {}))
    if not isinstance(arguments, str):  # a model may already write the arguments as a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(document["name"], arguments)


class HermesParser:
    """Feed text as it is generated; get back content strings and ParsedCalls, in order.

    Text that could still become `<tool_call>` (a split tag) is held until the next delta decides.
    """

    def __init__(self) -> None:
        self._buffer = ""  # text not yet classified
        self._inside = False  # between <tool_call> and </tool_call>
        self._pending_space = ""  # whitespace outside blocks, held until we know whether calls follow
        self.calls_made = 0
        self._has_content = False  # content other than whitespace went out

    def feed(self, delta: str) -> list[str | ParsedCall]:
        self._buffer += delta
        events: list[str | ParsedCall] = []
        while True:
            if not self._inside:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    held = _partial_tag_length(self._buffer, TOOL_CALL_OPEN)
                    self._outside(self._buffer[:len(self._buffer) - held], events)
                    self._buffer = self._buffer[len(self._buffer) - held:]
                    return events
                self._outside(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside = True
            else:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return events
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                self._block(body, TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, events)

    def finish(self) -> list[str | ParsedCall]:
        """The end of the text: an unclosed block is a call if its JSON is complete, else content."""
        events: list[str | ParsedCall] = []
        if self._inside:
            self._block(self._buffer, TOOL_CALL_OPEN + self._buffer, events)
        else:
            self._outside(self._buffer, events)
        self._buffer, self._inside = "", False
        if self._pending_space and not self.calls_made:
            events.append(self._pending_space)
        self._pending_space = ""
        return events

    def _outside(self, text: str, events: list[str | ParsedCall]) -> None:
        """Content; whitespace is held while it may only separate calls (before any text, after a call)."""
        text = self._pending_space + text
        if text.strip() or (text and self._has_content and not self.calls_made):
            events.append(text)
            self._pending_space = ""
            self._has_content = True
        else:
            self._pending_space = text

    def _block(self, body: str, raw: str, events: list[str | ParsedCall]) -> None:
        call = parse_call(body)
        if call is None:
            self._outside(raw, events)
            return
        self._pending_space = ""
        self.calls_made += 1
        events.append(call)


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole completion: its content (None when only calls and whitespace) and its calls."""
    parser = HermesParser()
    events = parser.feed(text) + parser.finish()
    calls = [event for event in events if isinstance(event, ParsedCall)]
    content = "".join(event for event in events if isinstance(event, str))
    if calls and not content.strip():
        return None, calls
    return content, calls


def _partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of text begin `tag` (0 when none do)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
