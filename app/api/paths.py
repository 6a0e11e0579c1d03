"""The paths the app serves, and the 404 for a path it does not: one that names the path meant.

FastAPI answered a path's slash twin (`POST /jobs/` for `/jobs`) with a 307 and an empty body:
`curl -s` printed nothing, and a client that followed it sent its upload a second time. The app
redirects no path (`redirect_slashes=False`, app/api/main.py); such a request gets a 404 naming
the path without (or with) the slash, and any other unknown path one that says where the paths
are listed. `Authenticate` (app/api/security.py) gives that 404 before asking for a key when the
docs are public: the paths are no secret then (/openapi.json lists them).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from app.api import docs, limits

SHOWN_PATH_CHARS = 200  # of a path echoed in the 404; the rest is cut


def served(scope: Scope) -> bool:
    """Whether a route of the app takes `scope`'s path, by any method. Nothing is looked up (to a
    route a job id is any text), so this says no more than the OpenAPI document does."""
    return any(route.matches(scope)[0] is not Match.NONE for route in scope["app"].router.routes)


LISTED = f"the API's paths are listed at {docs.DOCS_PATH}"


def not_found_detail(scope: Scope, *, noun: str = "path", listed: str | None = LISTED) -> str:
    """What the 404 of a path no route serves says: the path meant, if only a slash is off, else
    where the paths are `listed`."""
    path: str = scope["path"]
    shown = path if len(path) <= SHOWN_PATH_CHARS else path[:SHOWN_PATH_CHARS] + "…"
    twin = path.rstrip("/") if path.endswith("/") else path + "/"
    if twin and len(path) <= SHOWN_PATH_CHARS and served({**scope, "path": twin}):
        return f"no such {noun}: {shown} (did you mean {twin}?)"
    return f"no such {noun}: {shown}" + (f" ({listed})" if listed else "")


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer 404 for a path no route serves, before its body is read."""
    await limits.refuse(scope, receive, send, 404, not_found_detail(scope))


async def not_found(request: Request, exc: Exception) -> JSONResponse:
    """The router's 404 (no route took the path, or a static file is not there), saying which."""
    scope = request.scope
    if served({**scope, "root_path": ""}):  # a mount took the path (as the app saw it): no such file
        path: str = scope["path"]
        shown = path if len(path) <= SHOWN_PATH_CHARS else path[:SHOWN_PATH_CHARS] + "…"
        return JSONResponse({"detail": f"no such file: {shown}"}, status_code=404)
    return JSONResponse({"detail": not_found_detail(scope)}, status_code=404)
