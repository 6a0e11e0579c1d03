"""Upload size limit enforced on the raw request body, before and while it streams in.

A declared `Content-Length` over the limit is refused before a byte is read. Otherwise the body is
counted as it arrives; past the limit the request is cut off and answered 413, whatever the form
parser was doing with it, so a huge upload never fills memory or disk. Routes that take no upload
but must take a body from anyone (the web page's sign-in) get their own small limit (`per_path`),
enforced the same way, so their body is never parsed past a few kB. A body that stops arriving for
`idle_s` (a client gone without closing, or one holding what it sent in the API's memory), or that
arrives slower than a minimum rate (one dripping a byte just before each pause runs out: `Pace`),
is answered 408, and its connection closed. `refuse` sends these answers, and the other refusals
made before the body is read (401, 403: app/api/security.py; 429: app/api/admission.py and, for a
queue known full, app/api/fullness.py), at once.

Routes of `UploadRoute` keep a multipart upload of declared length (so within the limit) in
memory while parsing it; only a body of unknown length (chunked) spools to disk past 1 MB. In
memory, a file's bytes are copied once, from the request's chunks into one buffer of the body's
declared size, and read back without a copy (`PartBuffer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Room for the multipart boundaries and the small form fields around the image.
FORM_OVERHEAD_BYTES = 64 * 1024
# After a refusal, read and throw away up to this much of the rest of the body, for at most this
# long, before closing: a client that only reads the answer once it has sent everything would see
# a reset instead of it. The answer goes first, so the drain never delays it.
DRAIN_BYTES = 16 * 1024 * 1024
DRAIN_S = 2.0


class BodyTooLarge(Exception):
    """The body passed the limit while streaming."""


class BodyStalled(Exception):
    """The body stopped arriving."""


@dataclass(frozen=True, slots=True)
class SizeLimit:
    """A limit on a request body's bytes, and what its 413 says."""

    max_bytes: int
    detail: str


class BodyLimit:
    """ASGI middleware: 413 for request bodies over `max_bytes` on upload routes, and over their own
    limit on the paths in `per_path`; 408 for a body that pauses `idle_s`, or arrives slower than
    `min_kb_per_s` on average (`WatchedBody`)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        per_path: Mapping[str, SizeLimit] | None = None,
        methods: frozenset[str] = frozenset({"POST"}),
        idle_s: float = 30.0,
        min_kb_per_s: float = 0.0,
    ) -> None:
        self.app = app
        self.pace = Pace(idle_s=idle_s, min_kb_per_s=min_kb_per_s)
        limit_mb = max_bytes / 1024 / 1024
        self.upload = SizeLimit(
            max_bytes + FORM_OVERHEAD_BYTES, f"the upload is larger than the {limit_mb:g} MB limit"
        )
        self.per_path = dict(per_path or {})
        self.methods = methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope["path"], self.upload)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit.max_bytes:
            await refuse(scope, receive, send, 413, limit.detail)
            return
        body = WatchedBody(receive, send, limit, self.pace)
        try:
            await self.app(scope, body.receive, body.send)
        except (BodyTooLarge, BodyStalled):
            pass
        if body.refusal is not None and not body.answered:
            await refuse(scope, receive, send, *body.refusal)


@dataclass(frozen=True, slots=True)
class Pace:
    """How a body must keep arriving: no pause of `idle_s`, and from its start, after a grace of
    `idle_s`, at least `min_kb_per_s` on average (0: no minimum).

    The pause alone let a client send one byte just before each pause ran out, and keep an upload,
    its connection and what it had sent for days. A minimum rate bounds a body's time by its size:
    `idle_s` + its KB / `min_kb_per_s`. A fixed deadline would not fit both ends: one long enough
    for the largest upload on a slow line lets every dripped upload live that long too."""

    idle_s: float
    min_kb_per_s: float

    def next_wait_s(self, began: float, seen: int, now: float) -> tuple[float, bool]:
        """How long the body's next piece may take, for a body that began at `began` and has sent
        `seen` bytes: the pause allowed, or less when the minimum rate falls due first (then True)."""
        if self.min_kb_per_s <= 0:
            return self.idle_s, False
        due_s = began + self.idle_s + seen / (self.min_kb_per_s * 1024) - now
        return (due_s, True) if due_s < self.idle_s else (self.idle_s, False)

    def refusal(self, too_slow: bool) -> tuple[int, str]:
        """The answer to a body that paused too long, or (`too_slow`) came too slowly."""
        if too_slow:
            rate = f"{self.min_kb_per_s:g} KB/s on average (GPUJOBS_UPLOAD_MIN_KB_PER_S)"
            return 408, f"the client sent the body slower than {rate}"
        return 408, f"the client stopped sending the body ({self.idle_s:g} s)"


class WatchedBody:
    """One request's body as `BodyLimit` watches it: its size and pace as the app reads it
    (`receive`), and the app's answer, dropped once the body was refused (`send`)."""

    def __init__(self, receive: Receive, send: Send, limit: SizeLimit, pace: Pace) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._pace = pace
        self._seen = 0
        self._whole = False
        self._began: float | None = None  # when the app first asked for the body
        self.refusal: tuple[int, str] | None = None
        self.answered = False  # the app's answer has begun

    async def receive(self) -> Message:
        """The next piece of the body; BodyStalled or BodyTooLarge, with `refusal` set, if it
        breaks a limit."""
        if self._whole:  # after the body: a wait for the client's disconnect, not timed
            return await self._receive()
        now = time.monotonic()
        self._began = now if self._began is None else self._began
        wait_s, rate_due = self._pace.next_wait_s(self._began, self._seen, now)
        try:
            async with asyncio.timeout(wait_s):
                message = await self._receive()
        except TimeoutError:
            self.refusal = self._pace.refusal(too_slow=rate_due)
            raise BodyStalled from None
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            self._whole = not message.get("more_body", False)
            if self._seen > self._limit.max_bytes:
                self.refusal = (413, self._limit.detail)
                raise BodyTooLarge
        return message

    async def send(self, message: Message) -> None:
        """The app's answer, unless the body was refused: ours replaces it."""
        if self.refusal is not None:
            return
        self.answered = True
        await self._send(message)


def has_body(scope: Scope) -> bool:
    """Whether the request says a body follows (a Content-Length over 0, or chunked)."""
    headers = dict(scope["headers"])
    return headers.get(b"content-length", b"0").strip() != b"0" or b"transfer-encoding" in headers


async def refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    detail: str,
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    """Answer `status` with `{"detail": detail}` at once, without reading the body first.

    Reading first had the server send `100 Continue` to a client that asked (`Expect:
    100-continue`, as curl does), inviting the upload being refused, and left a client that stalled
    mid-body without an answer. With a body, the answer says `Connection: close`; then, before the
    connection closes, what the client still sends is read and dropped (`drain`), so that one that
    reads only once it has sent everything finds the answer rather than a reset.
    """
    body = json.dumps({"detail": detail}).encode()
    closing = has_body(scope)
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *([(b"connection", b"close")] if closing else []),
        *((k.encode(), v.encode()) for k, v in headers),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    if not closing:
        await send({"type": "http.response.body", "body": body})
        return
    # The whole answer is sent, but the response stays open while draining: the server sends
    # nothing more and closes the connection when it completes.
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain(receive)
    await send({"type": "http.response.body", "body": b""})


async def drain(receive: Receive, *, max_bytes: int = DRAIN_BYTES, max_s: float = DRAIN_S) -> None:
    """Read and drop the request body until it ends or the client goes, at most `max_bytes` of it
    and for at most `max_s` (a client may stall, or wait for a 100 Continue that never comes)."""
    seen = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max_s):
            while seen < max_bytes:
                message = await receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


