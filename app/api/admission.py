"""Admission: how many uploads and event streams one principal may have in progress at once.

Each holds what a client must not hold without end. An upload holds a connection, a buffer that
grows with what it sent and, once whole, a turn at the database; an event stream holds a connection
and an open file for as long as its job runs. Nothing else bounds how many of them one key's owner
starts. `Admission` counts each principal's requests of each capped kind while they run, and answers
one past its cap 429 with Retry-After before the route runs and before a byte of its body is read
(the key was checked by `security.Authenticate`, just outside it). The counts live in the API
process: with `gpujobs serve --processes N`, a principal may have N times as many in all.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app import auth
from app.api import limits
from app.settings import Settings

log = logging.getLogger("gpujobs.api")

# An upload that finds its principal's slots taken may try again soon: uploads take seconds.
UPLOAD_RETRY_AFTER_S = 5
# A stream's slot frees when a job ends or its client lets go: minutes, often.
STREAM_RETRY_AFTER_S = 15


@dataclass(frozen=True, slots=True)
class Cap:
    """A cap on the requests of one kind (a method and a path) a principal may have in progress."""

    method: str
    path: re.Pattern[str]
    most: int
    what: str  # "uploads in progress", as the refusal counts them
    advice: str  # what to do instead, as the refusal ends
    setting: str  # the variable that sets `most`
    retry_after_s: int

    def matches(self, scope: Scope) -> bool:
        """Whether the request of `scope` is of this kind."""
        return scope["method"] == self.method and self.path.fullmatch(scope["path"]) is not None

    def refusal(self) -> str:
        """What a request past the cap is answered."""
        return (
            f"you have {self.most} {self.what}, the most one key may have at once in this API process "
            f"({self.setting}); {self.advice}"
        )


def caps(settings: Settings) -> list[Cap]:
    """The caps these settings ask for (a cap of 0 is none)."""
    every = [
        Cap(
            "POST", re.compile("/jobs"), settings.uploads_per_key, "uploads in progress",
            "send this one once one of them has been answered", "GPUJOBS_UPLOADS_PER_KEY",
            UPLOAD_RETRY_AFTER_S,
        ),
        Cap(
            "GET", re.compile("/jobs/[^/]+/stream"), settings.streams_per_key, "event streams open",
            "close one, or read this job with GET /jobs/{id}", "GPUJOBS_STREAMS_PER_KEY",
            STREAM_RETRY_AFTER_S,
        ),
    ]  # fmt: skip
    return [cap for cap in every if cap.most > 0]


class Admission:
    """ASGI middleware: at most `cap.most` requests of each cap's kind in progress per principal."""

    def __init__(self, app: ASGIApp, *, caps: Sequence[Cap]) -> None:
        self.app = app
        self.caps = list(caps)
        self.held: dict[Cap, Counter[str]] = {cap: Counter() for cap in self.caps}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cap = self._cap_of(scope)
        identity = scope.get("state", {}).get("identity") if cap is not None else None
        if cap is None or not isinstance(identity, auth.Identity):  # unauthenticated: public paths
            await self.app(scope, receive, send)
            return
        held, principal = self.held[cap], identity.principal
        if held[principal] >= cap.most:
            log.info(  # the request's own line says 429; this one says whose and which cap
                "refused a request over its key's cap: %s", cap.setting,
                extra={"action": "admission_refused", "principal": principal, "cap": cap.setting},
            )  # fmt: skip
            retry_after = [("retry-after", str(cap.retry_after_s))]
            await limits.refuse(scope, receive, send, 429, cap.refusal(), retry_after)
            return
        held[principal] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            held[principal] -= 1
            if not held[principal]:  # no entry kept for each principal ever seen
                del held[principal]

    def _cap_of(self, scope: Scope) -> Cap | None:
        if scope["type"] != "http":
            return None
        return next((cap for cap in self.caps if cap.matches(scope)), None)
