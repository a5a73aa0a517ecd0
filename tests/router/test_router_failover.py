"""The router's failover before the client's first byte, against real sockets.

A replica that sends its status line and headers and then dies before its body (a process killed
between two writes) must be failed over like one that refused the connection: the client gets the
next replica's whole answer, never a 200 with a cut body. An event stream is the client's from its
headers on (its bytes are relayed as they come), so it is not retried.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from sits.runtime.router.metrics import RouterMetrics
from sits.runtime.router.proxy import Forwarder
from sits.runtime.router.replicas import ReplicaPool

GOOD_BODY = json.dumps({"object": "text_completion", "choices": [{"text": " fine"}]}).encode()


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


def _replica(answer: bytes):
    """A one-shot HTTP replica: reads a request, writes `answer` raw, closes the connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()
    return handle


def _head(content_type: str, length: int) -> bytes:
    return (f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\n"
            "connection: close\r\n\r\n").encode()


async def _forward_between(first_answer: bytes) -> tuple[object, RouterMetrics, ReplicaPool]:
    broken = await asyncio.start_server(_replica(first_answer), "127.0.0.1", 0)
    good = await asyncio.start_server(_replica(_head("application/json", len(GOOD_BODY)) + GOOD_BODY),
                                      "127.0.0.1", 0)
    urls = [f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in (broken, good)]
    async with httpx.AsyncClient(timeout=10) as client:
        pool, metrics = ReplicaPool(urls, client), RouterMetrics()
        response = await Forwarder(client, pool, metrics).forward(
            "POST", "/v1/completions", [("content-type", "application/json")], b"{}", pool.replicas, "load")
        body = getattr(response, "body", None)
        if body is None:  # a relayed stream: read it through while the replica's socket is still open
            body = b"".join([chunk async for chunk in response.body_iterator])
            await response.background()
    for server in (broken, good):
        server.close()
        await server.wait_closed()
    return (response.status_code, body), metrics, pool


def _errors(metrics: RouterMetrics, replica_url: str, kind: str) -> float:
    return metrics.registry.get_sample_value("sits_router_upstream_errors_total",
                                             {"replica": replica_url, "kind": kind}) or 0.0


def test_a_replica_dying_between_its_headers_and_its_body_is_failed_over():
    (status, body), metrics, pool = asyncio.run(_forward_between(_head("application/json", 500)))
    assert (status, body) == (200, GOOD_BODY)  # the second replica's whole answer, not a cut one
    broken, good = pool.replicas
    assert _errors(metrics, broken.url, "disconnect") == 1 and _errors(metrics, good.url, "disconnect") == 0
    assert broken.in_flight == good.in_flight == 0


def test_an_event_stream_is_the_clients_from_its_headers_and_never_retried():
    first = _head("text/event-stream", 500) + b'data: {"choices": [{"text": " half"}]}\n\n'
    (status, body), metrics, pool = asyncio.run(_forward_between(first))
    assert status == 200 and body.startswith(b'data: {"choices": [{"text": " half"}]}')  # the first replica's bytes
    broken, good = pool.replicas
    assert _errors(metrics, broken.url, "stream") == 1 and _errors(metrics, good.url, "disconnect") == 0
    assert broken.in_flight == good.in_flight == 0


def test_a_client_leaving_while_a_whole_answer_is_read_leaves_nothing_in_flight():
    async def run() -> int:
        headers_in = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(_head("application/json", 100))  # the headers, then the body never comes
            await writer.drain()
            await asyncio.sleep(30)
            writer.close()

        async def on_response(response: httpx.Response) -> None:
            headers_in.set()  # the forward task runs on until it waits for the body, then this task resumes

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with httpx.AsyncClient(timeout=30, event_hooks={"response": [on_response]}) as client:
            pool = ReplicaPool([url], client)
            forward = asyncio.ensure_future(Forwarder(client, pool, RouterMetrics()).forward(
                "POST", "/v1/completions", [], b"{}", pool.replicas, "load"))
            await headers_in.wait()
            forward.cancel()  # what Starlette does when the client disconnects
            await asyncio.gather(forward, return_exceptions=True)
        server.close()
        return pool.replicas[0].in_flight

    assert asyncio.run(run()) == 0
