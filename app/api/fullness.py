"""Fullness: what this API process knows of a full queue, so that an upload is refused before its body.

The queue limits (GPUJOBS_QUEUE_LIMIT for every job waiting, GPUJOBS_QUEUE_LIMIT_PER_KEY for one
principal's) are checked exactly by the enqueue's own statement, once the upload has arrived whole
and been checked: a client refused there had sent its tens of MB for nothing, even one that asked
first (`Expect: 100-continue`). `Fullness` remembers what such a refusal said: the queue was full, or
a principal's share was. While it remembers, `Precheck` counts again (one statement, JobManager.room) before
the body is read: still full, the upload is answered 429 at once, as the enqueue would answer it;
else the memory is forgotten and the upload goes on. So a queue that drained takes the next upload,
and an upload while nothing is remembered (the normal path) costs no statement and no wait. The
enqueue's check stays the exact one: uploads written at the same moment race past a count.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app import auth, errors
from app.api import deps, limits
from app.queue import manager as manager_

log = logging.getLogger("gpujobs.api")

# Principals remembered with a full share at once; past it, the one remembered longest ago is
# forgotten (its next upload is checked by the enqueue alone, as before). No entry per principal ever seen.
MOST_OWNERS = 1024
IDEMPOTENCY_KEY_CHARS = 200  # the longest key POST /jobs takes (app/api/jobs.py)


class Fullness:
    """What this process knows of a full queue: whether the enqueue last found it full, and which
    principals' shares it found full (at most `most_owners`, the oldest forgotten first)."""

    def __init__(self, *, queue_limit: int, owner_limit: int, most_owners: int = MOST_OWNERS) -> None:
        self.queue_limit = queue_limit
        self.owner_limit = owner_limit  # 0: no limit per principal
        self._most_owners = most_owners
        self._queue_full = False
        self._owners: OrderedDict[str, None] = OrderedDict()

    def saw_full(self, principal: str, *, waiting: int | None) -> None:
        """The enqueue refused an upload of `principal` (QueueFull); `waiting` is the jobs waiting as
        it last counted them (JobManager.waiting: counted by every enqueue near the limit, so fresh
        when the queue was what was full). The principal's share is remembered either way (the count
        before its next upload tells)."""
        if waiting is not None and waiting >= self.queue_limit:
            self._queue_full = True
        if self.owner_limit > 0:
            self._owners[principal] = None
            self._owners.move_to_end(principal)
            while len(self._owners) > self._most_owners:
                self._owners.popitem(last=False)

    def remembers(self, principal: str) -> bool:
        """Whether an upload of `principal` must be counted for before its body (no statement)."""
        return self._queue_full or principal in self._owners

    async def refusal(self, manager: manager_.JobManager, principal: str) -> errors.QueueFull | None:
        """Count again what is remembered full (one statement): the refusal, in the enqueue's words
        and order (the principal's share first), if it still is; else None, and it is forgotten."""
        owner = principal in self._owners
        waiting, owner_waiting = await manager.room(
            queue_limit=self.queue_limit if self._queue_full else None,
            owner=principal if owner else None,
            owner_limit=self.owner_limit,
        )
        if owner_waiting is not None and owner_waiting < self.owner_limit:
            self._owners.pop(principal, None)
        if waiting is not None and waiting < self.queue_limit:
            self._queue_full = False
        if owner_waiting is not None and owner_waiting >= self.owner_limit:
            return manager_.owner_full(self.owner_limit)
        if waiting is not None and waiting >= self.queue_limit:
            return manager_.queue_full(self.queue_limit)
        return None


class Precheck:
    """ASGI middleware: an upload (POST /jobs) of a principal whose share, or into a queue, that
    `fullness` remembers full is counted for before its body is read, and answered 429 with
    Retry-After if it still is (`limits.refuse`: no 100 Continue is sent). The key was checked by
    `security.Authenticate`, outside it."""

    def __init__(self, app: ASGIApp, *, fullness: Fullness) -> None:
        self.app = app
        self.fullness = fullness

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        identity = scope.get("state", {}).get("identity") if _is_upload(scope) else None
        if not isinstance(identity, auth.Identity) or not self.fullness.remembers(identity.principal):
            await self.app(scope, receive, send)  # the normal path: nothing more
            return
        refusal = await self._refusal(scope, identity.principal)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        log.info(  # the request's own line says 429; this one says whose and why
            "refused an upload before its body: %s", refusal.message,
            extra={"action": "upload_refused_full", "principal": identity.principal},
        )  # fmt: skip
        retry_after = [("retry-after", str(refusal.retry_after_s))]
        await limits.refuse(scope, receive, send, refusal.status_code, refusal.message, retry_after)

    async def _refusal(self, scope: Scope, principal: str) -> errors.QueueFull | errors.Unavailable | None:
        """The answer to give before the body, if any: the queue or share still full (not for a
        repeat of an idempotent upload: the enqueue gives that its job, full or not), or the
        database away, as the route would answer."""
        state: Any = scope["app"].state
        try:
            manager: manager_.JobManager = state.services.manager
            refusal = await self.fullness.refusal(manager, principal)
            if refusal is not None and await _is_repeat(scope, manager, principal):
                return None
        except Exception as exc:
            if (down := deps.unavailable(exc)) is None:
                raise
            return down
        return refusal


def _is_upload(scope: Scope) -> bool:
    return bool(scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/jobs")


async def _is_repeat(scope: Scope, manager: manager_.JobManager, principal: str) -> bool:
    """Whether the request names, by its Idempotency-Key, a job of `principal` already queued."""
    key = Headers(scope=scope).get("idempotency-key")
    if key is None or not 0 < len(key) <= IDEMPOTENCY_KEY_CHARS:
        return False
    return await manager.find_idempotent(principal, key) is not None
