"""Signed download links for result files and logs."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse

from app import errors
from app.api.deps import ServicesDep
from app.api.schemas import ErrorPublic

router = APIRouter(tags=["files"])


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
    services.signer.verify(job_id, name, exp, sig)
    job = await services.manager.get(job_id)
    if job.expired_at is not None:
        raise errors.Gone(f"the files of job {job_id} were deleted by retention on {job.expired_at:%Y-%m-%d}")
    path, media_type, sha256 = services.store.resolve(job, name)
    headers = {"Cache-Control": "private, max-age=3600"}
    if path is None:  # a log that holds nothing: the run printed nothing (yet)
        return Response(b"", media_type=media_type, headers={"Cache-Control": "no-cache"})
    if sha256 is not None:
        headers["ETag"] = f'"{sha256}"'
        if matches(request.headers.get("if-none-match", ""), headers["ETag"]):
            return Response(status_code=304, headers=headers)
    return FileResponse(path, media_type=media_type, filename=name, headers=headers)


# Download tools ask HEAD for the size (and Accept-Ranges) before their ranged GETs. The same route;
# left out of the OpenAPI document, where it would repeat GET's operation id.
router.add_api_route("/files/{job_id}/{name}", download, methods=["HEAD"], include_in_schema=False)


def matches(if_none_match: str, etag: str) -> bool:
    """Whether an If-None-Match header names `etag` (weakly, as RFC 9110 compares it there) or is `*`."""
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags
