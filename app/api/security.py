"""Who may call what, and the headers every answer carries.

`Authenticate` checks the API key of every request before the route runs and before its body is
read, so an anonymous client cannot make the service parse an upload. Only these need no key:
`/healthz`, `/readyz`, signed `/files/...` links, and (settings `public_metrics`, `public_docs`)
`/metrics` and the API docs; for the web page (`app/web`), `/`, its sign-in page and route and its
static files (the sign-in route's body is cut off past a few kB before it is parsed: `BodyLimit`
in app/api/limits.py). `/admin/...` needs an admin key. New routes are therefore protected by
default. A path no route serves is a 404 without a key while the docs are public (app/api/paths.py:
/openapi.json names the paths anyway; the routes' patterns decide, so no job id is looked up).
The routes' `CallerDep` / `AdminDep` check the same thing again and document the bearer scheme in
OpenAPI.

The key comes from `Authorization: Bearer <key>` or, for the web page, from its HttpOnly session
cookie: `__Host-gpujobs_key` over HTTPS (a browser refuses that name with a `Domain`, so a sibling
subdomain cannot set it), `gpujobs_key` over plain HTTP. A request that carries the session cookie
twice is signed out: a sibling subdomain may have set one for the parent domain (cookie tossing),
and taking either could sign the browser in as someone else. A request authenticated by the
cookie that may change something (not GET, HEAD, OPTIONS) must carry `X-Requested-With`: the page's
scripts send it, and another site cannot (the header needs a CORS preflight, which never allows
credentials), so a forged form or link from elsewhere is refused (CSRF). A browser opening a page
without a valid key is sent to the sign-in page.

`SecurityHeaders` adds the usual headers for a JSON API; `CORSMiddleware` lets the configured
browser origins (none by default) call the API with a bearer key (no cookies, no credentials).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import auth, checkout, db
from app.api import deps, docs, limits, paths
from app.settings import Settings

log = logging.getLogger("gpujobs.security")

ALWAYS_PUBLIC = frozenset({"/healthz", "/readyz"})
# The web page's entry point, sign-in page and sign-in route need no key: they are how a browser gets one.
PAGE_PUBLIC = frozenset({"/", "/ui/sign-in", "/ui/session"})
PUBLIC_PREFIXES = ("/files/", "/ui/static/")  # signed links carry their own proof; static assets
PAGE_PREFIX = "/ui"
SIGN_IN_PATH = "/ui/sign-in"
MAX_NEXT_CHARS = 500  # a longer page to return to after signing in is dropped: the jobs page instead
SESSION_COOKIE = "gpujobs_key"  # HttpOnly, SameSite=Strict: set by app/web/session.py
HOST_COOKIE_PREFIX = "__Host-"  # over HTTPS: Secure, Path=/, and no Domain, or the browser drops it
CSRF_HEADER = "x-requested-with"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/admin"
CHALLENGE = 'Bearer realm="gpujobs"'
MISSING_KEY = "missing API key: send `Authorization: Bearer <key>` (make one with `gpujobs keys create`)"
NO_BEARER = (
    "the Authorization header has no Bearer scheme: send the key as `Authorization: Bearer <key>` "
    "(the word Bearer, a space, then the key)"
)
BAD_KEY = "invalid or revoked API key"
ADMIN_ONLY = "this needs an admin key"
CROSS_SITE = "refused: a request signed in by the web page's cookie must carry X-Requested-With"
TWO_SESSIONS = (
    "two session cookies were sent, perhaps one set by another site under the parent domain: "
    "clear this site's cookies in the browser and sign in again"
)

HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cache-control": "no-store",  # routes that may be cached say so themselves
}
# JSON and files need nothing from a page; the pages (app/web, /docs) set their own.
API_CSP = "default-src 'none'; frame-ancestors 'none'"
HSTS = "max-age=31536000"
CORS_METHODS = ("GET", "POST")
CORS_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID")
CORS_EXPOSED = ("Location", "Retry-After", "ETag", "Content-Disposition", "WWW-Authenticate")


def docs_paths(app: FastAPI) -> frozenset[str]:
    """The paths of the API's documentation: its page (app/api/docs.py) and the OpenAPI document."""
    return frozenset(p for p in (docs.DOCS_PATH, app.openapi_url) if p)


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


def session_cookie_name(scope: Scope) -> str:
    """The session cookie's name for this request: `__Host-` prefixed over HTTPS."""
    return HOST_COOKIE_PREFIX + SESSION_COOKIE if scope.get("scheme") == "https" else SESSION_COOKIE


def session_cookies(scope: Scope) -> list[str]:
    """Every value of the session cookie in the request (Starlette's parser keeps only the last)."""
    name = session_cookie_name(scope)
    found = []
    for header in Headers(scope=scope).getlist("cookie"):
        for pair in header.split(";"):
            key, _, value = pair.partition("=")
            if key.strip() == name:
                found.append(value.strip())
    return found


def session_token(scope: Scope) -> str | None:
    """The API key in the web page's session cookie, if it was sent once (twice: see module doc)."""
    values = session_cookies(scope)
    return (values[0] or None) if len(values) == 1 else None


def page_navigation(scope: Scope) -> bool:
    """Whether a browser is opening a page of the web UI (not a script's request)."""
    path: str = scope["path"]
    return (
        (path == PAGE_PREFIX or path.startswith(PAGE_PREFIX + "/"))
        and scope["method"] in ("GET", "HEAD")
        and CSRF_HEADER not in Headers(scope=scope)
    )


