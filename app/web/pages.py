"""The web page's routes: the jobs list with the submit form, a job's page, the admin page.

Pages are rendered on the server from the same services the API uses; the page's scripts then keep
them current through the API itself (`/jobs/{id}/stream`, `POST /jobs`, cancel, retry) and the
fragments below, which re-render one part of a page with the same template. Every route here needs
a key like the API (`security.Authenticate`; a browser without one is sent to the sign-in page),
sees what the caller's key sees, and is left out of the OpenAPI document.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.routing import APIRoute

from app import errors, registry, storage
from app.api import admin, paths, security
from app.api.deps import Caller, CallerDep, ServicesDep, caller_of
from app.queue import manager as manager_
from app.queue.jobs import RETRYABLE_STATES, Job, JobState
from app.web import session, views

router = APIRouter(prefix="/ui", include_in_schema=False)

PAGE_SIZE = 50
FAILED_SHOWN = 50
LOG_TAIL_BYTES = 64 * 1024
MESH_FORMATS = {".glb": "glb", ".gltf": "glb", ".stl": "stl", ".obj": "obj"}
# The web page's routes that take a body without a key, with their own limit (api.limits.BodyLimit).
BODY_LIMITS = {session.SESSION_PATH: session.SIGN_IN_LIMIT}


def install(app: FastAPI) -> None:
    """Serve the web page from `app`: its routes, and its static files under /ui/static."""
    app.include_router(session.router)
    app.include_router(router)
    app.mount(views.STATIC_URL, views.StaticAssets(directory=views.STATIC_DIR), name="ui-static")


@dataclass(frozen=True, slots=True)
class Filters:
    """The jobs list's filters, from its query string; values that match nothing are dropped."""

    state: JobState | None
    model: str | None
    cursor: str | None

    @classmethod
    def parse(
        cls, state: str | None, model: str | None, cursor: str | None, models: registry.Registry
    ) -> Filters:
        """Filters from the query string (an unknown state or model shows everything)."""
        return cls(
            JobState(state) if state is not None and state in JobState.__members__ else None,
            model if model in models.models else None,
            cursor or None,
        )


def _page(
    template: str, caller: Caller | None, nav: str, *, status_code: int = 200, **context: Any
) -> Response:
    """A page (or fragment) for `caller`, with `nav` marking where it is in the menu."""
    return views.render(template, status_code=status_code, caller=caller, nav=nav, **context)


def job_id_of(text: str) -> uuid.UUID:
    """The job id in a page's path; a mistyped one is a job that does not exist (404), not a 422."""
    try:
        return uuid.UUID(text)
    except ValueError as exc:
        raise errors.JobNotFound(f"no job {text[:40]!r}") from exc


def missing_page(request: Request) -> Response | None:
    """A browser's page under /ui that no route serves (a mistyped address, a link copied with a
    slash too many): the "not found" page, with its way back to the jobs, rather than the API's
    JSON. None for anything else: scripts, the API's paths, files missing from the static folder."""
    scope = request.scope
    if not security.page_navigation(scope) or paths.served({**scope, "root_path": ""}):
        return None
    detail = paths.not_found_detail(scope, noun="page", listed=None)
    return _error(caller_of(request), errors.NotFound(detail))


def _error(caller: Caller | None, exc: errors.AppError) -> Response:
    """An error as a page: what went wrong and where to go instead."""
    return _page("error.html", caller, "", status_code=exc.status_code, message=exc.message)


@router.get("/")
async def jobs_page(
    services: ServicesDep,
    caller: CallerDep,
    state: str | None = None,
    model: str | None = None,
    cursor: str | None = None,
) -> Response:
    """The jobs list, newest first, with filters, live updates and the form for a new job."""
    filters = Filters.parse(state, model, cursor, services.models)
    try:
        page = await services.manager.listing.page(
            owner=caller.owner_filter,
            state=filters.state,
            model=filters.model,
            cursor=filters.cursor,
            limit=PAGE_SIZE,
        )
    except errors.InvalidRequest as exc:  # a stale or edited cursor
        return _error(caller, exc)
    limits = services.limits
    return _page(
        "jobs.html",
        caller,
        "jobs",
        jobs=page.jobs,
        next_cursor=page.next_cursor,
        filters=filters,
        models=sorted(services.models.models),
        states=[s.value for s in JobState],
        max_upload_bytes=limits.max_upload_bytes,
        max_pixels=limits.max_pixels,
        priority_min=limits.priority_min,
        priority_max=limits.priority_max,
    )


