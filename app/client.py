"""The `gpujobs` command's HTTP client of the API: a connection, one call, and errors for people.

The client commands (app/cli_submit.py, app/cli_jobs.py, app/cli_prune.py) talk through it to a
running API (`--url` or GPUJOBS_URL) with an API key (`--key` or GPUJOBS_API_KEY). Exit codes: 0
done, 1 the job failed or was canceled, 2 the request was refused, the server could not be reached,
or what answered is not the API.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    import httpx
    from rich.console import Console

# httpx and rich are imported by the functions that use them, not with this module: every
# `gpujobs` process loads it (a worker too), and the two cost a worker about 0.15 s of CPU to start.

DEFAULT_URL = "http://127.0.0.1:8000"

Url = Annotated[str, typer.Option("--url", envvar="GPUJOBS_URL", help="The API's base URL")]
Key = Annotated[
    str | None, typer.Option("--key", envvar="GPUJOBS_API_KEY", help="API key (Bearer)", show_default=False)
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON")]


@functools.cache
def stderr() -> Console:
    """Where messages for people go: each on one line (soft_wrap), so that stderr read by a script
    or a log (no terminal: rich assumes 80 columns) never has a URL or a reason broken over lines;
    and as they are (no markup: `[/x]` in a model name or a job's error is text, not a tag)."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, markup=False)


def connect(url: str, key: str | None) -> httpx.Client:
    """An HTTP client for the API, sending the key."""
    import httpx

    if key is not None and not key.isascii():
        fail("the API key (--key, GPUJOBS_API_KEY) has characters that are not ASCII; copy it again")
    if key is not None and not all(c.isprintable() and not c.isspace() for c in key):
        # Never shown: a key read from a file keeps its line end, and the rest is the secret.
        fail(
            "the API key (--key, GPUJOBS_API_KEY) holds a space, a line end or a control character: "
            "send the key alone"
        )
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(30.0, read=60.0)  # streams send a keepalive every 15 s
    try:
        return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
    except httpx.InvalidURL as exc:
        fail(f"the API's URL (--url, GPUJOBS_URL) {url!r} is not a URL: {exc}")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print an error and exit."""
    from rich.text import Text

    stderr().print(Text.assemble(("error:", "red"), " ", message), highlight=False)
    raise typer.Exit(code)


def call(http: httpx.Client, method: str, path: str, *, expect: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """One API call; its JSON answer (an object with the keys `expect` names), or exit 2 with the
    server's `detail`, or with "not the API" for an answer the API does not give."""
    return answer(request(http, method, path, **kwargs), expect=expect)


def request(http: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request's answer, whatever its status; exit 2 when the API cannot be reached."""
    import httpx

    try:
        return http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"cannot reach {http.base_url}: {exc}")
    except httpx.InvalidURL as exc:  # a URL that parsed, but has no usable port, say
        fail(f"the API's URL (--url, GPUJOBS_URL) {str(http.base_url)!r} is not usable: {exc}")


def answer(response: httpx.Response, *, expect: tuple[str, ...] = ()) -> Any:
    """An answer's JSON (an object with the keys `expect` names), or exit 2 as `call` says."""
    body = None
    with contextlib.suppress(ValueError):
        if response.headers.get("content-type", "").startswith("application/json") or response.is_success:
            body = response.json()
    if response.status_code >= 400 and isinstance(body, dict) and "detail" in body:
        fail(f"{response.status_code}: {detail_of(response)}")
    if response.is_success and isinstance(body, dict) and all(k in body for k in expect):
        return body
    not_the_api(response)


def not_the_api(response: httpx.Response) -> NoReturn:
    """Exit 2 for an answer that is not the API's (another server's page, another shape of JSON)."""
    kind = response.headers.get("content-type", "no content type")
    fail(
        f"{response.request.url} answered {response.status_code} ({kind}): not the API; "
        "is --url (GPUJOBS_URL) the API's address?"
    )


def job_path(job_id: str) -> str:
    """The job's id as it goes into a URL (canonical); exit 2 unless it is a UUID, so that no other
    text (`../models`, `../admin/prune#`, "") makes the request for another route."""
    try:
        return str(uuid.UUID(job_id))
    except ValueError:
        fail(f"{job_id!r} is not a job id (a UUID, as `gpujobs jobs list` shows)")


def refusal(response: httpx.Response) -> str:
    """The server's detail, after ": ", of a streamed answer in the API's JSON; "" for any other
    (a proxy's page, a body not worth reading)."""
    if not response.headers.get("content-type", "").startswith("application/json"):
        return ""
    response.read()
    return f": {detail_of(response)}"


def detail_of(response: httpx.Response) -> str:
    """The server's `detail` message, or the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list) and detail and all(isinstance(e, dict) and "msg" in e for e in detail):
        return "; ".join(_validation_error(e) for e in detail)
    return str(detail)


def _validation_error(error: dict[str, Any]) -> str:
    """One of FastAPI's validation errors as `field: message` (without where the field was sent)."""
    loc = [str(part) for part in error.get("loc", [])]
    if loc and loc[0] in {"path", "query", "body", "header", "cookie"}:
        loc = loc[1:]
    return f"{'.'.join(loc)}: {error['msg']}" if loc else str(error["msg"])
