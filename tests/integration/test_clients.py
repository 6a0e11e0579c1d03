"""Slow and misbehaving clients: a request's head and body are bounded in size and in time, so a
client (with a key or without one) cannot hold the API's memory or connections for as long as it
likes. Each test speaks raw HTTP/1.1 to a real server, as such a client does."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from app import apiserver
from app.api import limits
from app.api.main import create_app
from app.settings import Settings
from tests.conftest import (
    create_key,
    free_port,
    http_client,
    serving,
    wait_until_serving,
    worker_env,
)


@contextlib.asynccontextmanager
async def quick_server(settings: Settings, **overrides: Any) -> AsyncIterator[tuple[str, int]]:
    """The API served as `gpujobs serve` serves it (its uvicorn settings), with 1 s for a client's
    request head and body pauses (and `overrides`); yields (host, port)."""
    update = {"client_timeout_s": 1.0, "stream_keepalive_s": 0.3, **overrides}
    quick = settings.model_copy(update=update)
    app = create_app(quick)
    async with serving(app, http=apiserver.uvicorn_config(app, quick, "127.0.0.1", 0).http) as base:
        host, port = base.removeprefix("http://").split(":")
        yield host, int(port)


@pytest.fixture
async def server(settings: Settings) -> AsyncIterator[tuple[str, int]]:
    """`quick_server` with the other settings as they are."""
    async with quick_server(settings) as where:
        yield where


async def exchange(
    where: tuple[str, int], pieces: Iterable[bytes], *, wait_s: float = 5.0
) -> tuple[bytes, float]:
    """Send `pieces`, stop sending (the connection stays open), and read until the server closes it
    or `wait_s` passes; (what it sent, seconds from the last piece sent to its close, or inf)."""
    reader, writer = await asyncio.open_connection(*where)
    try:
        for piece in pieces:
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:  # it closed while we sent: its answer may still be there
                break
        sent_at, received = time.monotonic(), b""
        deadline = sent_at + wait_s
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                piece = await asyncio.wait_for(reader.read(1 << 16), left_s)
            except TimeoutError:
                return received, float("inf")
            except ConnectionError:
                break
            if not piece:
                break
            received += piece
        return received, time.monotonic() - sent_at
    finally:
        writer.close()


def endless_header(mb: int) -> list[bytes]:
    return [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ", *([b"a" * (1 << 20)] * mb)]


HEADS: dict[str, list[bytes]] = {
    "an endless header line": endless_header(8),
    "one large head, whole": [b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"],
    "many headers": [b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-1: y\r\n" * 30_000 + b"\r\n"],
    "an endless URL": [b"GET /healthz?" + b"a" * (4 << 20)],
}


@pytest.mark.parametrize("pieces", HEADS.values(), ids=HEADS.keys())
async def test_a_request_head_over_the_limit_is_refused_at_once(server, pieces):
    """uvicorn (httptools) kept a request's head in memory however long it grew: a client without a
    key sent a 64 MB header and the API's memory grew by 64 MB (and it waited for more), and a head
    of 30,000 headers was served."""
    received, closed_s = await exchange(server, pieces)
    assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    assert b'"detail":' in received and b"connection: close" in received.lower(), received
    assert closed_s < 1.0, (closed_s, received[-600:])


@pytest.mark.parametrize(
    "head",
    [b"GET /jobs HTTP/1.1\r\nHost: x\r\ntransfer-encoding;\r\n\r\n", b"GET /jobs HTTP/9.9 extra\r\n\r\n"],
    ids=["a header name with a ';'", "a bad request line"],
)
async def test_a_request_the_parser_cannot_read_is_answered_in_json(server, head):
    """uvicorn answered a head its parser could not read with a line of plain text, "Invalid HTTP
    request received.", where every other error is JSON saying what to fix (and the API's
    schema said nothing of a 400 on most routes: the fuzzer found it)."""
    received, closed_s = await exchange(server, [head])
    answer_head, _, body = received.partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.1 400 "), received[:300]
    assert b"content-type: application/json" in answer_head.lower(), answer_head
    assert "not a well-formed HTTP/1.1 request" in json.loads(body)["detail"]
    assert closed_s < 1.0, closed_s


async def test_a_request_head_at_the_limit_is_served(server):
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (30 << 10) + b"\r\n\r\n"
    received, _ = await exchange(server, [head, head], wait_s=0.5)  # two, one connection
    assert received.count(b"HTTP/1.1 200 OK") == 2, received[:300]


async def test_a_request_head_that_does_not_arrive_in_time_is_dropped(server):
    """A head sent slowly, or not at all, held its connection (an open socket, a descriptor) for
    ever: nothing timed out before the head was whole (slowloris)."""
    started = time.monotonic()
    answers = await asyncio.gather(
        exchange(server, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"]),  # a head that stops
        exchange(server, []),  # a connection that says nothing
        exchange(server, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /healthz HTTP/1.1\r\n"]),
    )
    (partial, partial_s), (silent, silent_s), (second, second_s) = answers
    assert partial.startswith(b"HTTP/1.1 408 ") and b"connection: close" in partial.lower(), partial
    assert silent == b"", silent
    assert second.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in second, second
    assert max(partial_s, silent_s, second_s) < 3.0, answers
    assert time.monotonic() - started < 4.0


async def test_a_long_response_is_not_cut_by_the_head_timeout(server, settings, png):
    """The deadline is the head's: a stream that runs longer than it goes on."""
    assert settings.database_url
    key = await create_key(settings.database_url, "alice")
    async with http_client(f"http://{server[0]}:{server[1]}", key) as http:
        job = await http.post("/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "toy"})
        assert job.status_code == 201, job.text
        lines: list[str] = []
        started = time.monotonic()
        async with http.stream("GET", f"/jobs/{job.json()['id']}/stream") as stream:
            async for line in stream.aiter_lines():  # a keepalive every 0.3 s
                lines.append(line)
                if time.monotonic() - started > 2.5:
                    break
        assert time.monotonic() - started > 2.5, lines
        cancel = await http.post(f"/jobs/{job.json()['id']}/cancel")
    assert cancel.status_code == 200, cancel.text
    assert any(line.startswith("data:") for line in lines), lines


def _upload_head(key: str, length: int) -> bytes:
    return (
        f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


PART = b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_upload_that_stalls_is_answered_408_and_let_go(server, settings, chunked):
    """A client that stopped sending mid-upload (its network gone, or on purpose) held its
    connection, and the part of the upload it had sent in memory, for ever: 30 such uploads of
    19 MB held 580 MB of the API's memory for as long as they stayed open."""
    assert settings.database_url
    key = await create_key(settings.database_url, "alice")
    head = _upload_head(key, 1 << 20)
    body = PART + b"\0" * 1000
    if chunked:
        head = head.replace(b"Content-Length: 1048576", b"Transfer-Encoding: chunked")
        body = b"%x\r\n%s\r\n" % (len(body), body)
    received, closed_s = await exchange(server, [head, body])
    assert received.startswith(b"HTTP/1.1 408 "), received[:300]
    assert b"connection: close" in received.lower() and b"stopped sending the body" in received, received
    assert closed_s < 1.0 + limits.DRAIN_S + 1.5, closed_s  # 1 s allowed, then the bounded drain


def noisy_png(side: int = 80) -> bytes:
    """A PNG of random pixels, which does not compress: about 19 KB for a side of 80."""
    picture = Image.frombytes("RGB", (side, side), os.urandom(side * side * 3))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


MODEL_PART = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\ntoy\r\n'


async def test_a_slow_upload_that_keeps_sending_is_not_cut(settings):
    """The body's bounds are a pause and a minimum rate, not a deadline: a slow client that keeps
    sending faster than the minimum is served, however far past the grace it goes (here about 6 KB/s
    for 3 s, against 4 KB/s after a grace of 1 s)."""
    assert settings.database_url
    key = await create_key(settings.database_url, "alice")
    body = MODEL_PART + PART + noisy_png() + b"\r\n--b--\r\n"
    step = len(body) // 5 + 1

    async with quick_server(settings, upload_min_kb_per_s=4) as where:
        reader, writer = await asyncio.open_connection(*where)
        try:
            writer.write(_upload_head(key, len(body)))
            for start in range(0, len(body), step):
                writer.write(body[start : start + step])
                await writer.drain()
                await asyncio.sleep(0.6)  # each pause under the 1 s allowed
            answer = await asyncio.wait_for(reader.read(1 << 16), 5)
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]


async def first_answer(
    where: tuple[str, int], head: bytes, *, drip_s: float | None = None, wait_s: float = 6.0
) -> tuple[bytes, float]:
    """Send `head`, then (with `drip_s`) one byte every `drip_s` seconds, and read the first piece of
    the answer; (that piece, or b"" if none came in `wait_s`, seconds from `head` to it)."""
    reader, writer = await asyncio.open_connection(*where)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            while drip_s is not None:
                await asyncio.sleep(drip_s)
                writer.write(b"\0")
                await writer.drain()

    writer.write(head)
    sent_at = time.monotonic()
    dripping = asyncio.create_task(drip())
    try:
        answer = await asyncio.wait_for(reader.read(1 << 16), wait_s)
    except TimeoutError:
        answer = b""
    finally:
        dripping.cancel()
        writer.close()
    return answer, time.monotonic() - sent_at


async def test_an_upload_dripped_under_the_pause_limit_is_cut_by_the_minimum_rate(server, settings):
    """A client that sent a byte just before each pause ran out (one every 29 s under
    GPUJOBS_CLIENT_TIMEOUT_S=30) kept its upload open as long as it liked: days for a 19 MB body,
    with its connection and what it had sent held in the API. A body must now also average
    GPUJOBS_UPLOAD_MIN_KB_PER_S (8 KB/s) after a grace of GPUJOBS_CLIENT_TIMEOUT_S (here 1 s)."""
    assert settings.database_url
    key = await create_key(settings.database_url, "alice")
    answer, answered_s = await first_answer(server, _upload_head(key, 1 << 20) + PART, drip_s=0.4)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"connection: close" in answer.lower() and b"GPUJOBS_UPLOAD_MIN_KB_PER_S" in answer, answer
    assert answered_s < 2.5, answered_s  # the grace (1 s) and the few bytes' worth at 8 KB/s


async def test_uploads_in_flight_of_one_key_are_capped_before_the_body_is_read(settings, png):
    """Nothing capped the uploads one principal had in flight at once: each held a connection, a
    buffer growing with what it had sent, and once whole its turn at the database. Past
    GPUJOBS_UPLOADS_PER_KEY (here 2) an upload is answered 429 with Retry-After at once, before its
    body is read; another key's upload is served, and a slot frees when its upload ends."""
    assert settings.database_url
    alice = await create_key(settings.database_url, "alice")
    bob = await create_key(settings.database_url, "bob")
    async with quick_server(settings, client_timeout_s=10, uploads_per_key=2) as where:
        held = [await asyncio.open_connection(*where) for _ in range(2)]
        for _, writer in held:  # two uploads of alice's that have begun their bodies
            writer.write(_upload_head(alice, 1 << 20) + PART)
            await writer.drain()
        await asyncio.sleep(0.3)
        answer, answered_s = await first_answer(where, _upload_head(alice, 1 << 20), wait_s=3)
        assert answer.startswith(b"HTTP/1.1 429 "), answer[:300]
        assert b"retry-after: " in answer.lower() and b"GPUJOBS_UPLOADS_PER_KEY" in answer, answer
        assert answered_s < 1.0, answered_s  # at once: no body was sent
        files = {"image": ("a.png", png(), "image/png")}
        async with http_client(f"http://{where[0]}:{where[1]}", bob) as http:
            assert (await http.post("/jobs", files=files, data={"model": "toy"})).status_code == 201
        for _, writer in held:
            writer.close()
        async with http_client(f"http://{where[0]}:{where[1]}", alice) as http:
            for _ in range(30):  # the server sees the held uploads go
                again = await http.post("/jobs", files=files, data={"model": "toy"})
                if again.status_code != 429:
                    break
                await asyncio.sleep(0.1)
    assert again.status_code == 201, again.text


def _few_open_files() -> None:
    """A soft limit of 1024 open files, as systemd gives a service (and Docker a container)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))


@pytest.fixture
def few_files_server(settings: Settings, tmp_path: Path) -> Iterator[int]:
    """`gpujobs serve --no-worker` started under a soft limit of 1024 open files; yields its port."""
    port = free_port()
    env = worker_env(settings, "serve", link_secret=settings.link_secret, log_level="WARNING")
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--no-worker", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_few_open_files,
        )
    try:
        wait_until_serving(process, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


async def test_serve_uses_the_open_files_its_hard_limit_allows(few_files_server):
    """Under the usual soft limit of 1024 open files, a thousand connections (event streams of one
    key, or heads sent slowly by anyone) left the API unable to accept another: every request
    hung, /healthz included, though the hard limit allowed more."""
    held = []
    try:
        for _ in range(1100):  # each holds a descriptor until its head's time is up (30 s)
            _, writer = await asyncio.open_connection("127.0.0.1", few_files_server)
            writer.write(b"GET /healthz HTTP/1.1\r\n")
            held.append(writer)
        async with http_client(f"http://127.0.0.1:{few_files_server}") as http:
            answer = await asyncio.wait_for(http.get("/healthz"), 10)
        assert answer.status_code == 200, answer.text
    finally:
        for writer in held:
            writer.close()


async def test_an_oversized_head_behind_a_running_response_does_not_land_inside_it(server, settings, png):
    """A client may send its next request while the last one's response still runs (pipelining).
    A next head over the limit was answered 431 at once, written into the middle of that response
    (an event stream): its client read the status line as stream data. The connection is closed
    instead, the response cut where it was."""
    assert settings.database_url
    key = await create_key(settings.database_url, "alice")
    async with http_client(f"http://{server[0]}:{server[1]}", key) as http:
        job = await http.post("/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "toy"})
        assert job.status_code == 201, job.text
        reader, writer = await asyncio.open_connection(*server)
        try:
            writer.write(f"GET /jobs/{job.json()['id']}/stream HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {key}\r\n\r\n".encode())  # fmt: skip
            received = await reader.readuntil(b"\r\n\r\n")  # the stream's head: it runs
            writer.write(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 100_000)
            async with asyncio.timeout(2):  # closed at once (the stream's keepalives come every 0.3 s)
                while piece := await reader.read(1 << 16):
                    received += piece
        finally:
            writer.close()
        await http.post(f"/jobs/{job.json()['id']}/cancel")
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]
    assert b"HTTP/1.1 431" not in received, received[-400:]
