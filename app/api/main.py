"""The FastAPI application: lifespan (engine, services, optional in-process worker), routers, errors."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from app import auth, db, errors, intake, learning, links, modelsfile, storage
from app.api import (
    admin,
    admission,
    catalog,
    deps,
    docs,
    files,
    fullness,
    health,
    jobs,
    ops,
    paths,
    security,
    stream,
)
from app.api.deps import Services
from app.api.limits import BodyLimit
from app.api.schemas import ErrorPublic
from app.queue import factory
from app.queue import manager as manager_
from app.queue import worker as worker_
from app.settings import Settings
from app.web import pages as web_pages

log = logging.getLogger("gpujobs.api")

# A 422 shows the start of each input it refused (enough to find it), never a key.
SHOWN_INPUT_CHARS = 100
SECRET_FIELDS = frozenset({"key", "password"})


def _link_secret(settings: Settings) -> bytes:
    if settings.link_secret:
        return settings.link_secret.encode()
    return links.load_or_create_secret(settings.storage_dir)


def check_settings(settings: Settings) -> None:
    """Refuse, with an AppError that names what to fix, what the app's start-up would refuse: the
    models file and the link secret (`gpujobs serve` calls this before it serves; inside the
    start-up the same error came out as uvicorn's traceback)."""
    modelsfile.load_registry(settings.models_file)
    links.LinkSigner(_link_secret(settings), ttl_s=settings.link_ttl_s)


def build_services(settings: Settings, manager: manager_.JobManager, keys: auth.KeyStore) -> Services:
    """Everything the routes need, from settings."""
    secret = _link_secret(settings)
    limits = intake.Limits(
        max_upload_bytes=settings.max_upload_bytes,
        max_pixels=int(settings.max_image_megapixels * 1e6),
        queue_limit=settings.queue_limit,
        priority_min=settings.priority_min,
        priority_max=settings.priority_max,
        queue_limit_per_key=settings.queue_limit_per_key,
    )
    return Services(
        manager=manager,
        store=storage.ResultStore(settings.storage_dir),
        signer=links.LinkSigner(secret, ttl_s=settings.link_ttl_s),
        models=modelsfile.load_registry(settings.models_file),
        limits=limits,
        keys=keys,
        upload_gate=asyncio.Semaphore(settings.upload_writers) if settings.upload_writers else None,
        learner=learning.VramLearner(
            manager,
            learning.LearningConfig(
                min_samples=settings.learned_vram_min_samples,
                percentile=settings.learned_vram_percentile,
                margin_mb=settings.learned_vram_margin_mb,
                above_declared=settings.learned_vram_above_declared,
                buffer_mb=settings.vram_buffer_mb,
            ),
        ),
    )


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One engine for the process; the in-process worker, if enabled, runs beside the API."""
    settings: Settings = app.state.settings
    assert settings.database_url, "create_app needs a database URL (the CLI starts the embedded one)"
    engine = db.create_engine(settings.database_url)
    app.state.engine = engine
    # The in-process worker claims and finishes on its own connections (db.create_queue_engine).
    queue_engine = db.create_queue_engine(settings.database_url) if settings.run_worker else None
    manager = manager_.JobManager(
        engine, queue_engine=queue_engine, quarantine_after=settings.quarantine_after
    )
    services = build_services(settings, manager, auth.KeyStore(engine))
    app.state.services = services
    observers = ops.Observability(app).start()  # job feed for streams, metrics, retention on demand
    app.state.exiting = asyncio.Event()  # set when the server is told to exit: event streams end
    await security.announce_missing_admin(services.keys, security.public_paths(app, settings), settings)
    task: asyncio.Task[None] | None = None
    worker: worker_.Worker | None = None
    try:
        if settings.run_worker:
            worker, task = await _start_worker(app, settings, services)
        app.state.worker = worker
        # Called by `serve`'s server from its signal handler: only the loop's thread-safe call there.
        app.state.on_exit = functools.partial(_call_soon, asyncio.get_running_loop(), _exit_asked, app)
        app.state.on_exit_now = functools.partial(_call_soon, asyncio.get_running_loop(), _exit_now, app)
        yield
    finally:
        app.state.stopping = True
        if worker is not None and task is not None:
            worker.stop()
            await asyncio.wait([task])  # how it ended is _worker_ended's to say
        await observers.stop()
        # The last uploads' NOTIFYs, given up after as long as uvicorn gives open connections.
        await manager.teller.flush(timeout_s=5)
        if queue_engine is not None:
            await queue_engine.dispose()
        await engine.dispose()


async def _start_worker(
    app: FastAPI, settings: Settings, services: Services
) -> tuple[worker_.Worker, asyncio.Task[None]]:
    """Start the in-process worker, then run it in a task of its own."""
    assert settings.database_url
    worker = factory.build_worker(
        settings,
        manager=services.manager,
        store=services.store,
        models=services.models,
        listen_dsn=db.asyncpg_dsn(settings.database_url),
    )
    # Started here, not in its task: a worker that cannot run (no GPU fits a model, or its id is
    # taken on this host) fails the start-up instead of leaving an API with no worker.
    try:
        await worker.start()
    except errors.AppError as exc:
        log.error("the in-process worker cannot start: %s", exc.message, extra={"action": "worker_refused"})
        # `gpujobs serve` says it in one line and exits 2, as `gpujobs worker` does (app.apiserver),
        # rather than uvicorn's traceback of it.
        app.state.start_refused = exc
        raise
    task = asyncio.create_task(worker.run(), name="worker")
    task.add_done_callback(functools.partial(_worker_ended, app))
    return worker, task


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[FastAPI], None], app: FastAPI) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nothing is left to stop
        loop.call_soon_threadsafe(callback, app)


def _exit_asked(app: FastAPI) -> None:
    """The server was told to exit (SIGTERM): the worker stops claiming now, and event streams end,
    not after uvicorn's wait for open connections (the streams'), which left the worker claiming,
    and its running jobs running, for that long beyond the grace. The lifespan's end waits for it."""
    app.state.stopping = True  # its end now is the server's doing, not a failure (_worker_ended)
    app.state.exiting.set()
    worker: worker_.Worker | None = getattr(app.state, "worker", None)
    if worker is not None:
        worker.stop()


