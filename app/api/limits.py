"""Upload size limit enforced on the raw request body, before and while it streams in.

A declared `Content-Length` over the limit is refused before a byte is read. Otherwise the body is
counted as it arrives; past the limit the request is cut off and answered 413, whatever the form
parser was doing with it, so a huge upload never fills memory or disk.
"""

from __future__ import annotations

import json
from typing import Any

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
