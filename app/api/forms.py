"""Routes that take a multipart form (POST /jobs) or a JSON object (the admin's actions): a body
that is not what they take gets one sentence that says how to send it.

FastAPI answers such a body with its list of field errors: a JSON body, `model` "Field required"
though the body held one, never saying that the route takes multipart/form-data; a file sent as a
text field (`curl -F image=abc`, the @ forgotten), "Expected UploadFile, received: <class 'str'>".
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from app import errors
from app.api import limits

MULTIPART = "multipart/form-data"
JSON = "application/json"
EMPTY = "an empty body"


class FormRoute(limits.UploadRoute):
    """An upload route (parsed in memory) whose refusals of a body that is not its form say what
    to send instead; routes of its router that take no form are left as they are."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        fields = [f for f in self.dependant.body_params if isinstance(f.field_info, params.Form)]
        if not fields:
            return handler
        files = {f.alias for f in fields if isinstance(f.field_info, params.File)}
        listed = ", ".join(f"{f.alias} (a file part)" if f.alias in files else f.alias for f in fields)
        example = " ".join(
            f"-F {f.alias}=@photo.png" if f.alias in files else f"-F {f.alias}=…"
            for f in fields
            if f.field_info.is_required()
        )
        takes = f"{self.path} takes {MULTIPART}, not {{sent}}: {listed}; e.g. curl {example}"

        async def form_only(request: Request) -> Response:
            sent = _content_type(request)
            if sent != MULTIPART:
                raise errors.InvalidRequest(f"{request.method} " + takes.format(sent=sent))
            try:
                return await handler(request)
            except RequestValidationError as exc:
                _refuse_text_for_file(exc, files)
                _refuse_empty_field(exc, request)
                raise

        return form_only


class JsonRoute(APIRoute):
    """A route that takes a JSON object: another body (`curl -d '{...}'` without the header sends it
    as application/x-www-form-urlencoded, which FastAPI answered "Input should be a valid
    dictionary or object to extract fields from"), or none where one is required (FastAPI:
    "Field required"), gets one sentence saying how to send it. No body, where the object may be
    left out, is the route's to read as `{}`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body = [f for f in self.dependant.body_params if not isinstance(f.field_info, params.Form)]
        if not body:
            return handler
        required = any(f.field_info.is_required() for f in body)
        takes = f"{self.path} takes a JSON object (Content-Type: {JSON})"
        example = f"e.g. curl -H 'Content-Type: {JSON}' -d '{{...}}'"

        async def json_only(request: Request) -> Response:
            sent = _content_type(request)
            if sent != JSON and not sent.endswith("+json") and (sent != EMPTY or required):
                raise errors.InvalidRequest(f"{request.method} {takes}, not {sent}; {example}")
            return await handler(request)

        return json_only


def _content_type(request: Request) -> str:
    """The request's media type, lower case, without parameters; else what it sent, in words."""
    value = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if value:
        return value
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return EMPTY
    return "a body without a Content-Type"


# What an empty required field is told to send instead, beyond "a value".
EMPTY_FIELD_HINTS = {"model": "a model's name (GET /models lists them)"}


def _refuse_empty_field(exc: RequestValidationError, request: Request) -> None:
    """InvalidRequest naming the first required field that was sent empty (`-F model=`, a script's
    unset variable): FastAPI takes an empty field for a missing one, and said "Field required" of a
    field the client did send."""
    form = getattr(request.state, "form", None)  # parsed already, for the handler's arguments
    if form is None:
        return
    for error in exc.errors():
        loc = tuple(error.get("loc", ()))
        if error.get("type") == "missing" and len(loc) == 2 and loc[0] == "body" and form.get(loc[1]) == "":
            name = str(loc[1])
            send = EMPTY_FIELD_HINTS.get(name, "a value")
            raise errors.InvalidRequest(f"form field {name!r} is empty: send {send}", field=name) from exc


def _refuse_text_for_file(exc: RequestValidationError, files: set[str]) -> None:
    """InvalidRequest naming the first file field that came as a text field, if one did."""
    for error in exc.errors():
        loc = tuple(error.get("loc", ()))
        if len(loc) == 2 and loc[0] == "body" and loc[1] in files and isinstance(error.get("input"), str):
            name = loc[1]
            raise errors.InvalidRequest(
                f"{name}: sent as a text field, not a file; send it as a file part"
                f" (curl -F {name}=@photo.png: the @ sends the file)",
                field=str(name),
            ) from exc
