"""Routes for users' jobs: submit, read, list, input, history, cancel."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Header, Query, Request, Response, UploadFile
from fastapi.responses import StreamingResponse
from starlette.datastructures import FormData

from app import auth, errors, intake
from app.api import forms, fullness
from app.api.deps import CallerDep, InvalidPublic, ServicesDep, get_caller
from app.api.schemas import CancelPublic, ErrorPublic, EventPublic, JobPublic, JobsPublic, Text
from app.queue import manager as manager_
from app.queue.jobs import JobState
from app.settings import DEFAULT_PRIORITY

# Every route needs a key (`security.Authenticate` checks it before the body is read).
router = APIRouter(
    prefix="/jobs",
    tags=["jobs"],
    route_class=forms.FormRoute,  # POST /jobs parses its upload in memory; says how to send one
    dependencies=[Depends(get_caller)],
    responses={
        401: {"model": ErrorPublic, "description": "Missing, invalid or revoked API key"},
        422: {"model": InvalidPublic, "description": "A parameter is not valid (the message names it)"},
    },
)

ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorPublic, "description": "No such job"},
}
SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    200: {"model": JobPublic, "description": "Same Idempotency-Key as an earlier request: that job"},
    400: {"model": ErrorPublic, "description": "Not a well-formed form, or too many or too large fields"},
    408: {"model": ErrorPublic, "description": "The upload stopped arriving (GPUJOBS_CLIENT_TIMEOUT_S)"},
    409: {"model": ErrorPublic, "description": "The Idempotency-Key was used for a different request"},
    413: {"model": ErrorPublic, "description": "The upload is over the size limit"},
    415: {"model": ErrorPublic, "description": "Not a PNG, JPEG or WebP image"},
    422: {
        "model": InvalidPublic,
        "description": "Unknown model, bad params or priority, broken image, image too large for every GPU",
    },
    429: {"model": ErrorPublic, "description": "The queue, or this key's share of it, is full (Retry-After)"},
    503: {"model": ErrorPublic, "description": "The database is unavailable (see Retry-After)"},
}


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    responses=SUBMIT_ERRORS,
    # One file and three fields: more parts, or a text field over 64 KiB, is refused (400) at once.
    form_limits={"max_files": 1, "max_fields": 8, "max_part_size": 64 * 1024},
)
async def submit_job(
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    image: Annotated[UploadFile, File(description="PNG, JPEG or WebP image (checked by content)")],
    model: Annotated[str, Form(description="A registered model, see GET /models", max_length=64)],
    priority: Annotated[int, Form(description="Higher runs first")] = DEFAULT_PRIORITY,
    params: Annotated[
        str | None, Form(description="Model parameters as a JSON object", max_length=10_000)
    ] = None,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobPublic:
    """Upload an image and queue a job for a model."""
    check_fields(await request.form())  # parsed already, for the arguments above: no second read
    try:
        job, created = await intake.submit(
            services.manager,
            services.models,
            owner=caller.principal,
            model=model,
            priority=priority,
            params=intake.parse_params(params),
            image=image.file,
            idempotency_key=idempotency_key,
            limits=services.limits,
            learner=services.learner,
            gate=services.upload_gate,
            key_id=caller.key_id,
        )
    except errors.KeyRevoked:  # while its body arrived: as any request with that key is now
        raise auth.Unauthorized() from None
    except errors.QueueFull:  # remembered: the next uploads are counted for before their bodies
        memory: fullness.Fullness = request.app.state.fullness
        memory.saw_full(caller.principal, waiting=services.manager.waiting.known)
        raise
    response.headers["Location"] = f"/jobs/{job.id}"
    if not created:
        response.status_code = 200
    return JobPublic.of(job, services.signer)


SUBMIT_FIELDS = ("image", "model", "priority", "params")
LIST_PARAMETERS = ("state", "model", "cursor", "limit")


def check_fields(form: FormData) -> None:
    """A form of known fields, each sent once. FastAPI takes the fields it declares and drops the
    rest, and takes the last of a repeated one: a misspelt `params` would run the model with its
    defaults, a misspelt `priority` at 0, and so would an empty one (read as left out)."""
    check_names([name for name, _ in form.multi_items()], SUBMIT_FIELDS, "form field")
    if form.get("priority") == "":
        raise errors.InvalidRequest(
            f"form field 'priority' is empty: send an integer, or leave the field out for {DEFAULT_PRIORITY}",
            field="priority",
        )


def check_names(sent: list[str], known: tuple[str, ...], what: str) -> None:
    """422 for a name not in `known`, or sent more than once."""
    for name, times in Counter(sent).items():
        if name not in known:
            raise errors.InvalidRequest(f"unknown {what} {name!r}: send {', '.join(known)}", field=name)
        if times > 1:
            raise errors.InvalidRequest(f"{what} {name!r} was sent {times} times; send it once", field=name)


@router.get("", response_model=JobsPublic)
async def list_jobs(
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    state: JobState | None = None,
    model: Annotated[Text | None, Query(min_length=1, max_length=64)] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> JobsPublic:
    """List jobs, newest first, with filters and a cursor."""
    # A misspelt filter (`status=failed`) would list every job; a repeated one, by its last value.
    check_names([name for name, _ in request.query_params.multi_items()], LIST_PARAMETERS, "query parameter")
    page = await services.manager.listing.page(
        owner=caller.owner_filter, state=state, model=model, cursor=cursor, limit=limit
    )
    return JobsPublic(
        jobs=[JobPublic.of(j, services.signer) for j in page.jobs], next_cursor=page.next_cursor
    )


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
async def get_job(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> JobPublic:
    """One job: state, progress, attempts, timings, error and download links."""
    return JobPublic.of(await services.manager.get(job_id, owner=caller.owner_filter), services.signer)


@router.get("/{job_id}/input", responses={200: {"content": {"image/*": {}}}, **ERRORS})
async def get_input(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> Response:
    """The uploaded image, byte for byte."""
    image = await INPUTS_SENT.read(services.manager, job_id, owner=caller.owner_filter)
    return ImageResponse(image, headers={"Cache-Control": "private, max-age=86400"})


# An image is sent this much at a time, each piece once the client has taken most of the one
# before (uvicorn's flow control). Written whole, the unsent rest of an image (up to 20 MB) waited
# in the transport's buffer, a copy per request, for as long as its client did not read.
IMAGE_PIECE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Image:
    """An uploaded image as it is sent: its media type and bytes."""

    media_type: str
    data: bytes


class InputsSent:
    """The uploaded images being sent now, each held once however many answers send it.

    A client takes an answer as slowly as it likes, pausing up to GPUJOBS_CLIENT_TIMEOUT_S each
    time (app/api/connections.py): with a copy per request, a client with N connections that read
    one image slowly made the API hold N copies of up to 20 MB. A request for an image being sent
    shares that copy rather than read another from the database; it goes when the last answer
    sending it ends (weak references: no count to get wrong). Requests for one image at the same
    moment may each read it; all copies but the first kept are dropped at once.
    """

    def __init__(self) -> None:
        # By the manager's image reader as well as the id: the apps of two databases in one
        # process (as tests run them) have ids in common.
        self._sending: weakref.WeakValueDictionary[tuple[object, int | None], Image] = (
            weakref.WeakValueDictionary()
        )

    async def read(self, manager: manager_.JobManager, job_id: uuid.UUID, *, owner: str | None) -> Image:
        """The job's uploaded image: 404 if `owner` may not read the job, 410 if retention deleted it."""
        job = await manager.get(job_id, owner=owner)
        key = (manager.inputs, job.input_id)
        if (image := self._sending.get(key)) is None:
            media_type, data = await manager.inputs.by_id(job.input_id)  # 410 for no image
            image = self._sending.setdefault(key, Image(media_type, data))
        return image


