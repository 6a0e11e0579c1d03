"""POST /jobs and the read endpoints, over real HTTP against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import zlib
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from sqlalchemy import text

from app import errors, images, intake
from app.queue import records
from app.queue.manager import JobManager
from app.settings import Settings
from tests.conftest import api_client, png_bytes
from tests.integration.test_worker import enqueue


async def counts(engine: Any) -> tuple[int, int, int]:
    """(jobs, inputs, events) rows in the database."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM inputs),"
                    " (SELECT count(*) FROM job_events)"
                )
            )
        ).one()
    return int(row[0]), int(row[1]), int(row[2])


async def submit(
    client: httpx.AsyncClient,
    image: bytes,
    *,
    name: str = "in.png",
    headers: dict[str, str] | None = None,
    **form: Any,
) -> httpx.Response:
    data = {"model": "relief", **{k: (json.dumps(v) if k == "params" else str(v)) for k, v in form.items()}}
    return await client.post("/jobs", files={"image": (name, image, "image/png")}, data=data, headers=headers)


async def test_upload_is_stored_and_reads_back_byte_identical(client, png, engine):
    image = png((120, 80))
    response = await submit(client, image, params={"width_mm": 80, "format": "stl"}, priority=5)
    assert response.status_code == 201, response.text
    job = response.json()
    assert response.headers["location"] == f"/jobs/{job['id']}"
    assert job["state"] == "queued"
    assert job["model"] == "relief"
    assert job["priority"] == 5
    assert job["params"]["width_mm"] == 80 and job["params"]["format"] == "stl"
    assert job["params"]["depth_mm"] == 5  # defaults are filled in and shown
    assert job["vram_mb"] >= 512
    assert job["attempt"] == 0 and job["max_attempts"] == 3

    again = await client.get(f"/jobs/{job['id']}")
    assert again.status_code == 200 and again.json()["id"] == job["id"]
    original = await client.get(f"/jobs/{job['id']}/input")
    assert original.status_code == 200
    assert original.content == image
    assert original.headers["content-type"] == "image/png"
    events = (await client.get(f"/jobs/{job['id']}/events")).json()
    assert [e["kind"] for e in events] == ["submitted"]
    assert await counts(engine) == (1, 1, 1)


async def test_same_image_is_stored_once(client, png, engine):
    image = png()
    first = await submit(client, image)
    second = await submit(client, image, params={"invert": True})
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] != second.json()["id"]
    jobs, inputs, _ = await counts(engine)
    assert (jobs, inputs) == (2, 1)


async def test_jpeg_and_webp_are_accepted_by_content(client, engine):
    import io

    from PIL import Image

    for fmt, media in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        buffer = io.BytesIO()
        Image.new("RGB", (32, 32), (10, 20, 30)).save(buffer, format=fmt)
        response = await submit(client, buffer.getvalue(), name="no-extension")
        assert response.status_code == 201, response.text
        stored = await client.get(f"/jobs/{response.json()['id']}/input")
        assert stored.headers["content-type"] == media


@pytest.mark.parametrize(
    ("form", "status", "needle"),
    [
        ({"model": "nope"}, 422, "nope"),
        ({"params": {"width_mm": 5}}, 422, "width_mm"),
        ({"params": {"colour": "red"}}, 422, "colour"),
        ({"params": {"format": "fbx"}}, 422, "format"),
        ({"params": {"invert": 1}}, 422, "invert"),
        ({"priority": 1000}, 422, "priority"),
        ({"priority": "high"}, 422, "priority"),
    ],
)
async def test_bad_submissions_are_refused_and_leave_nothing(client, png, engine, form, status, needle):
    model = form.pop("model", "relief")
    data = {"model": model, **{k: (json.dumps(v) if k == "params" else str(v)) for k, v in form.items()}}
    response = await client.post("/jobs", files={"image": ("a.png", png(), "image/png")}, data=data)
    assert response.status_code == status, response.text
    assert needle in json.dumps(response.json()["detail"])
    assert await counts(engine) == (0, 0, 0)


