"""The floor under `POST /jobs`: the least a Python upload on this stack's server costs.

A bare ASGI app for uvicorn (the same server, HTTP parser and event loop as `gpujobs serve`) that
takes the bench's multipart upload, cuts the image out of the body by its boundary (no form parser,
no framework, no image check, no key check, no job), hashes it (dedup needs the hash; the reference
line hashes too) and inserts it into `inputs` with asyncpg, as the reference line does. What the
API spends above this line is the price of everything `POST /jobs` does; what this line spends above
PostgreSQL alone is the price of HTTP in Python at all.

Run by `bench_throughput --only uploads` (its "bare ASGI app" line), never on its own:
`UPLOAD_FLOOR_DSN=postgresql://... python -m uvicorn tests.bench.upload_floor:app --loop asyncio`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

# One image into `inputs`, as this app and the bench's PostgreSQL-alone line both insert it.
INSERT = "INSERT INTO inputs (sha256, media_type, width, height, bytes, data) VALUES ($1, $2, $3, $4, $5, $6)"
POOL_SIZE = 8

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Floor:
    """The app: one asyncpg pool, made at the lifespan's start."""

    def __init__(self) -> None:
        self.pool: asyncpg.Pool | None = None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._upload(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                dsn = os.environ["UPLOAD_FLOOR_DSN"]
                self.pool = await asyncpg.create_pool(dsn, min_size=POOL_SIZE, max_size=POOL_SIZE)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.pool is not None:
                    await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _upload(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["path"] == "/healthz":
            await _answer(send, 200, b"{}")
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        image = _image_part(body, _boundary(scope))
        if image is None:
            await _answer(send, 422, b'{"detail": "no image part"}')
            return
        assert self.pool is not None
        digest = hashlib.sha256(image).hexdigest()
        await self.pool.execute(INSERT, digest, "image/png", 0, 0, len(image), image)
        await _answer(send, 201, b'{"state": "stored"}')


def _boundary(scope: dict[str, Any]) -> bytes:
    """The multipart boundary from the Content-Type header (empty when there is none)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bytes(value.partition(b"boundary=")[2])
    return b""


def _image_part(body: bytes, boundary: bytes) -> memoryview | None:
    """The bytes of the body's last part (the image, in the bench's form), without a copy."""
    start = body.find(b"\x89PNG")
    head_end = body.rfind(b"\r\n\r\n", 0, start)
    tail = body.rfind(b"\r\n--" + boundary + b"--")
    if not boundary or start < 0 or head_end + 4 != start or tail < start:
        return None
    return memoryview(body)[head_end + 4 : tail]


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


app = Floor()
