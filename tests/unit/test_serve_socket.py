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


async def test_a_kept_alive_connection_waits_for_the_client_timeout_not_uvicorns_five_seconds():
    """README: a connection's next request head may come up to GPUJOBS_CLIENT_TIMEOUT_S after its
    previous answer. uvicorn closed an idle kept-alive connection after its own 5 s, so a request
    sent a moment later (a proxy keeping upstream connections for 60 s does) met a closed socket."""
    import uvicorn

    from app import apiserver
    from app.settings import Settings

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    sock = serve.listen("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(apiserver.uvicorn_config(app, Settings(client_timeout_s=8), host, port))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        reader, writer = await asyncio.open_connection(host, port)  # listening: served once started
        for pause_s in (0, 6):
            await asyncio.sleep(pause_s)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            assert head.startswith(b"HTTP/1.1 200"), head
            await reader.readexactly(2)
        writer.close()
    finally:
        server.should_exit = True
        await serving