def _exit_now(app: FastAPI) -> None:
    """The server was told to exit again: as `_exit_asked`, and the worker stops at once (its
    models killed, its jobs handed back unspent if the database answers within moments: see
    `Worker.stop_now`), not after its grace and final writes."""
    _exit_asked(app)
    worker: worker_.Worker | None = getattr(app.state, "worker", None)
    if worker is not None:
        worker.stop_now()


def _worker_ended(app: FastAPI, task: asyncio.Task[None]) -> None:
    """The in-process worker ended without the server stopping it (a side task of its died, or it
    raised: logged here with its traceback, the only place it is): the API must not answer ready
    and run no job. /readyz says so from now on, and `serve` (which sets `app.state.on_worker_failed`)
    stops the server and exits non-zero, so that whatever supervises the process starts it again."""
    failure = None if task.cancelled() else task.exception()
    stopping = getattr(app.state, "stopping", False)
    if stopping and failure is None:  # the server stopped it
        return
    what = "failed while stopping" if stopping else "stopped after an error"
    log.error("the in-process worker %s", what, exc_info=failure, extra={"action": "worker_ended"})
    if stopping:
        return
    app.state.worker_failed = True
    on_failed = getattr(app.state, "on_worker_failed", None)
    if on_failed is not None:
        on_failed()


class ErrorResponse(JSONResponse):
    """An error's JSON, whatever it echoes of the request: NaN and infinities as text, and half a
    surrogate pair (a JSON escape can spell one; UTF-8 cannot) as a \\u escape, not a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


async def _not_found(request: Request, exc: Exception) -> Response:
    """A path no route serves: the web page's "not found" page for a browser under /ui, else JSON."""
    page = web_pages.missing_page(request)
    return page if page is not None else await paths.not_found(request, exc)


