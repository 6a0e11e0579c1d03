"""A lean HTTP/1.1 client for load generation: prebuilt requests over kept-alive connections.

The upload benchmark runs its clients on the same two cores as the API and PostgreSQL, so what
the clients cost is taken from the server. httpx, a complete client written in Python, cost the
bench process 3.2 to 3.6 ms of CPU per 1 MB upload, twice what asyncpg's side of the
PostgreSQL-alone reference costs. This client does what load generators such as wrk do and no
more: it writes the request's bytes as given and reads the answer's head and its Content-Length
body. No redirects, no chunked answers, no TLS; anything else is an error for the caller to count.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

HEAD_LIMIT = 64 * 1024  # the most an answer's status line and headers may take


class BadAnswer(Exception):
    """The server's answer is not one this client reads (or the connection broke mid-answer)."""


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


def request_head(method: str, host: str, path: str, headers: dict[str, str], body_bytes: int) -> bytes:
    """A request's line and headers, Content-Length included, ready to be written before its body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    lines.append(f"Content-Length: {body_bytes}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connections:
    """Kept-alive connections to one server, opened as needed, one request at a time on each."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(self, head: bytes, body: bytes) -> Answer:
        """Write `head` then `body` on an idle connection (or a new one); the answer."""
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self._host, self._port, limit=HEAD_LIMIT)
        try:
            writer.write(head)
            writer.write(body)
            await writer.drain()
            answer, keep = await _read_answer(reader)
        except BaseException:
            writer.close()
            raise
        if keep:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return answer

    async def close(self) -> None:
        """Close every idle connection."""
        for _, writer in self._idle:
            writer.close()
        await asyncio.gather(*(w.wait_closed() for _, w in self._idle), return_exceptions=True)
        self._idle.clear()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Answer, bool]:
    """(the answer, whether the connection may be used again)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise BadAnswer(f"the answer's head is cut short or too long ({exc})") from exc
    status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise BadAnswer("a chunked answer (this client reads Content-Length bodies only)")
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise BadAnswer(f"Content-Length {length!r}")
    try:
        body = await reader.readexactly(int(length))
    except asyncio.IncompleteReadError as exc:
        raise BadAnswer(f"the body ended after {len(exc.partial)} of {length} bytes") from exc
    keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
    return Answer(int(parts[1]), body), keep