@router.get("/jobs/{job_id}/row")
async def job_row(job_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """One row of the jobs list, as it is now (the list's scripts swap it in)."""
    try:
        job = await services.manager.get(job_id_of(job_id), owner=caller.owner_filter)
    except errors.NotFound as exc:
        return _error(caller, exc)
    return _page("_job_row.html", caller, "jobs", job=job)


async def _job_context(services: ServicesDep, caller: Caller, text: str) -> dict[str, Any]:
    """What the job page and its live fragment show."""
    job_id = job_id_of(text)
    job, events = await services.manager.job_and_events(job_id, owner=caller.owner_filter)
    log = await asyncio.to_thread(log_tail, services.store, job)
    mesh = next((r for r in job.results if Path(r.name).suffix.lower() in MESH_FORMATS), None)
    return {
        "job": job,
        "events": events,
        "log": log,
        "mesh": mesh,
        "mesh_format": MESH_FORMATS[Path(mesh.name).suffix.lower()] if mesh else None,
        "retryable": caller.admin and job.expired_at is None and job.state in RETRYABLE_STATES,
    }


@router.get("/jobs/{job_id}")
async def job_page(job_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """A job: input, parameters, state, 3D preview and downloads, history and log."""
    try:
        context = await _job_context(services, caller, job_id)
    except errors.NotFound as exc:
        return _error(caller, exc)
    spec = services.models.models.get(context["job"].model)
    return _page("job.html", caller, "jobs", spec=spec, **context)


@router.get("/jobs/{job_id}/live")
async def job_live(job_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """The parts of the job page that change while it runs (its scripts swap them in)."""
    try:
        context = await _job_context(services, caller, job_id)
    except errors.NotFound as exc:
        return _error(caller, exc)
    return _page("_job_live.html", caller, "jobs", **context)


@router.get("/jobs/{job_id}/files/{name}")
async def job_file(job_id: str, name: str, services: ServicesDep, caller: CallerDep) -> Response:
    """A result file or log of a visible job: a redirect to a fresh signed link."""
    try:
        job = await services.manager.get(job_id_of(job_id), owner=caller.owner_filter)
        if job.expired_at is not None:
            raise errors.Gone(f"the files of job {job_id} were deleted by retention")
        services.store.resolve(job, name)  # 404 unless the job has this file
    except (errors.NotFound, errors.Gone) as exc:
        return _error(caller, exc)
    return RedirectResponse(services.signer.url(job.id, name), status_code=303)


def log_tail(store: storage.ResultStore, job: Job) -> dict[str, Any] | None:
    """The end of the latest attempt's log: {text, name, truncated}, or None before the first."""
    if job.attempt == 0 or job.expired_at is not None:
        return None
    name = f"attempt-{job.attempt}.log"
    try:
        path, _, _ = store.resolve(job, name)
        if path is None:  # the run printed nothing (yet)
            return {"text": "", "name": name, "truncated": False}
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - LOG_TAIL_BYTES))
            data = f.read()
    except (errors.NotFound, OSError):
        return None
    truncated = size > LOG_TAIL_BYTES
    text = data.decode("utf-8", errors="replace")
    if truncated:  # from the first whole line; a progress bar redraws its line after a \r
        breaks = [at for at in (text.find("\n"), text.find("\r")) if at >= 0]
        text = text[min(breaks) + 1 :] if breaks else text  # no break at all: the end, as it is
    return {"text": text, "name": name, "truncated": truncated}


# -- admin ---------------------------------------------------------------------------------------


async def failed_jobs(manager: manager_.JobManager) -> list[Job]:
    """The newest failed and quarantined jobs of everyone."""
    found: list[Job] = []
    for state in (JobState.failed, JobState.quarantined):
        found += (await manager.listing.page(state=state, limit=FAILED_SHOWN)).jobs
    found.sort(key=lambda j: j.finished_at or j.created_at, reverse=True)
    return found[:FAILED_SHOWN]


def queue_by_model(queue: list[Any]) -> list[tuple[str, dict[str, int]]]:
    """Unfinished jobs per model and state (summed over priorities), and the live workers that
    serve the model, models by name."""
    table: dict[str, dict[str, int]] = {}
    for row in queue:
        counts = table.setdefault(row.model, {"queued": 0, "scheduled": 0, "running": 0})
        counts[row.state] = counts.get(row.state, 0) + row.jobs
        counts["live_workers"] = row.live_workers
    return sorted(table.items())


async def _admin_context(request: Request, services: ServicesDep) -> dict[str, Any]:
    """What the admin page shows: the API's own answers for workers and stats, and failed jobs."""
    stats = await admin.get_stats(request, services)
    return {
        "stats": stats,
        "workers": await admin.list_workers(request, services),
        "queue": queue_by_model(stats.queue),
        "failed": await failed_jobs(services.manager),
        "models": sorted(services.models.models),
    }


def _admin_only(caller: Caller) -> Response | None:
    if caller.admin:
        return None
    return _error(caller, errors.Forbidden("the admin page needs an admin key; sign in with one"))


@router.get("/admin")
async def admin_page(request: Request, services: ServicesDep, caller: CallerDep) -> Response:
    """Workers and their GPUs, queue depth, throughput, failed jobs to retry (admins only)."""
    if (refused := _admin_only(caller)) is not None:
        return refused
    return _page("admin.html", caller, "admin", **await _admin_context(request, services))


@router.get("/admin/live")
async def admin_live(request: Request, services: ServicesDep, caller: CallerDep) -> Response:
    """The admin page's sections as they are now (its scripts swap them in)."""
    if (refused := _admin_only(caller)) is not None:
        return refused
    return _page("_admin_live.html", caller, "admin", **await _admin_context(request, services))


# HEAD where GET answers (RFC 9110), on every page and fragment: link checkers and monitors send
# it, and a signed-in one got 405 where a signed-out one was sent to sign in.
for _route in list(router.routes):
    if isinstance(_route, APIRoute) and "GET" in (_route.methods or ()):
        router.add_api_route(_route.path.removeprefix(router.prefix), _route.endpoint, methods=["HEAD"])