INPUTS_SENT = InputsSent()


class ImageResponse(StreamingResponse):
    """An image, sent IMAGE_PIECE_BYTES at a time as its client takes it, with its length."""

    def __init__(self, image: Image, *, headers: Mapping[str, str]) -> None:
        length = {"Content-Length": str(len(image.data))}
        super().__init__(_pieces(image), media_type=image.media_type, headers={**headers, **length})


async def _pieces(image: Image) -> AsyncIterator[memoryview]:
    """The bytes of `image`, in pieces; `image` is held (for `InputsSent`) until the answer ends."""
    view = memoryview(image.data)
    for start in range(0, len(view), IMAGE_PIECE_BYTES):
        yield view[start : start + IMAGE_PIECE_BYTES]


@router.get("/{job_id}/events", response_model=list[EventPublic], responses=ERRORS)
async def get_events(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> list[EventPublic]:
    """The job's history: submitted, claimed, started, progress, retries, recovery, the end."""
    return [EventPublic.of(e) for e in await services.manager.events(job_id, owner=caller.owner_filter)]


@router.post(
    "/{job_id}/cancel",
    response_model=CancelPublic,
    responses={**ERRORS, 409: {"model": ErrorPublic, "description": "The job already ended"}},
)
async def cancel_job(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> CancelPublic:
    """Cancel a job: queued ones at once, running ones within a heartbeat."""
    state, attempt = await services.manager.cancel(job_id, owner=caller.owner_filter, by=caller.principal)
    if state is JobState.canceled and attempt > 0:  # ended while it waited: its lost attempts' files go
        await asyncio.to_thread(services.store.drop_attempts, job_id, upto=attempt)
    return CancelPublic(id=job_id, state=state)