class PartBuffer:
    """A form file's bytes in memory, in one buffer of at most `capacity` bytes (the body's declared
    length, which no part can exceed). Reads return read-only views of it, not copies. The file-like
    subset that Starlette's UploadFile and the intake use; `_rolled` tells UploadFile it is in memory.

    The buffer grows as data arrives, never ahead of it: a client that declares 20 MB, sends a few
    bytes and stalls holds a few bytes here, not 20 MB. Growing costs no more than allocating it all
    at once (a large bytearray grows by realloc, which moves pages instead of copying them; measured:
    2.4 ms for 5 MB either way, in 64 KB writes).
    """

    _rolled = False

    def __init__(self, capacity: int) -> None:
        self._buffer = bytearray()
        self._capacity = capacity
        self._pos = 0
        self.closed = False

    @property
    def _size(self) -> int:
        return len(self._buffer)

    def write(self, data: bytes | memoryview) -> int:
        end = self._pos + len(data)
        if end > self._capacity:  # a body longer than it said: BodyLimit and the parser stop it first
            raise ValueError("more form data than the request's Content-Length")
        self._buffer[self._pos : end] = data  # past the end: the buffer grows
        self._pos = end
        return len(data)

    def read(self, size: int = -1) -> memoryview:
        end = self._size if size < 0 else min(self._size, self._pos + size)
        view = memoryview(self._buffer)[self._pos : end].toreadonly()
        self._pos = max(self._pos, end)
        return view

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self._size)[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self.closed = True


class WholeFormParser(MultiPartParser):
    """Starlette's multipart parser, refusing a form whose body ended before its closing boundary.
    It parsed such a form as far as it went and dropped the unfinished last part without a word:
    `params` cut off so (a Content-Length counted in characters, not bytes) queued the job to run
    with the model's defaults."""

    _ended = False

    def on_end(self) -> None:
        self._ended = True

    async def parse(self) -> FormData:
        form = await super().parse()
        if not self._ended:
            for file in self._files_to_close_on_error:
                file.close()
            raise MultiPartException(FORM_CUT_SHORT)
        return form


FORM_CUT_SHORT = "the multipart form ends before its closing boundary: the body was cut short; send it whole"


class InMemoryParser(WholeFormParser):
    """Starlette's multipart parser, with each file in a `PartBuffer` of the body's size, fed with
    views of the request's chunks (Starlette slices each chunk and spools it: two more copies, and
    the spool's growth)."""

    def __init__(self, *args: Any, capacity: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._capacity = capacity

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._current_part.file is None:
            super().on_part_data(data, start, end)
        else:
            self._file_parts_to_write.append((self._current_part, memoryview(data)[start:end]))  # type: ignore[arg-type]

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        upload = self._current_part.file
        if upload is not None:
            self._files_to_close_on_error.pop().close()  # the spool Starlette made, never written to
            upload.file = PartBuffer(self._capacity)  # type: ignore[assignment]
            upload._max_mem_size = 0  # never rolls to disk
            self._files_to_close_on_error.append(upload.file)  # type: ignore[arg-type]


class InMemoryUploads(Request):
    """A request whose multipart form, if the body's length is declared, is parsed in memory.

    Starlette spools each file over 1 MB to a temporary file, with a thread hop per chunk written,
    and the intake reads it back: for a 5 MB image, a third of the API's CPU (11 of 35 ms). A
    declared length is at most the upload limit here (`BodyLimit` refused a larger one), so memory
    stays bounded. Errors are Starlette's own (400 with its message).
    """

    async def _get_form(
        self,
        *,
        max_files: int | float = 1000,
        max_fields: int | float = 1000,
        max_part_size: int = 1024 * 1024,
    ) -> FormData:
        declared = self.headers.get("content-length", "")
        content_type, _ = parse_options_header(self.headers.get("content-type"))
        if self._form is not None or content_type != b"multipart/form-data":
            return await super()._get_form(
                max_files=max_files, max_fields=max_fields, max_part_size=max_part_size
            )
        try:
            async with contextlib.aclosing(self.stream()) as stream:
                parser = (
                    InMemoryParser(  # the whole body: no part is larger
                        self.headers, stream, max_files=max_files, max_fields=max_fields,
                        max_part_size=max_part_size, capacity=int(declared),
                    )
                    if declared.isdigit()
                    else WholeFormParser(  # chunked: Starlette's spool, the form's end checked as well
                        self.headers, stream, max_files=max_files, max_fields=max_fields,
                        max_part_size=max_part_size,
                    )
                )  # fmt: skip
                self._form = await parser.parse()
                self.state.form = self._form  # for what answers the route's refusals (app/api/forms.py)
        except MultiPartException as exc:
            raise HTTPException(status_code=400, detail=exc.message) from exc
        return self._form


class UploadRoute(APIRoute):
    """A route whose handler sees `InMemoryUploads` requests (FastAPI's custom request class)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def in_memory(request: Request) -> Response:
            return await handler(InMemoryUploads(request.scope, request.receive))

        return in_memory
