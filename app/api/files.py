"""Signed download links for result files and logs."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, BinaryIO

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from app import errors, storage
from app.api.deps import Services, ServicesDep
from app.api.schemas import ErrorPublic
from app.queue.jobs import Job


class LinkRoute(APIRoute):
    """A route of /files/...: a method links do not answer is a 405 that says `Allow: GET, HEAD`.
    Starlette's lists the methods of the route matched first, GET's, as HEAD has a route of its
    own (below)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            raise HTTPException(status_code=405, headers={"Allow": "GET, HEAD"})
        await super().handle(scope, receive, send)


router = APIRouter(tags=["files"], route_class=LinkRoute)


@router.get(
    "/files/{job_id}/{name}",
    response_class=FileResponse,
    responses={403: {"model": ErrorPublic}, 404: {"model": ErrorPublic}, 410: {"model": ErrorPublic}},
)
async def download(
    request: Request,
    job_id: uuid.UUID,
    name: str,
    services: ServicesDep,
    exp: Annotated[int, Query(description="Expiry, unix seconds")],
    sig: Annotated[str, Query(max_length=100)],
) -> Response:
    """A result file or log, by signed link (no key needed); supports Range and ETag."""
    try:
        services.signer.verify(job_id, name, exp, sig)
    except errors.LinkExpired:
        await gone_if_expired(services, job_id)  # a fresh link is no help: an expired job has none
        raise
    job = await services.manager.get(job_id)
    if job.expired_at is not None:
        raise gone(job)
    found = await open_download(services, job, name)
    if found.file is None:  # a log that holds nothing: the run printed nothing (yet)
        return Response(b"", media_type=found.media_type, headers={"Cache-Control": "no-cache"})
    headers = {"Cache-Control": "no-cache"}  # a log: it may still grow, so asked again each time
    if found.sha256 is not None:  # a result: never changes, but is kept no longer than its link
        headers = {"Cache-Control": f"private, max-age={max(exp - int(time.time()), 0)}"}
        headers["ETag"] = f'"{found.sha256}"'
    answer = OpenFileResponse(found, filename=name, headers=headers)
    # The tag the answer carries: a result's digest, or for a log Starlette's (its time and size).
    etag = answer.headers["etag"]
    if matches(", ".join(request.headers.getlist("if-none-match")), etag):  # one list, over any lines
        found.file.close()
        return Response(status_code=304, headers={"ETag": etag, "Cache-Control": headers["Cache-Control"]})
    return answer


# Download tools ask HEAD for the size (and Accept-Ranges) before their ranged GETs. The same route;
# left out of the OpenAPI document, where it would repeat GET's operation id.
router.add_api_route("/files/{job_id}/{name}", download, methods=["HEAD"], include_in_schema=False)


def gone(job: Job) -> errors.Gone:
    """410 for an expired job's link."""
    assert job.expired_at is not None
    return errors.Gone(f"the files of job {job.id} were deleted by retention on {job.expired_at:%Y-%m-%d}")


async def gone_if_expired(services: Services, job_id: uuid.UUID) -> None:
    """410 if the job exists and retention deleted its files."""
    with contextlib.suppress(errors.JobNotFound):
        if (job := await services.manager.get(job_id)).expired_at is not None:
            raise gone(job)


async def open_download(services: Services, job: Job, name: str) -> storage.Download:
    """The file a link names, opened. Retention marks a job expired, then deletes its files, so a
    file missing now (or a log holding nothing) may be one it deleted since `job` was read: the
    job is read again, and an expired one is 410 rather than 404 (or an empty log)."""
    try:
        found = services.store.open(job, name)
    except errors.FileNotFound:
        if (again := await services.manager.get(job.id)).expired_at is not None:
            raise gone(again) from None
        raise
    if found.file is None and (again := await services.manager.get(job.id)).expired_at is not None:
        raise gone(again)
    return found


class OpenFileResponse(FileResponse):
    """A FileResponse (Range, If-Range, HEAD) of a file the route opened. FileResponse opens its
    path when it sends the body, after the route returned; retention could delete the file in
    between (a 500, or headers with no body). An open file reads whole though its name is gone."""

    def __init__(self, found: storage.Download, *, filename: str, headers: Mapping[str, str]) -> None:
        assert found.path is not None and found.file is not None
        self._file = found.file
        opened = os.fstat(self._file.fileno())  # the open file's size: Content-Length
        self._size = opened.st_size
        super().__init__(
            found.path, headers=headers, media_type=found.media_type, filename=filename, stat_result=opened
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Not offered "http.response.pathsend": the server would open the path itself.
        offered = scope.get("extensions") or {}
        extensions = {k: v for k, v in offered.items() if k != "http.response.pathsend"}
        headers = [(k, v) for k, v in scope["headers"] if k != b"range"]
        headers += [(b"range", r) for k, v in scope["headers"] if k == b"range" and (r := self._range(v))]
        try:
            await super().__call__({**scope, "extensions": extensions, "headers": headers}, receive, send)
        finally:
            self._file.close()  # also when no body was sent: HEAD, 416, a client gone

    def _range(self, value: bytes) -> bytes | None:
        """The Range header to answer, or None to send the whole file. FileResponse answers one in
        another unit, or malformed, with a 400 in plain text; RFC 9110 (14.2) says to ignore the
        first and allows ignoring the second. It answers 416 if any range starts past the end,
        RFC 9110 (14.1.1) only if none can be sent: those are dropped, the others answered."""
        text = value.decode("latin-1")
        try:
            self._parse_range_header(text, self._size)
        except MalformedRangeHeader:
            return None
        except RangeNotSatisfiable:
            unit, _, ranges = text.partition("=")
            kept = [part for part in ranges.split(",") if self._satisfiable(part)]
            if kept:  # else the 416 stands
                return self._range(f"{unit}={','.join(kept)}".encode("latin-1"))
        return value

    def _satisfiable(self, part: str) -> bool:
        """Whether one range of a Range header starts within the file."""
        return any(start < self._size for start, _ in self._parse_ranges(part, self._size))

    @contextlib.asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        # Where FileResponse opens its path for the body (Starlette 1.8 on: pyproject.toml). Were it
        # no longer called, tests/integration/test_retention_races.py would fail.
        self._file.seek(0)
        yield anyio.wrap_file(SizedReader(self._file, self._size))  # type: ignore[arg-type]


class SizedReader:
    """Reads of `file` that end at `size`, the length the answer declared. A running job's log grows
    while it is sent; FileResponse reads a whole body to the file's end, and a body longer than its
    Content-Length makes the server break off the answer. Ranges end within `size` already."""

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self._size = size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move in the file (a range starts here)."""
        return self._file.seek(offset, whence)

    def read(self, size: int = -1) -> bytes:
        """At most `size` bytes, none past the declared length."""
        left = max(self._size - self._file.tell(), 0)
        return self._file.read(left if size < 0 else min(size, left))


def matches(if_none_match: str, etag: str) -> bool:
    """Whether an If-None-Match header names `etag` (weakly, as RFC 9110 compares it there) or is `*`."""
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags
