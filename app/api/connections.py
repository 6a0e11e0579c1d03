"""Limits on what a client may send before its request exists: the size of a request's head (its
line and headers), and the time it may take to send it.

uvicorn's httptools protocol keeps a head in memory however long it grows, and waits for it for
ever: a client without a key could grow the API's memory by the size of a header it never ended
(64 MB sent, 64 MB held), or hold a connection, and its descriptor, by sending nothing or a head a
byte at a time (slowloris). `HeadLimits` is that protocol with both bounded: a head over
`MAX_HEAD_BYTES` is answered 431, and one not whole `timeout_s` after the connection opened or its
previous response ended is answered 408 (a connection that sent nothing is closed). Either way the
connection closes. The deadline is the head's alone: a long response (an event stream) is not cut.

An answer is bounded in time too, but by its client's reading, not by its length. uvicorn waits
for its write buffer to drain without a limit, so a client that stopped reading (a large download,
an image) held its connection, the task sending the answer and any file it read for ever, and an
answer written whole held its unsent rest in memory. Once the buffer is full (`pause_writing`: the
kernel's send buffer is full and the transport's own past its high-water mark) the client has
`timeout_s` to take enough for it to drain (`resume_writing`; Linux wakes a writer once about a
third of the send buffer is free, which grows to 4 MB at most by default); else the connection is
aborted: the answer's task reads a disconnect and ends, and its file is closed. The clock starts
again each time the buffer drains, so a slow reader gets a long answer whole, and an event stream,
a few bytes now and then, never fills the buffer while its client reads.

At a graceful stop an answer still being sent is broken off the same way shortly before uvicorn's
grace (`timeout_graceful_shutdown`) runs out: its task then ends as for a client gone, where
uvicorn would cancel it and log an error and a traceback for a download that was merely long. A
body still arriving then is answered 503 with Retry-After (the client sends it again, to this
server restarted or to another): cut, it read as a network gone. A request sent whole whose answer
has not begun (its job being written) is left to end: cut, its job was queued and its client told
nothing, so that a retry queued a second.
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
MALFORMED = (
    "not a well-formed HTTP/1.1 request: its request line or a header could not be read (a header "
    "name holds only letters, digits and !#$%&'*+-.^_`|~)"
)
STOPPING = "the server is stopping and the body did not arrive in time: send the request again"
STOPPING_RETRY_AFTER_S = 5
# How long before uvicorn's grace runs out an answer still being sent is broken off: uvicorn looks
# for the end of the requests in flight every 0.1 s, from 0.1 s after it asked connections to end.
STOP_MARGIN_S = 0.5


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
        self._write_timer: asyncio.TimerHandle | None = None  # the client has an answer to take
        self._stop_timer: asyncio.TimerHandle | None = None  # a graceful stop, an answer in flight

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for timer in (self._write_timer, self._stop_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        # The transport's buffer is past its high-water mark: the client has to take some of it.
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.timeout_s, self._not_reading)

    def resume_writing(self) -> None:
        # The client took enough of the answer for the buffer to drop below its low-water mark.
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def shutdown(self) -> None:
        super().shutdown()  # closes an idle connection; one with an answer in flight ends after it
        grace_s = self.config.timeout_graceful_shutdown
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if in_flight and grace_s is not None and self._stop_timer is None:
            self._stop_timer = self.loop.call_later(max(grace_s - STOP_MARGIN_S, 0), self._break_off)

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
        # The parser gave up: on a head too large (on_headers_complete), or on one it cannot read
        # (a header name with a space or a `;`, a bad request line), answered as every error is,
        # in JSON with what to fix, not in uvicorn's plain text.
        self._refuse(*(self._refusal or (400, MALFORMED)))

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

    def _not_reading(self) -> None:
        """The client has not taken enough of its answer in `timeout_s` for the write buffer to
        drain: drop the connection. Aborted, as a close would wait for that buffer to drain."""
        self._write_timer = None
        log.warning(
            "closed a connection whose client stopped reading its answer for %g s", self.timeout_s,
            extra={"action": "client_not_reading", "timeout_s": self.timeout_s},
        )  # fmt: skip
        self.transport.abort()

    def _break_off(self) -> None:
        """The server is stopping and the request is not answered yet (module doc): an answer being
        sent ends as for a client gone, a body still arriving is answered 503, and a request sent
        whole is left to end (uvicorn cancels it once its grace has run out)."""
        self._stop_timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            return
        if not cycle.response_started:
            if cycle.more_body:
                log.info(
                    "answered 503 to a body still arriving: the server is stopping",
                    extra={"action": "body_cut", "status": 503},
                )
                cycle.disconnected = True  # the app reads a disconnect; its own answer is dropped
                cycle.message_event.set()
                self._answer(503, STOPPING, retry_after_s=STOPPING_RETRY_AFTER_S)
            return
        log.info(
            "broke off an answer still being sent: the server is stopping",
            extra={"action": "answer_cut"},
        )
        self.transport.abort()

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
        self._answer(status, detail)

    def _answer(self, status: int, detail: str, *, retry_after_s: int | None = None) -> None:
        """Write `status` with `{"detail": detail}` and close once the client has sent what it was
        sending (`_refuse`), what it sends meanwhile dropped."""
        self._refusal = (status, detail)
        body = json.dumps({"detail": detail}).encode()
        head = [STATUS_LINE[status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"retry-after: %d\r\n" % retry_after_s] if retry_after_s is not None else []
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
