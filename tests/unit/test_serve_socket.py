"""The socket `gpujobs serve` listens on: its connections send small answers at once.

uvicorn writes an answer's head and its body apart. Without TCP_NODELAY, Nagle's algorithm held
the body back until the client acknowledged the head, and a client delays that acknowledgement
(about 40 ms on Linux): most requests on a kept-alive connection took 40 ms more, /healthz
included. asyncio sets TCP_NODELAY only on connections of a socket made as IPPROTO_TCP.
"""

from __future__ import annotations

import asyncio
import socket
import time

from app import serve


async def test_connections_accepted_on_the_served_socket_have_nagle_off():
    sock = serve.listen("127.0.0.1", 0)
    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def keep(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)

    server = await asyncio.start_server(keep, sock=sock)
    try:
        _, client = await asyncio.open_connection(*sock.getsockname()[:2])
        writer = await asyncio.wait_for(accepted.get(), timeout=10)
        conn = writer.get_extra_info("socket")
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
        client.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_an_answer_written_in_two_parts_arrives_without_waiting_for_an_ack():
    """What the option is for, on loopback: ten request-answer rounds on one connection, each
    answer written as a head and then a body, as uvicorn writes them."""
    sock = serve.listen("127.0.0.1", 0)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            writer.write(b"head\n")
            await writer.drain()
            writer.write(b"body\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, sock=sock)
    try:
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        took = []
        for _ in range(10):
            started = time.perf_counter()
            writer.write(b"ask\n")
            assert await reader.readline() == b"head\n"
            assert await reader.readline() == b"body\n"
            took.append(time.perf_counter() - started)
        writer.close()
        assert sorted(took)[5] < 0.030, took  # the median; delayed acks made most of them 40 ms
    finally:
        server.close()
        await server.wait_closed()
