"""Operations: GET /metrics, the request middleware (id, latency, log line), and the process's observers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response, routing
from fastapi.responses import PlainTextResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import db, logs, metrics, notify, retention
from app.api.deps import Services
from app.settings import Settings

router = APIRouter(tags=["ops"])
log = logging.getLogger("gpujobs.http")

REQUEST_ID_HEADER = "x-request-id"
_GOOD_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_JOB_LOCATION = re.compile(r"^/jobs/([0-9a-f-]{36})$")
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # logged at DEBUG: probes and scrapes


@router.get("/metrics", response_class=Response, responses={200: {"content": {metrics.CONTENT_TYPE: {}}}})
async def get_metrics(request: Request) -> Response:
    """Prometheus metrics: jobs, queue, workers and GPUs (from the database) and this process's HTTP."""
    body = await request.app.state.metrics.render()
    return Response(body, media_type=metrics.CONTENT_TYPE)


# HEAD where GET answers (RFC 9110), for the checks that send it; the same handler, its body dropped.
router.add_api_route("/metrics", get_metrics, methods=["HEAD"], include_in_schema=False)


def request_id(scope: Scope) -> str:
    """The client's X-Request-ID if it is a sane token, else a new one."""
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = bytes(value).decode("latin-1")
            if _GOOD_ID.match(text):
                return text
    return uuid.uuid4().hex


def route_of(scope: Scope) -> str:
    """The route template that served the request, or would have ("unmatched": no route has it)."""
    route = scope.get("route") or _route_for(scope)
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


def _route_for(scope: Scope) -> BaseRoute | None:
    """The route the router would pick (full match, else one for another method), for a request
    answered before routing (401, 403, 413, 429): matched only then, so others pay nothing."""
    partial = None
    for context in routing.iter_route_contexts(scope["app"].routes):  # included routers' routes too
        route = context.route
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial


def job_of(scope: Scope, location: str) -> str | None:
    """The job a request was about: in its path, or the one it created (POST /jobs answers Location)."""
    in_path = scope.get("path_params", {}).get("job_id")
    if in_path is not None:
        return str(in_path)
    found = _JOB_LOCATION.match(location)
    return found[1] if found else None


class RequestContext:
    """ASGI middleware (outermost): request id in the log context and the response, latency, a log line.

    Latency is measured until the response headers are sent, so long downloads and event streams
    count the time the service took to answer, not the client's reading.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        started = time.perf_counter()
        answer: dict[str, Any] = {}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = int(message["status"])
                answer["seconds"] = time.perf_counter() - started
                answer["location"] = dict(message.get("headers", [])).get(b"location", b"").decode("latin-1")
                headers = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        with logs.bound(request_id=rid):
            try:
                await self.app(scope, receive, sending)
            except Exception:  # uvicorn logs it too, but outside this context: no request id there
                log.exception(
                    "%s %s failed",
                    scope["method"],
                    scope["path"],
                    extra={"action": "http_error", "route": route_of(scope)},
                )
                if "status" not in answer:  # Starlette's own 500 would go out without the request id
                    await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, sending)
                raise
            finally:
                self._record(scope, answer, time.perf_counter() - started)

    def _record(self, scope: Scope, answer: dict[str, Any], total_s: float) -> None:
        status = int(answer.get("status", 500))
        seconds = float(answer.get("seconds", total_s))
        route = route_of(scope)
        registry: metrics.Metrics | None = getattr(scope["app"].state, "metrics", None)
        if registry is not None:
            registry.http.labels(scope["method"], route, str(status)).observe(seconds)
        job_id = job_of(scope, answer.get("location", ""))
        level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
        log.log(
            level,
            "%s %s %d",
            scope["method"],
            scope["path"],  # never the query string: signed links carry their signature there
            status,
            extra={
                "action": "http_request",
                "route": route,
                "status": status,
                "ms": round(seconds * 1000, 1),
                **({"job_id": job_id} if job_id else {}),
            },
        )


class Observability:
    """What one API process runs for observability: the job feed (LISTEN), metrics, retention, disk usage."""

    def __init__(self, app: FastAPI) -> None:
        settings: Settings = app.state.settings
        services: Services = app.state.services
        assert settings.database_url
        self.feed = notify.JobFeed(db.asyncpg_dsn(settings.database_url))
        app.state.feed = self.feed
        app.state.metrics = metrics.Metrics(
            services.manager,
            cache_s=settings.metrics_cache_s,
            dead_after_s=settings.dead_worker_after_s,
            models=services.models.models,
            storage_dir=settings.storage_dir,
        )
        app.state.pruner = retention.Pruner(services.manager, settings.storage_dir)
        app.state.disk_usage = retention.DiskUsage(settings.storage_dir)
        self._task: asyncio.Task[None] | None = None
        self._metrics: metrics.Metrics = app.state.metrics

    def start(self) -> Observability:
        """Start listening for job changes (reconnects by itself)."""
        self._task = asyncio.create_task(self.feed.run(), name="job-feed")
        return self

    async def stop(self) -> None:
        """Stop listening, and stop counting the job history if that is still under way."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._metrics.aclose()