@pytest.mark.parametrize("params", ["{not json", "[1, 2]", '"text"'])
async def test_params_must_be_a_json_object(client, png, engine, params):
    response = await client.post(
        "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "relief", "params": params}
    )
    assert response.status_code == 422
    assert response.json()["detail"].startswith("params:")
    assert await counts(engine) == (0, 0, 0)


@pytest.mark.parametrize(
    "params",
    [
        '{"width_mm": 1' + "0" * 5000 + "}",  # more digits than Python converts to an int
        '{"width_mm": ' + "[" * 2000 + "]" * 2000 + "}",  # deeper than the JSON decoder recurses
        '{"format": "\\ud800"}',  # half a surrogate pair: not text PostgreSQL can store
        '{"\\udc00": 1}',
    ],
)
async def test_params_json_cannot_hold_are_422_not_500(client, png, engine, params):
    response = await client.post(
        "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "relief", "params": params}
    )
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith("params"), response.json()
    assert await counts(engine) == (0, 0, 0)


async def test_not_an_image_is_415_whatever_its_name(client, engine):
    response = await client.post(
        "/jobs",
        files={"image": ("photo.png", b"GIF89a-not-really" * 10, "image/png")},
        data={"model": "relief"},
    )
    assert response.status_code == 415
    assert "PNG, JPEG or WebP" in response.json()["detail"]
    gif = await client.post(
        "/jobs",
        files={"image": ("x.png", b"plain text, not an image", "image/png")},
        data={"model": "relief"},
    )
    assert gif.status_code == 415
    assert await counts(engine) == (0, 0, 0)


async def test_truncated_image_is_422(client, png, engine):
    image = png((200, 200))
    response = await client.post(
        "/jobs", files={"image": ("a.png", image[: len(image) // 2], "image/png")}, data={"model": "relief"}
    )
    assert response.status_code == 422
    assert "truncated or corrupt" in response.json()["detail"]
    assert await counts(engine) == (0, 0, 0)


async def test_oversized_upload_is_413_by_content_length(settings: Settings, engine):
    async with api_client(settings, max_upload_mb=0.05) as http:
        body = b"\0" * 200_000
        response = await http.post(
            "/jobs", files={"image": ("a.png", body, "image/png")}, data={"model": "relief"}
        )
        assert response.status_code == 413
        assert "limit" in response.json()["detail"]

        async def chunks():  # no Content-Length: the limit is enforced while streaming
            yield (
                b'--abc\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
                b"Content-Type: image/png\r\n\r\n"
            )
            for _ in range(100):
                yield b"x" * 65_536

        streamed = await http.post(
            "/jobs", content=chunks(), headers={"content-type": "multipart/form-data; boundary=abc"}
        )
        assert streamed.status_code == 413
    assert await counts(engine) == (0, 0, 0)


async def test_idempotency_key_returns_the_first_job(client, png, engine):
    headers = {"Idempotency-Key": "upload-42"}
    files = {"image": ("a.png", png(), "image/png")}
    first = await client.post("/jobs", files=files, data={"model": "relief"}, headers=headers)
    second = await client.post("/jobs", files=files, data={"model": "relief"}, headers=headers)
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    assert (await counts(engine))[0] == 1


async def test_queue_limit_answers_429_with_retry_after(settings, png, engine):
    async with api_client(settings, queue_limit=2) as http:
        for i in range(2):
            ok = await http.post(
                "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "relief"}
            )
            assert ok.status_code == 201, i
        full = await http.post(
            "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "relief"}
        )
        assert full.status_code == 429
        assert int(full.headers["retry-after"]) > 0
    assert (await counts(engine))[0] == 2


async def test_a_refused_submission_writes_nothing(settings, make_key, png, engine):
    """Queue full, the owner's share full: 429, and no job, image or event is stored."""
    async with api_client(settings, queue_limit=2) as http:
        for i in range(2):
            assert (await submit(http, png(color=(i, 9, 9)))).status_code == 201
        full = await submit(http, png(color=(7, 7, 7)))
        assert full.status_code == 429 and "queue is full" in full.json()["detail"]
    alice = await make_key("alice")
    async with api_client(settings, key=alice, queue_limit_per_key=1) as http:
        assert (await submit(http, png(color=(8, 8, 8)))).status_code == 201
        mine = await submit(http, png(color=(9, 9, 9)))
        assert mine.status_code == 429 and "1 jobs waiting" in mine.json()["detail"]
    assert await counts(engine) == (3, 3, 3)


async def test_a_repeated_key_stores_nothing_new(client, png, engine):
    headers = {"Idempotency-Key": "same"}
    image, params = png(color=(1, 2, 3)), {"width_mm": 80}
    first = await submit(client, image, params=params, headers=headers)
    again = await submit(client, image, name="renamed.png", params={"width_mm": 80.0}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert await counts(engine) == (1, 1, 1)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"image": png_bytes(color=(4, 5, 6))}, "image"),
        ({"model": "toy", "params": {}}, "model"),
        ({"params": {"width_mm": 90}}, "params"),
        ({"priority": 3}, "priority"),
    ],
)
async def test_a_key_reused_for_another_request_is_409(client, png, engine, change, named):
    """The key names one request: sent again with another image, model, params or priority it is
    refused, rather than answered with a job made from something else."""
    headers = {"Idempotency-Key": "reused"}
    first = await submit(client, png(color=(1, 2, 3)), params={"width_mm": 80}, headers=headers)
    assert first.status_code == 201, first.text
    request: dict[str, Any] = {"image": png(color=(1, 2, 3)), "params": {"width_mm": 80}, **change}
    again = await submit(client, request.pop("image"), headers=headers, **request)
    assert again.status_code == 409, again.text
    detail = again.json()["detail"]
    assert "Idempotency-Key" in detail and first.json()["id"] in detail and named in detail, detail
    assert await counts(engine) == (1, 1, 1)


