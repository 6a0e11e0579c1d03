"""Signing a browser in and out of the web page.

The page's sign-in form posts the API key to `POST /ui/session`, which checks it and puts it in an
HttpOnly, SameSite=Strict cookie (Secure and `__Host-` prefixed on HTTPS): the page's scripts never
hold the key, it never appears in a URL, and `security.Authenticate` accepts the cookie like a
Bearer header (a revoked key stops working on the next request). Both routes want
`X-Requested-With`, so another site's page can neither sign a browser in with its own key nor sign
it out; a cookie set by a sibling subdomain for the parent domain is ignored over HTTPS, and over
HTTP makes two session cookies, which sign the browser out (`security.session_token`).
`DELETE /ui/session` forgets the cookie and asks the browser to drop its cache of the site.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import unquote

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from pydantic import BaseModel, Field

from app import auth, errors
from app.api import limits, security
from app.api.deps import ServicesDep
from app.web import views

router = APIRouter(include_in_schema=False)

SESSION_MAX_AGE_S = 12 * 3600
HOME = "/ui/"
SESSION_PATH = "/ui/session"
# The sign-in route needs no key, so anyone may post to it: its body (one key of at most 128
# characters) is refused past a few kB while it arrives, before FastAPI reads and parses it as JSON.
SIGN_IN_LIMIT = limits.SizeLimit(
    4096, 'a sign-in sends one API key, as {"key": "gpj_..."}: this body is larger than 4 kB'
)
# Only pages of this site may be returned to after signing in: no scheme, no host, no `//`.
_NEXT = re.compile(r"/ui(/[A-Za-z0-9._~%/-]*)?(\?[A-Za-z0-9._~%&=+-]*)?")
_DOTS = re.compile(r"(^|/)\.\.?(/|$)")  # a `.` or `..` path segment


class SignIn(BaseModel):
    """The sign-in form."""

    key: str = Field(max_length=auth.MAX_KEY_CHARS)


class SignedIn(BaseModel):
    """Who the browser is now signed in as."""

    principal: str
    admin: bool


# Worded for these routes: security.CROSS_SITE speaks of a request signed in by the cookie, and a
# sign-in has none yet.
SESSION_CROSS_SITE = (
    "refused: signing in or out must carry the header X-Requested-With (the web page's sign-in form "
    "sends it; a form on another site cannot)"
)


def same_origin(request: Request) -> None:
    """Refuse (403) a sign-in or sign-out without `X-Requested-With`: a form or link from another
    site (login CSRF, a forced sign-out)."""
    if security.CSRF_HEADER not in request.headers:
        raise errors.Forbidden(SESSION_CROSS_SITE)


def safe_next(target: str | None) -> str:
    """Where to go after signing in: `target` if it is a page of this site, else the jobs page.
    No dot segments, plain or %-encoded: a browser resolves `/ui/../docs` to `/docs`. None longer
    than `security.MAX_NEXT_CHARS` either (no page of ours is)."""
    if not target or len(target) > security.MAX_NEXT_CHARS:
        return HOME
    path = target.partition("?")[0]
    if _NEXT.fullmatch(target) and "//" not in target and not _DOTS.search(unquote(path)):
        return target
    return HOME


@router.get("/")
async def root() -> RedirectResponse:
    """The service's root opens the web page."""
    return RedirectResponse(HOME, status_code=303)


@router.get("/ui")
async def page_without_slash() -> RedirectResponse:
    """The web page's address typed without its slash opens it (the app redirects no other path:
    app/api/paths.py)."""
    return RedirectResponse(HOME, status_code=303)


# HEAD where GET answers (RFC 9110): uptime monitors check the address a person opens, often so.
for _path, _page in (("/", root), ("/ui", page_without_slash)):
    router.add_api_route(_path, _page, methods=["HEAD"])


def two_sessions(request: Request) -> bool:
    """Whether the browser sent the session cookie twice (see `security.session_cookies`)."""
    return len(security.session_cookies(request.scope)) > 1


@router.get("/ui/sign-in")
async def sign_in_page(
    request: Request, next_: Annotated[str | None, Query(alias="next")] = None
) -> Response:
    """The sign-in page (saying so when the browser sends two session cookies)."""
    problem = security.TWO_SESSIONS if two_sessions(request) else ""
    return views.render("signin.html", caller=None, nav="", next=safe_next(next_), problem=problem)


router.add_api_route("/ui/sign-in", sign_in_page, methods=["HEAD"])


@router.post(SESSION_PATH, dependencies=[Depends(same_origin)])
async def sign_in(body: SignIn, request: Request, services: ServicesDep) -> Response:
    """Check the key and keep it in the session cookie; 401 if it is not a valid key, 409 while the
    browser sends two session cookies (a new one would not end that)."""
    if two_sessions(request):
        return JSONResponse({"detail": security.TWO_SESSIONS}, status_code=409)
    try:
        identity = await services.keys.verify(body.key.strip())
    except auth.Unauthorized:
        return JSONResponse({"detail": "that is not a valid API key (or it was revoked)"}, status_code=401)
    response = JSONResponse(SignedIn(principal=identity.principal, admin=identity.admin).model_dump())
    response.set_cookie(
        security.session_cookie_name(request.scope),
        body.key.strip(),
        max_age=SESSION_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.delete(SESSION_PATH, status_code=204, dependencies=[Depends(same_origin)])
async def sign_out(request: Request) -> Response:
    """Forget the session cookie, and what the browser cached of this site."""
    # A job's input is cached for a day (app/api/jobs.py) and would be shown without a key to the
    # next person at this browser; browsers that do not know the header ignore it.
    response = Response(status_code=204, headers={"Clear-Site-Data": '"cache"'})
    response.delete_cookie(
        security.session_cookie_name(request.scope),
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response
