"""Upload size limit enforced on the raw request body, before and while it streams in.

A declared `Content-Length` over the limit is refused before a byte is read. Otherwise the body is
counted as it arrives; past the limit the request is cut off and answered 413, whatever the form
parser was doing with it, so a huge upload never fills memory or disk.

Routes of `UploadRoute` keep a multipart upload of declared length (so within the limit) in
memory while parsing it; only a body of unknown length (chunked) spools to disk past 1 MB.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from contextlib import aclosing
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
# Before answering 413, read and throw away up to this much of the rest of the body: most clients
# only read the answer once they have sent everything, and would see a reset instead of the 413.
DRAIN_BYTES = 16 * 1024 * 1024


class BodyTooLarge(Exception):
    """The body passed the limit while streaming."""


class BodyLimit:
    """ASGI middleware: 413 for request bodies over `max_bytes` on upload routes."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, methods: frozenset[str] = frozenset({"POST"})
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes + FORM_OVERHEAD_BYTES
        self.image_max_bytes = max_bytes
        self.methods = methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await drain(receive)
            await self._refuse(send)
            return
        state: dict[str, Any] = {"seen": 0, "over": False, "started": False}

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > self.max_bytes:
                    state["over"] = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if state["over"]:
                return  # the app's own answer to the cut-off body is replaced by ours
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            pass
        if state["over"] and not state["started"]:
            await drain(receive)
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        limit_mb = self.image_max_bytes / 1024 / 1024
        body = json.dumps({"detail": f"the upload is larger than the {limit_mb:g} MB limit"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def drain(receive: Receive, limit: int = DRAIN_BYTES) -> None:
    """Read and drop the request body (up to `limit`), so the client sees our answer, not a reset."""
    seen = 0
    while seen < limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


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
        if self._form is not None or content_type != b"multipart/form-data" or not declared.isdigit():
            return await super()._get_form(
                max_files=max_files, max_fields=max_fields, max_part_size=max_part_size
            )
        try:
            async with aclosing(self.stream()) as stream:
                parser = MultiPartParser(
                    self.headers,
                    stream,
                    max_files=max_files,
                    max_fields=max_fields,
                    max_part_size=max_part_size,
                )
                parser.spool_max_size = int(declared)  # the whole body: files never roll to disk
                self._form = await parser.parse()
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
