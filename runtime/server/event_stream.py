"""The streamed answer of a generation request: server-sent events written with as little per chunk as the ASGI
server allows.

A streamed completion sends one chunk per token to each client, so what a chunk costs the API process decides how
many streams it keeps up with. `EventStreamResponse` is a raw ASGI response (no per-chunk Starlette streaming
machinery, no task group per response beyond one disconnect watcher): each string the events iterator yields
(an endpoint yields the events of one engine output joined, so a step that produces several chunks for a stream,
e.g. the last token and the finish reason, makes one write) is encoded once and sent as one ASGI body message.
The stream ends with `data: [DONE]` in the same message that ends the body (one write with httptools), preceded by
an OpenAI error event when the events raise after the 200 went out. A client that leaves cancels the events (the
engine request is then aborted by whoever holds it) and marks the request `client_gone` in its state.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sits.runtime.server.errors import as_openai_error
from sits.runtime.server.responses import DONE, SSE_HEADERS
from sits.runtime.tasks import wait_first

EVENT_STREAM_MEDIA_TYPE = "text/event-stream"


class EventStreamResponse(StreamingResponse):
    """`events` (each a string of one or more complete SSE events) as a text/event-stream response, then
    `data: [DONE]`.

    Args:
        events: the endpoint's events; closed when the response ends, however it ends.
        state: the request's state (`scope["state"]`): `client_gone` is set there when the client leaves.
        headers: extra response headers (the SSE ones, no-cache and no proxy buffering, are added).
    """

    def __init__(self, events: AsyncIterator[str], state: dict[str, Any], headers: Mapping[str, str]) -> None:
        super().__init__(events, media_type=EVENT_STREAM_MEDIA_TYPE, headers={**headers, **SSE_HEADERS})
        self._events = events
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(send))
        await wait_first(writer, asyncio.ensure_future(_until_disconnected(receive)))
        if not writer.cancelled():
            writer.result()  # a failure to send (the server's own error) propagates

    async def _write(self, send: Send) -> None:
        """Send every event as it comes, then the end (an error event first when the events raised)."""
        events = self._events
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        except asyncio.CancelledError:
            self._state["client_gone"] = True
            raise
        except Exception as error:  # after the 200 went out: report in the stream, then end it
            end = as_openai_error(error).to_sse() + DONE
        else:
            end = DONE
        await send({"type": "http.response.body", "body": end.encode(), "more_body": False})


async def _until_disconnected(receive: Receive) -> None:
    """Return when the client closes the connection (the request's body was read before the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
