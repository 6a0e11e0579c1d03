"""Limits on what a client may send before its request exists: the size of a request's head (its
line and headers), and the time it may take to send it.

uvicorn's httptools protocol keeps a head in memory however long it grows, and waits for it for
ever: a client without a key could grow the API's memory by the size of a header it never ended
(64 MB sent, 64 MB held), or hold a connection, and its descriptor, by sending nothing or a head a
byte at a time (slowloris). `HeadLimits` is that protocol with both bounded: a head over
`MAX_HEAD_BYTES` is answered 431, and one not whole `timeout_s` after the connection opened or its
previous response ended is answered 408 (a connection that sent nothing is closed). Either way the
connection closes. The deadline is the head's alone: a long response (an event stream) is not cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.api import limits

log = logging.getLogger("gpujobs.api")

# As large as a browser's head with its cookies needs many times over; h11 allows 16 KB.
MAX_HEAD_BYTES = 64 * 1024
HEAD_TOO_LARGE = f"the request's line and headers are larger than {MAX_HEAD_BYTES // 1024} KB"
HEAD_TOO_SLOW = "the request's line and headers did not arrive in time"


class HeadTooLarge(Exception):
    """A whole head over the limit, found in the parser's callback: uvicorn answers a callback's
    error with its own 400 (`send_400_response`), which `HeadLimits` turns into the 431."""


class HeadLimits(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a request head bounded in size and in time (module doc)."""

    timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the bytes received now are (the start of) a request's head
        self._head_bytes = 0
        self._head_started = False  # the parser has begun a request whose head is not whole yet
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._dropped = 0  # after a refusal: bytes read and thrown away (`_refuse`)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # answered: what the client still sends is dropped
            self._dropped += len(data)
            if self._dropped > limits.DRAIN_BYTES:
                self.transport.close()
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # A head still incomplete past the limit (bounded by the limit and one read).
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and self._refusal is None:
            self._refuse(431, HEAD_TOO_LARGE)

    def eof_received(self) -> None:
        if self._refusal is not None:  # the client has sent all it will: the answer is read
            self.transport.close()

    def on_message_begin(self) -> None:
        self._head_started = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        # A whole head that arrived in one read is measured here: what the parser took of it.
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._refusal = (431, HEAD_TOO_LARGE)
            raise HeadTooLarge
        self._in_head, self._head_bytes, self._head_started = False, 0, False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next is the next request's head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        idle = self.cycle is None or self.cycle.response_complete  # no pipelined request started
        if idle and not self.transport.is_closing():
            self._arm()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._refuse(*self._refusal)
        else:
            super().send_400_response(msg)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refusal is not None:
            return
        if self._head_started:
            self._refuse(408, HEAD_TOO_SLOW)
        else:  # nothing sent: nothing to answer
            self.transport.close()

    def _refuse(self, status: int, detail: str) -> None:
        """Answer `status` with `{"detail": detail}`, and close.

        As `limits.refuse` does, the close waits until the client has sent what it was sending
        (at most `limits.DRAIN_BYTES` more, for at most `limits.DRAIN_S`), all of it dropped: closed
        at once, a client still sending was reset, its answer lost."""
        log.warning("refused a request: %s", detail, extra={"action": "head_refused", "status": status})
        self._disarm()
        self._refusal = (status, detail)
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still running (an event stream): an answer now
            # would land inside that response. Its client loses the connection, and both.
            self.transport.close()
            return
        body = json.dumps({"detail": detail}).encode()
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(limits.DRAIN_S, self.transport.close)


def protocol(timeout_s: float) -> type[HeadLimits]:
    """`HeadLimits` allowing a request's head `timeout_s` to arrive, for uvicorn's `http` setting."""
    return type("HeadLimits", (HeadLimits,), {"timeout_s": timeout_s})