async def test_an_empty_idempotency_key_is_refused(client, png, engine):
    """An empty key would make every upload that sends one a repeat of the first."""
    answer = await submit(client, png(), headers={"Idempotency-Key": ""})
    assert answer.status_code == 422, answer.text
    assert "idempotency-key" in json.dumps(answer.json()["detail"]).lower()
    assert await counts(engine) == (0, 0, 0)


async def test_concurrent_repeats_of_a_key_make_one_job(client, png, engine):
    headers = {"Idempotency-Key": "race"}
    files = {"image": ("a.png", png(), "image/png")}
    answers = await asyncio.gather(
        *(client.post("/jobs", files=files, data={"model": "relief"}, headers=headers) for _ in range(6))
    )
    assert sorted(a.status_code for a in answers) == [200] * 5 + [201]
    assert len({a.json()["id"] for a in answers}) == 1
    assert (await counts(engine))[:2] == (1, 1)


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    found, pos = [], 8
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        found.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return found


def _png_of(parts: list[tuple[bytes, bytes]]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    return b"\x89PNG\r\n\x1a\n" + b"".join(chunk(kind, data) for kind, data in parts)


async def test_damaged_pngs_are_422_without_a_full_decode(client, png, engine):
    good = png((200, 120))
    bad_crc = bytearray(good)
    bad_crc[-20] ^= 1  # in the image data: only its CRC tells
    parts = _png_chunks(good)
    stream = b"".join(d for k, d in parts if k == b"IDAT")
    others = [(k, d) for k, d in parts if k != b"IDAT"]
    cut_short = _png_of([*others[:-1], (b"IDAT", stream[: len(stream) // 2]), others[-1]])  # IEND after it
    for image, reason in ((bytes(bad_crc), "CRC"), (cut_short, "ends early")):
        response = await submit(client, image)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert "truncated or corrupt" in detail and reason in detail, detail
    assert await counts(engine) == (0, 0, 0)


@pytest.mark.parametrize("declared", [True, False])
async def test_uploads_over_a_megabyte_are_stored_whole(client, engine, declared):
    """Kept in memory when the length is declared, spooled to disk when it is not (chunked)."""
    pixels = np.random.default_rng(3).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    image = buffer.getvalue()
    assert len(image) > 1 << 20
    head = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nrelief\r\n'
        b'--b\r\nContent-Disposition: form-data; name="image"; filename="big.png"\r\n'
        b"Content-Type: image/png\r\n\r\n"
    )
    body = head + image + b"\r\n--b--\r\n"

    async def pieces():
        for start in range(0, len(body), 100_000):
            yield body[start : start + 100_000]

    response = await client.post(
        "/jobs",
        content=body if declared else pieces(),
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert response.status_code == 201, response.text
    stored = await client.get(f"/jobs/{response.json()['id']}/input")
    assert stored.content == image
    assert await counts(engine) == (1, 1, 1)


async def test_listing_pages_through_fifty_jobs(client, png):
    created = []
    for i in range(50):
        response = await client.post(
            "/jobs", files={"image": ("a.png", png(color=(i, 1, 2)), "image/png")}, data={"model": "relief"}
        )
        created.append(response.json()["id"])
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 20}
        if cursor:
            params["cursor"] = cursor
        page = (await client.get("/jobs", params=params)).json()
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == list(reversed(created))  # newest first, none twice, none missing
    filtered = (await client.get("/jobs", params={"state": "running"})).json()
    assert filtered["jobs"] == []
    by_model = (await client.get("/jobs", params={"model": "relief", "limit": 200})).json()
    assert len(by_model["jobs"]) == 50
    bad = await client.get("/jobs", params={"cursor": "garbage!"})
    assert bad.status_code == 422


@pytest.mark.parametrize(
    "at", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-01-01T00:00:00"]
)
async def test_a_cursor_with_a_time_postgresql_cannot_hold_is_422(client, at):
    """A cursor is the client's to send back: one edited to a time out of PostgreSQL's range (or
    without its offset) is refused as a cursor, not a 500 from the database."""
    import base64
    import uuid

    cursor = base64.urlsafe_b64encode(f"{at}|{uuid.uuid4()}".encode()).decode().rstrip("=")
    answer = await client.get("/jobs", params={"cursor": cursor})
    assert answer.status_code == 422, answer.text
    assert "cursor" in answer.text


async def test_unknown_job_is_404(client):
    import uuid

    for path in ("", "/input", "/events"):
        response = await client.get(f"/jobs/{uuid.uuid4()}{path}")
        assert response.status_code == 404, path
    assert (await client.get("/jobs/not-a-uuid")).status_code == 422


async def test_openapi_describes_the_api(client):
    schema = (await client.get("/openapi.json")).json()
    for path in (
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/input",
        "/jobs/{job_id}/events",
        "/models",
        "/files/{job_id}/{name}",
        "/jobs/{job_id}/cancel",
        "/admin/jobs/{job_id}/retry",
    ):
        assert path in schema["paths"], path
    post = schema["paths"]["/jobs"]["post"]
    assert {"201", "413", "415", "422", "429"} <= set(post["responses"])
    assert (await client.get("/docs")).status_code == 200


async def test_an_enqueue_counts_the_jobs_waiting_only_near_the_limit(manager, engine):
    """Counting reads an index entry per job waiting, so far from the limit a recent count decides;
    in the limit's last tenth (at least 100 jobs) every enqueue counts, and the limit is exact."""
    for _ in range(150):
        await enqueue(manager, queue_limit=150)
    with pytest.raises(errors.QueueFull):
        await enqueue(manager, queue_limit=150)
    other = JobManager(engine)  # another API process, with a count of its own
    with pytest.raises(errors.QueueFull):
        await enqueue(other, queue_limit=150)
    assert manager.waiting.known == other.waiting.known == 150

    far = JobManager(engine)
    far.waiting.REFRESH_S = 60.0  # the test may be slow: keep the first count for its length
    await enqueue(far, queue_limit=100_000)
    assert far.waiting.known == 151  # counted: 150, then its own
    for _ in range(3):
        await enqueue(manager, queue_limit=100_000)  # queued by another process
    await enqueue(far, queue_limit=100_000)
    assert far.waiting.known == 152  # not counted again: its own jobs only
    far.waiting.REFRESH_S = 0.0
    await enqueue(far, queue_limit=100_000)
    assert far.waiting.known == 156  # counted again: 155 waiting, then its own


async def test_an_image_deleted_between_reading_its_job_and_itself_is_gone(manager):
    """Retention may delete an input after its job was read: 410, as for a job read later."""
    with pytest.raises(errors.Gone):
        await manager.inputs.by_id(2**31 - 1)
    assert await manager.inputs.sha256(2**31 - 1) is None


@pytest.mark.parametrize(
    ("parts", "needle"),
    [
        ([("param", '{"steps": 3}')], "unknown form field 'param'"),
        ([("priorty", "50")], "unknown form field 'priorty'"),
        ([("params", '{"steps": 3}'), ("params", '{"steps": 9}')], "form field 'params' was sent 2 times"),
        ([("priority", "50"), ("priority", "-50")], "form field 'priority' was sent 2 times"),
        ([("model", "relief")], "form field 'model' was sent 2 times"),
    ],
    ids=["misspelt-params", "misspelt-priority", "params-twice", "priority-twice", "model-twice"],
)
async def test_a_form_field_misspelt_or_sent_twice_is_422_not_quietly_dropped(
    client, png, engine, parts, needle
):
    """A misspelt `params` queued the job with the model's defaults (GPU time for a mesh nobody
    asked for), a misspelt `priority` at 0; a field sent twice quietly took its last value. Now
    each is 422, naming the field, and nothing is stored."""
    files = [("image", ("a.png", png(), "image/png")), ("model", (None, "toy"))]
    files += [(name, (None, value)) for name, value in parts]
    response = await client.post("/jobs", files=files)
    assert response.status_code == 422, response.text
    assert needle in response.json()["detail"]
    assert await counts(engine) == (0, 0, 0)


async def test_an_empty_priority_is_422_not_the_default(client, png, engine):
    """A form whose `priority` field was sent empty queued the job at 0, as if it had been left out
    (FastAPI reads an empty form value as missing): a client that meant to send one is told."""
    files = [("image", ("a.png", png(), "image/png")), ("model", (None, "toy")), ("priority", (None, ""))]
    response = await client.post("/jobs", files=files)
    assert response.status_code == 422, response.text
    assert "form field 'priority' is empty" in response.json()["detail"]
    assert await counts(engine) == (0, 0, 0)


async def test_an_empty_model_is_422_saying_it_is_empty_not_field_required(client, png, engine):
    """`-F model=` (a script's unset variable) was answered FastAPI's "Field required" with `loc:
    ["body", "model"]`: the client did send the field, and read that it did not."""
    files = [("image", ("a.png", png(), "image/png")), ("model", (None, ""))]
    response = await client.post("/jobs", files=files)
    assert response.status_code == 422, response.text
    assert (
        response.json()["detail"]
        == "form field 'model' is empty: send a model's name (GET /models lists them)"
    )
    assert await counts(engine) == (0, 0, 0)


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("status=failed", "unknown query parameter 'status'"),
        ("modle=relief", "unknown query parameter 'modle'"),
        ("state=queued&state=failed", "query parameter 'state' was sent 2 times"),
    ],
)
async def test_a_list_filter_misspelt_or_sent_twice_is_422(client, png, query, needle):
    """`GET /jobs?status=failed` listed every job, as if the filter were met; `state=queued&state=failed`
    listed the failed ones alone. Now each is 422, naming the parameter."""
    await submit(client, png(), model="toy")
    answer = await client.get(f"/jobs?{query}")
    assert answer.status_code == 422, answer.text
    assert needle in answer.json()["detail"]
    assert (await client.get("/jobs?state=queued&model=toy&limit=5")).json()["jobs"]


@pytest.mark.parametrize("name", ["state", "model"])
async def test_an_empty_list_filter_is_422_naming_it(client, png, name):
    """`GET /jobs?model=` (an empty value) listed no job, as if the filter were a model's name, while
    `state=` was 422: an empty filter reads as a mistake, so both are now 422, naming the filter."""
    await submit(client, png(), model="toy")
    answer = await client.get(f"/jobs?{name}=")
    assert answer.status_code == 422, answer.text
    assert [e["loc"] for e in answer.json()["detail"]] == [["query", name]], answer.text


@pytest.mark.parametrize("value", [1e23, 1e300, 123456789012345680.0, -2.5e-7])
async def test_a_repeat_with_a_large_float_param_is_the_same_request(manager: JobManager, value: float):
    """PostgreSQL keeps a JSON number by its decimal value, so 1e23 comes back as the integer
    100000000000000000000000, which Python's float 1e23 (99999999999999991611392) does not equal:
    the same request sent again got 409 "different params"."""
    image = images.inspect(png_bytes(), max_pixels=10**8)
    new = records.NewJob(
        "erin", "toy", {"x": value, "nested": [value, {"y": value}]}, 0, 1000, 3, idempotency_key="f"
    )
    job, created = await manager.enqueue(new, image, queue_limit=10_000)
    assert created
    again, created = await manager.enqueue(new, image, queue_limit=10_000)
    assert (again.id, created) == (job.id, False)
    await intake.check_repeat(manager, again, new, image)  # no Conflict
    with pytest.raises(errors.Conflict, match="whose params differs"):
        await intake.check_repeat(manager, again, dataclasses.replace(new, params={"x": value * 2}), image)


@pytest.mark.parametrize("cut", [16, 24, 28])
async def test_a_png_cut_off_inside_its_header_is_422(client, png, engine, cut):
    """A PNG ending inside its IHDR chunk was a 500 (the header's fields unpacked from too few bytes)."""
    response = await submit(client, png((64, 64))[:cut])
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith("image: the file is truncated or corrupt"), response.text
    assert await counts(engine) == (0, 0, 0)


async def test_a_phone_jpeg_with_an_mpf_extension_is_stored_as_a_jpeg_and_runs(settings, engine):
    """A JPEG with an MPF extension (phones write them; Pillow calls them MPO) was refused 415."""
    from tests.integration.test_end_to_end import wait_for

    first, second = Image.new("RGB", (64, 32), (200, 100, 50)), Image.new("RGB", (64, 32), (0, 0, 0))
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second])
    image = buffer.getvalue()
    async with api_client(settings, run_worker=True) as client:
        response = await submit(client, image, name="IMG_0001.JPG", params={"resolution": 32})
        assert response.status_code == 201, response.text
        stored = await client.get(f"/jobs/{response.json()['id']}/input")
        assert stored.headers["content-type"] == "image/jpeg" and stored.content == image
        job = await wait_for(client, response.json()["id"], {"succeeded", "failed"})
        assert job["state"] == "succeeded", job["error"]


async def test_images_checked_side_by_side_hold_at_most_one_largest_images_pixels(client, monkeypatch):
    """A WebP of 64 MP is about 110 KB, and its check decodes every pixel (192 MB). Uploads of such
    files were checked side by side without a bound: four at once, within one key's uploads in
    progress, held four times that in the API process, which also runs the worker under `serve`.
    The checks now share a budget of one largest image's pixels (GPUJOBS_MAX_IMAGE_MEGAPIXELS)."""
    import threading

    checking = {"now": 0, "most": 0}
    lock = threading.Lock()
    inspect = images.inspect

    def counted(data: bytes, *, max_pixels: int) -> records.NewInput:
        with Image.open(io.BytesIO(data)) as image:
            pixels = image.width * image.height
        with lock:
            checking["now"] += pixels
            checking["most"] = max(checking["most"], checking["now"])
        try:
            return inspect(data, max_pixels=max_pixels)
        finally:
            with lock:
                checking["now"] -= pixels

    monkeypatch.setattr(images, "inspect", counted)
    pictures = []
    for shade in range(2):  # 36 MP each: two at once would hold 72
        picture = io.BytesIO()
        Image.new("RGB", (6000, 6000), (shade, 2, 3)).save(picture, format="WEBP", quality=5)
        pictures.append(picture.getvalue())
    answers = await asyncio.gather(*(submit(client, p, name="in.webp") for p in pictures))
    assert [a.status_code for a in answers] == [201] * 2, [a.text for a in answers]
    assert checking["most"] <= 64_000_000, f"{checking['most'] / 1e6:g} MP held at once"
