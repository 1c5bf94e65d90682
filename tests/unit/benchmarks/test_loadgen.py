"""The load generator's HTTP client against a server that drops a connection after each streamed response."""

import asyncio
import json

from benchmarks.loadgen import Targets

EVENTS = [{"choices": [{"text": "Hi", "finish_reason": None}]}, {"choices": [], "usage": {"completion_tokens": 1}}]


async def _answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """As llama-server did under bench-peers: a chunked event stream that offers keep-alive, and a connection that
    then takes no other request (it is closed when one comes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)
    body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in EVENTS) + b"data: [DONE]\n\n"
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: timeout=5, max=100\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    )
    await writer.drain()
    await reader.read(1)
    writer.close()


async def _errors(keep_alive: bool) -> list[str | None]:
    server = await asyncio.start_server(_answer_once_then_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    targets = Targets(
        "127.0.0.1:1", "127.0.0.1:1", ["a prompt"], 1, openai=(f"http://127.0.0.1:{port}", "m"), keep_alive=keep_alive
    )
    try:
        records = []
        for i in range(4):
            records.append(await targets.openai_completion(i))
        return [r.error for r in records]
    finally:
        await targets.close()
        server.close()


def test_without_keep_alive_every_request_gets_a_connection_of_its_own():
    assert asyncio.run(_errors(keep_alive=False)) == [None] * 4


def test_a_kept_connection_the_server_dropped_fails_the_next_request():
    """Why bench-peers turns keep-alive off: this is what failed every other request to llama-server."""
    assert any(asyncio.run(_errors(keep_alive=True)))