async def _app_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.AppError)
    headers = {}
    if isinstance(exc, errors.QueueFull | errors.Unavailable):
        headers["Retry-After"] = str(exc.retry_after_s)
    return ErrorResponse({"detail": exc.message}, status_code=exc.status_code, headers=headers)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 with its list of field errors, each with the start of the input it refused."""
    assert isinstance(exc, RequestValidationError)
    return ErrorResponse({"detail": jsonable_encoder([_shown(e) for e in exc.errors()])}, status_code=422)


def _shown(error: dict[str, Any]) -> dict[str, Any]:
    """A field error as a 422 shows it: a long input cut short; none shown for a secret (a key), or
    for a body that is not JSON (a form with a key in it, posted where JSON was wanted)."""
    if "input" not in error:
        return error
    value, loc = error["input"], tuple(error.get("loc", ()))
    secret = any(str(part).lower() in SECRET_FIELDS for part in loc)
    if isinstance(value, dict):
        secret = secret or any(str(k).lower() in SECRET_FIELDS for k in value)
    if secret or (loc == ("body",) and isinstance(value, str | bytes)):
        return {k: v for k, v in error.items() if k != "input"}
    return {**error, "input": _clipped(value)}


def _clipped(value: Any) -> Any:
    """`value` whole if its JSON is short, else the first `SHOWN_INPUT_CHARS` of it (a string);
    encoded lazily, so a 20 MB list costs no more than its start."""
    if isinstance(value, str):
        return value if len(value) <= SHOWN_INPUT_CHARS else value[:SHOWN_INPUT_CHARS] + "…"
    if not isinstance(value, list | tuple | dict):
        return value
    text = ""
    for chunk in json.JSONEncoder(default=str).iterencode(value):
        text += chunk
        if len(text) > SHOWN_INPUT_CHARS:
            return text[:SHOWN_INPUT_CHARS] + "…"
    return value


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    """Database outages (or no free connection, or PostgreSQL short of disk space or memory) become
    503 with Retry-After; other database errors stay errors (500)."""
    if (down := deps.unavailable(exc)) is None:
        raise exc
    extra = {"action": "db_down", "path": request.url.path}
    log.warning("database unavailable: %s", down.message, extra=extra)
    return await _app_error(request, down)


def create_app(settings: Settings) -> FastAPI:
    """The application for these settings (the database URL must be set)."""
    app = FastAPI(
        title="gpujobs",
        summary="A durable job service for GPU models: upload an image, get a mesh.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # app/api/docs.py serves /docs from the package, not a CDN; no /redoc
        redoc_url=None,
        redirect_slashes=False,  # a path's slash twin is a 404 that names it (app/api/paths.py)
        # Any request the HTTP parser cannot read is answered 400 before it reaches a route
        # (app/api/connections.py): said of every operation, beside each one's own 400s.
        responses={400: {"model": ErrorPublic, "description": "Not a well-formed request"}},
    )
    app.state.settings = settings
    for router in (jobs.router, stream.router, files.router, catalog.router, admin.router, health.router):
        app.include_router(router)
    app.include_router(docs.router)
    app.include_router(ops.router)
    web_pages.install(app)  # the web page under /ui (left out of the OpenAPI document)
    app.add_exception_handler(errors.AppError, _app_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(404, _not_found)
    for kind in (
        sqlalchemy.exc.DBAPIError,
        sqlalchemy.exc.TimeoutError,  # no pooled connection came free
        OSError,
        asyncpg.PostgresConnectionError,
        asyncpg.InterfaceError,
        asyncpg.InsufficientResourcesError,  # its disk full, say, on a statement sent with asyncpg itself
    ):
        app.add_exception_handler(kind, _database_error)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_upload_bytes,
        per_path=web_pages.BODY_LIMITS,
        idle_s=settings.client_timeout_s,
        min_kb_per_s=settings.upload_min_kb_per_s,
    )
    # Outside BodyLimit, so that their refusals read nothing; inside Authenticate, which names the
    # caller. An upload holds its slot of GPUJOBS_UPLOADS_PER_KEY while the queue is counted for it.
    app.state.fullness = fullness.Fullness(
        queue_limit=settings.queue_limit, owner_limit=settings.queue_limit_per_key
    )
    app.add_middleware(fullness.Precheck, fullness=app.state.fullness)
    app.add_middleware(admission.Admission, caps=admission.caps(settings))
    security.install(app, settings)
    app.add_middleware(ops.RequestContext)  # outermost: every answer gets a request id, latency, a log line
    return app