async def send_sign_in(scope: Scope, send: Send) -> None:
    """Send a browser to the sign-in page, to come back to the page it asked for (unless too long)."""
    target = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
    location = (
        SIGN_IN_PATH if len(target) > MAX_NEXT_CHARS else f"{SIGN_IN_PATH}?{urlencode({'next': target})}"
    )
    headers = [(b"location", location.encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


class Authenticate:
    """ASGI middleware: every request outside the public paths needs a valid key (see module doc)."""

    def __init__(self, app: ASGIApp, *, public: frozenset[str], paths_public: bool = True) -> None:
        self.app = app
        self.public = public
        # Whether a path no route serves is a 404 without a key (it is with the docs public).
        self.paths_public = paths_public

    def is_public(self, path: str) -> bool:
        """Whether `path` is served without a key."""
        return path in self.public or path in PAGE_PUBLIC or path.startswith(PUBLIC_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is None and (token := session_token(scope)) is not None:
            if scope["method"] not in SAFE_METHODS and CSRF_HEADER not in Headers(scope=scope):
                await limits.refuse(scope, receive, send, 403, CROSS_SITE)
                return
        keys: auth.KeyStore = scope["app"].state.services.keys
        try:
            identity = await keys.verify(token)
        except auth.Unauthorized:
            if self.paths_public and not paths.served(scope):  # asked only once refused: it costs
                await paths.refuse(scope, receive, send)
            else:
                await self._refuse_key(scope, receive, send, token)
            return
        except Exception as exc:
            if (down := deps.unavailable(exc)) is None:
                raise
            log.warning("database unavailable", extra={"action": "db_down", "path": scope["path"]})
            await limits.refuse(
                scope, receive, send, 503, down.message, [("retry-after", str(down.retry_after_s))]
            )
            return
        if admin_only(scope["path"]) and not identity.admin:
            await limits.refuse(scope, receive, send, 403, ADMIN_ONLY)
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse_key(scope: Scope, receive: Receive, send: Send, token: str | None) -> None:
        """Send a browser to sign in; answer a script 401, saying what is wrong with its key."""
        if page_navigation(scope):
            await send_sign_in(scope, send)
            return
        detail, error = _what_is_wrong(scope, token)
        challenge = f'{CHALLENGE}, error="{error}"' if error else CHALLENGE
        await limits.refuse(scope, receive, send, 401, detail, [("www-authenticate", challenge)])


def _what_is_wrong(scope: Scope, token: str | None) -> tuple[str, str | None]:
    """A refused request's 401: its detail and the challenge's RFC 6750 error (None: no credentials)."""
    if token is not None:
        return BAD_KEY, "invalid_token"
    if len(session_cookies(scope)) > 1:
        return TWO_SESSIONS, "invalid_token"
    # A key sent bare (`Authorization: gpj_...`) or under another scheme was "missing": the user
    # then looked for a fault in the key, not in the header.
    scheme = Headers(scope=scope).get("authorization", "").strip().partition(" ")[0]
    if scheme and scheme.lower() != "bearer":
        return NO_BEARER, "invalid_request"
    return MISSING_KEY, None


class SecurityHeaders:
    """ASGI middleware: security headers on every answer, unless the route set them itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = {**HEADERS, "content-security-policy": API_CSP}
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
    app.add_middleware(Authenticate, public=public, paths_public=settings.public_docs)
    app.add_middleware(SecurityHeaders)
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


# How long the start-up waits on the database for that: not asyncpg's 60 s connect timeout, which
# held the start (and /healthz) while a database host took connections and never answered.
ANNOUNCE_TIMEOUT_S = 5.0


async def announce_missing_admin(keys: auth.KeyStore, public: frozenset[str], settings: Settings) -> None:
    """On a database without an admin key, tell the operator how to make the first one (and what
    answers without a key: `public`, the paths public_paths gives)."""
    try:
        async with asyncio.timeout(ANNOUNCE_TIMEOUT_S):
            has_admin = await keys.has_admin()
    except Exception as exc:
        if not db.is_unavailable(exc):
            raise
        return  # requests will answer 503 until the database is back; nothing to tell yet
    if not has_admin:
        log.warning(
            "no admin API key exists yet; every request needs a key except %s, signed links and the "
            "sign-in page. Make the first one with: %s",
            ", ".join(sorted(public)),
            first_key_command(settings),
            extra={"action": "no_admin_key"},
        )


def first_key_command(settings: Settings) -> str:
    """The command that makes the first admin key in this service's database: typed as printed
    in another shell, without this service's GPUJOBS_STORAGE_DIR, it made the key in the
    checkout's own embedded database (made on the spot if need be), which this service answers
    401. An external database's URL is not printed (it may hold a password)."""
    command = f"{gpujobs_command()} keys create admin --admin"
    if os.environ.get("GPUJOBS_DATABASE_URL"):
        return f"{command} (with this service's GPUJOBS_DATABASE_URL set)"
    storage = settings.storage_dir.resolve()
    if storage != checkout.STORAGE.resolve():
        return f"GPUJOBS_STORAGE_DIR={shlex.quote(str(storage))} {command}"
    return command


def gpujobs_command() -> str:
    """`gpujobs` as it can be typed here: its name when PATH finds it; else the script beside this
    Python (after `make run` that is .venv/bin/gpujobs, not on PATH: "gpujobs" was "command not
    found"), else this Python with `-m app`; a path as seen from the working folder."""
    if shutil.which("gpujobs"):
        return "gpujobs"
    script = Path(sys.executable).with_name("gpujobs")
    if os.access(script, os.X_OK):
        return _typed(script)
    return f"{_typed(Path(sys.executable))} -m app"


def _typed(path: Path) -> str:
    """`path` as a command typed in the working folder: relative inside it (with a slash, or the
    shell would look it up on PATH), else whole; quoted for a shell."""
    try:
        shown = str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):  # elsewhere, or the working folder is gone
        shown = str(path)
    return shlex.quote(shown if "/" in shown else f"./{shown}")
