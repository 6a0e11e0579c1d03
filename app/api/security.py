"""Who may call what, and the headers every answer carries.

`Authenticate` checks the API key of every request before the route runs and before its body is
read, so an anonymous client cannot make the service parse an upload. Only these need no key:
`/healthz`, `/readyz`, signed `/files/...` links, and (settings `public_metrics`, `public_docs`)
`/metrics` and the API docs. `/admin/...` needs an admin key. New routes are therefore protected
by default. The routes' `CallerDep` / `AdminDep` check the same thing again and document the
bearer scheme in OpenAPI.

`SecurityHeaders` adds the usual headers for a JSON API; `CORSMiddleware` lets the configured
browser origins (none by default) call the API with a bearer key (no cookies, no credentials).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import auth, db, errors
from app.api.limits import DRAIN_BYTES
from app.settings import Settings

log = logging.getLogger("gpujobs.security")

ALWAYS_PUBLIC = frozenset({"/healthz", "/readyz"})
PUBLIC_PREFIXES = ("/files/",)  # signed links carry their own proof
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/admin"
CHALLENGE = 'Bearer realm="gpujobs"'
MISSING_KEY = "missing API key: send `Authorization: Bearer <key>` (make one with `gpujobs keys create`)"
BAD_KEY = "invalid or revoked API key"
ADMIN_ONLY = "this needs an admin key"

HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cache-control": "no-store",  # routes that may be cached say so themselves
}
# JSON and files need nothing from a page; the docs pages load Swagger UI / ReDoc from a CDN.
API_CSP = "default-src 'none'; frame-ancestors 'none'"
HSTS = "max-age=31536000"
CORS_METHODS = ("GET", "POST")
CORS_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID")
CORS_EXPOSED = ("Location", "Retry-After", "ETag", "Content-Disposition", "WWW-Authenticate")


def docs_paths(app: FastAPI) -> frozenset[str]:
    """The paths FastAPI serves its documentation on."""
    paths = (app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url)
    return frozenset(p for p in paths if p)


def public_paths(app: FastAPI, settings: Settings) -> frozenset[str]:
    """The exact paths that need no key under these settings."""
    paths = set(ALWAYS_PUBLIC)
    if settings.public_metrics:
        paths.add(METRICS_PATH)
    if settings.public_docs:
        paths |= docs_paths(app)
    return frozenset(paths)


def admin_only(path: str) -> bool:
    """Whether `path` needs an admin key: `/admin/...`, and `/metrics` when it is not public."""
    return path in (ADMIN_PREFIX, METRICS_PATH) or path.startswith(ADMIN_PREFIX + "/")


def bearer_token(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    value = Headers(scope=scope).get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def send_json(send: Send, status: int, detail: str, headers: Iterable[tuple[str, str]] = ()) -> None:
    """Answer with `{"detail": ...}` (for middleware, which runs outside the exception handlers)."""
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode(), v.encode()) for k, v in headers),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
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


class Authenticate:
    """ASGI middleware: every request outside the public paths needs a valid key (see module doc)."""

    def __init__(self, app: ASGIApp, *, public: frozenset[str]) -> None:
        self.app = app
        self.public = public

    def is_public(self, path: str) -> bool:
        """Whether `path` is served without a key."""
        return path in self.public or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        keys: auth.KeyStore = scope["app"].state.services.keys
        try:
            identity = await keys.verify(token)
        except auth.Unauthorized:
            challenge = CHALLENGE if token is None else f'{CHALLENGE}, error="invalid_token"'
            await drain(receive)
            await send_json(
                send, 401, MISSING_KEY if token is None else BAD_KEY, [("www-authenticate", challenge)]
            )
            return
        except Exception as exc:
            if not db.is_unavailable(exc):
                raise
            log.warning("database unavailable", extra={"action": "db_down", "path": scope["path"]})
            await drain(receive)
            down = errors.Unavailable()
            await send_json(send, 503, down.message, [("retry-after", str(down.retry_after_s))])
            return
        if admin_only(scope["path"]) and not identity.admin:
            await drain(receive)
            await send_json(send, 403, ADMIN_ONLY)
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)


class SecurityHeaders:
    """ASGI middleware: security headers on every answer, unless the route set them itself."""

    def __init__(self, app: ASGIApp, *, docs: frozenset[str]) -> None:
        self.app = app
        self.docs = docs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = dict(HEADERS)
        if scope["path"] not in self.docs:
            extra["content-security-policy"] = API_CSP
        if scope.get("scheme") == "https":
            extra["strict-transport-security"] = HSTS

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                added = [(k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in present]
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        await self.app(scope, receive, with_headers)


async def _unauthorized(request: Request, exc: Exception) -> JSONResponse:
    """A route found no authenticated caller (the middleware normally answers first)."""
    assert isinstance(exc, auth.Unauthorized)
    return JSONResponse({"detail": MISSING_KEY}, status_code=401, headers={"WWW-Authenticate": CHALLENGE})


_DETAIL = {"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]}
_ANSWERS = {
    "400": "The request body could not be parsed",
    "401": "Missing, invalid or revoked API key",
    "403": "Not an admin key",
}


def _answer(code: str) -> dict[str, Any]:
    return {"description": _ANSWERS[code], "content": {"application/json": {"schema": _DETAIL}}}


def document(app: FastAPI, public: frozenset[str]) -> None:
    """Let the OpenAPI document say what `Authenticate` does, for every route, present or future.

    Each operation outside the public paths gets the bearer scheme and a 401 (admin ones a 403);
    each that takes a body, the 400 for one that cannot be parsed at all.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # FastAPI keeps it in app.openapi_schema: changed in place, once
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                _describe(path, operation, path in public or path.startswith(PUBLIC_PREFIXES))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(path: str, operation: dict[str, Any], public: bool) -> None:
    responses = operation.setdefault("responses", {})
    if "requestBody" in operation:
        responses.setdefault("400", _answer("400"))
    if public:
        return
    operation.setdefault("security", [{"apiKey": []}])
    responses.setdefault("401", _answer("401"))
    if admin_only(path):
        responses.setdefault("403", _answer("403"))


def install(app: FastAPI, settings: Settings) -> None:
    """Add authentication, security headers and CORS to `app` (call after the other middleware)."""
    app.add_exception_handler(auth.Unauthorized, _unauthorized)
    public = public_paths(app, settings)
    document(app, public)
    app.add_middleware(Authenticate, public=public)
    app.add_middleware(SecurityHeaders, docs=docs_paths(app))
    origins = settings.cors_origin_list
    if origins:  # outermost, so that 401, 413 and 429 answers carry the CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=CORS_METHODS,
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED,
            allow_credentials=False,
            max_age=600,
        )


async def announce_missing_admin(keys: auth.KeyStore) -> None:
    """On a database without an admin key, tell the operator how to make the first one."""
    try:
        has_admin = await keys.has_admin()
    except Exception as exc:
        if not db.is_unavailable(exc):
            raise
        return  # requests will answer 503 until the database is back; nothing to tell yet
    if not has_admin:
        log.warning(
            "no admin API key exists yet; every request except /healthz, /readyz and signed links needs "
            "a key. Make the first one with: gpujobs keys create admin --admin",
            extra={"action": "no_admin_key"},
        )
