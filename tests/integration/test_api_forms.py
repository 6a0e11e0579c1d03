"""A body that is not what a route takes gets a 422 that says how to send it, as one sentence."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tests.conftest import png_bytes
from tests.integration.test_api_intake import counts


async def test_a_json_body_on_post_jobs_is_told_to_send_a_multipart_form(client, engine):
    """A JSON body got FastAPI's list of field errors, `model` "Field required" though the body held
    one, and never said that the route takes multipart/form-data."""
    answer = await client.post("/jobs", json={"model": "toy", "image": "photo.png"})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str), detail
    assert detail.startswith("POST /jobs takes multipart/form-data, not application/json:"), detail
    for named in ("image (a file part)", "model", "priority", "params", "curl -F image=@photo.png"):
        assert named in detail, detail
    no_body = await client.post("/jobs")
    assert (
        no_body.status_code == 422
        and "takes multipart/form-data, not an empty body" in no_body.json()["detail"]
    )
    assert await counts(engine) == (0, 0, 0)


async def test_an_image_sent_as_a_text_field_is_told_to_send_a_file_part(client, engine):
    """`curl -F image=abc` (the @ forgotten) got "Value error, Expected UploadFile, received: <class
    'str'>": a Python class name, and no word on how to send the image."""
    answer = await client.post("/jobs", files={"image": (None, "photo.png"), "model": (None, "toy")})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == (
        "image: sent as a text field, not a file; send it as a file part"
        " (curl -F image=@photo.png: the @ sends the file)"
    )
    good = await client.post(
        "/jobs", files={"image": ("a.png", png_bytes(), "image/png"), "model": (None, "toy")}
    )
    assert good.status_code == 201, good.text
    assert (await counts(engine))[:2] == (1, 1)


async def test_a_prune_with_no_body_prunes_as_with_an_empty_object(client):
    """Both fields of POST /admin/prune are optional, yet no body at all was a 422 list ("body:
    Field required"); it now runs retention now, as `{}` does."""
    answer = await client.post("/admin/prune")
    assert answer.status_code == 200, answer.text
    assert answer.json()["jobs"] == 0 and answer.json()["dry_run"] is False


async def test_a_bulk_retry_with_no_body_retries_as_with_an_empty_object(client):
    """The README: POST /admin/jobs/retry takes a JSON filter, "none: every one". `curl -X POST
    .../admin/jobs/retry` with no body got FastAPI's list, `[{"type": "missing", "loc": ["body"],
    "msg": "Field required"}]`."""
    answer = await client.post("/admin/jobs/retry")
    assert answer.status_code == 200, answer.text
    assert answer.json()["retried"] == 0


async def test_a_json_filter_sent_as_a_form_is_told_to_send_json(client, engine):
    """`curl -d '{"model": "toy"}' ...` without `-H 'Content-Type: application/json'` (curl then says
    application/x-www-form-urlencoded) got `[{"type": "model_attributes_type", "loc": ["body"], "msg":
    "Input should be a valid dictionary or object to extract fields from"}]` from the admin routes
    that take JSON: no word on the header that was missing. So did a bulk cancel with no body."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    before = await counts(engine)
    for path, body, headers in (
        ("/admin/jobs/retry", b'{"model": "toy"}', form),
        ("/admin/jobs/cancel", b'{"model": "toy"}', form),
        ("/admin/prune", b'{"dry_run": true}', form),
        ("/admin/jobs/cancel", b"", {}),
    ):
        answer = await client.post(path, content=body, headers=headers)
        assert answer.status_code == 422, (path, answer.text)
        detail = answer.json()["detail"]
        assert isinstance(detail, str) and detail.startswith(f"POST {path} takes a JSON object"), detail
        sent = "application/x-www-form-urlencoded" if body else "an empty body"
        assert f"(Content-Type: application/json), not {sent}; e.g. curl -H" in detail, detail
    assert await counts(engine) == before
    answer = await client.post("/admin/jobs/cancel", json={"model": "toy"})  # sent as it should be
    assert answer.status_code == 200, answer.text


def _form_cut_before_its_end(image: bytes, boundary: str) -> bytes:
    """A multipart form of model, image and params (last), whose closing delimiter never came."""
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="%s"%s\r\n\r\n'
    return (
        (part % ("model", "")).encode() + b"toy\r\n"
        + (part % ("image", '; filename="a.png"\r\nContent-Type: image/png')).encode() + image + b"\r\n"
        + (part % ("params", "")).encode() + b'{"steps": 7}\r\n'
    )  # fmt: skip  # no "--{boundary}--": the form never ended


async def test_a_form_cut_before_its_closing_boundary_is_400_not_queued_with_defaults(client, engine):
    """A form whose body ended before its closing delimiter (`--boundary--`: a client that counted
    its Content-Length in characters, not bytes, or a body cut short) was parsed as far as it went,
    its last, unfinished part dropped without a word: here `params`, so the job was queued (201)
    to run with the model's defaults instead of what was asked for."""
    boundary = "b0undary"
    body = _form_cut_before_its_end(png_bytes(), boundary)
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}

    async def in_pieces() -> AsyncIterator[bytes]:  # no Content-Length: chunked, Starlette's spool
        yield body

    for content in (body, in_pieces()):
        answer = await client.post("/jobs", content=content, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["detail"].startswith("the multipart form ends before its closing boundary"), (
            answer.text
        )
    assert await counts(engine) == (0, 0, 0)
    whole = body + f"--{boundary}--\r\n".encode()  # the same form, ended
    assert (await client.post("/jobs", content=whole, headers=headers)).status_code == 201
