"""The upload benchmark's lean HTTP/1.1 client, against a real socket server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from tests.bench import rawhttp


@asynccontextmanager
async def server(answers: list[bytes]) -> AsyncIterator[tuple[int, list[bytes], list[int]]]:
    """Answers each request (read up to its Content-Length) with the next of `answers`; yields
    (port, the request bodies received, how many connections were opened)."""
    bodies: list[bytes] = []
    opened: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(1)
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                bodies.append(await reader.readexactly(length))
                writer.write(answers.pop(0))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1], bodies, opened
    finally:
        srv.close()
        await srv.wait_closed()


def head_for(port: int, size: int) -> bytes:
    return rawhttp.request_head("POST", f"127.0.0.1:{port}", "/jobs", {"X-Test": "1"}, size)


async def test_answers_are_read_by_length_and_the_connection_is_kept() -> None:
    ok = b'HTTP/1.1 201 Created\r\ncontent-length: 7\r\ncontent-type: application/json\r\n\r\n{"a":1}'
    async with server([ok, ok]) as (port, bodies, opened):
        client = rawhttp.Connections("127.0.0.1", port)
        first = await client.send(head_for(port, 5), b"hello")
        second = await client.send(head_for(port, 3), b"abc")
        await client.close()
    assert (first.status, first.body, second.status) == (201, b'{"a":1}', 201)
    assert bodies == [b"hello", b"abc"] and len(opened) == 1


async def test_connection_close_opens_a_new_connection_next_time() -> None:
    closing = b"HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\ncontent-length: 4\r\n\r\nfull"
    ok = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"
    async with server([closing, ok]) as (port, _, opened):
        client = rawhttp.Connections("127.0.0.1", port)
        assert (await client.send(head_for(port, 1), b"x")).status == 429
        assert (await client.send(head_for(port, 1), b"y")).status == 201
        await client.close()
    assert len(opened) == 2


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", "chunked"),
        (b"HTTP/1.1 201 Created\r\ncontent-length: 10\r\n\r\nshort", "5 of 10"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    ],
)
async def test_answers_it_cannot_read_are_errors(answer: bytes, says: str) -> None:
    async with server([answer]) as (port, _, _):
        client = rawhttp.Connections("127.0.0.1", port)
        with pytest.raises(rawhttp.BadAnswer, match=says):
            await client.send(head_for(port, 1), b"x")
        await client.close()
