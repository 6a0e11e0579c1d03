"""The in-memory form parser of POST /jobs: one copy of the file, read back as a view."""

from __future__ import annotations

import asyncio
import os
import time
import tracemalloc

import pytest
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException

from app.api import limits

BOUNDARY = b"the-boundary"


def form(*images: bytes, fields: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A multipart body: the text fields, then each image as a file part named "image"."""
    field = b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n'
    file = b'--%s\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n' % BOUNDARY
    parts = [field % (BOUNDARY, k.encode(), v.encode()) for k, v in fields]
    parts += [file + b"Content-Type: image/png\r\n\r\n%s\r\n" % image for image in images]
    return b"".join(parts) + b"--%s--\r\n" % BOUNDARY


async def parse(body: bytes, piece: int, **options: int) -> object:
    async def chunks():
        for start in range(0, len(body), piece):
            yield body[start : start + piece]

    headers = Headers({"content-type": f"multipart/form-data; boundary={BOUNDARY.decode()}"})
    parser = limits.InMemoryParser(headers, chunks(), capacity=len(body), **options)
    return await parser.parse()


@pytest.mark.asyncio
@pytest.mark.parametrize("piece", [7, 4096, 65_536, 1 << 30])  # boundaries split across chunks, or one chunk
async def test_a_form_file_is_kept_in_one_buffer_and_read_back_as_a_view(piece):
    image = os.urandom(300_000) + b"\r\n--not-the-boundary\r\n" + os.urandom(1000)
    parsed = await parse(form(image, fields=(("model", "relief"), ("priority", "3"))), piece)
    assert parsed["model"] == "relief" and parsed["priority"] == "3"
    upload = parsed["image"]
    assert isinstance(upload, UploadFile) and isinstance(upload.file, limits.PartBuffer)
    assert upload.filename == "a.png" and upload.size == len(image)
    view = upload.file.read(10**9)
    assert isinstance(view, memoryview) and view.readonly and view == image
    upload.file.seek(0)
    again = upload.file.read(10**9)
    assert again.obj is view.obj  # the same buffer: reading copies nothing
    assert upload.file.read(10) == b"" and upload.file.tell() == len(image)


@pytest.mark.asyncio
async def test_the_parsers_limits_still_hold():
    with pytest.raises(MultiPartException, match="Too many files"):
        await parse(form(b"a", b"b"), 4096, max_files=1)
    with pytest.raises(MultiPartException, match="Part exceeded maximum size"):
        await parse(form(b"a", fields=(("params", "x" * 70_000),)), 4096, max_part_size=64 * 1024)


def test_a_part_buffer_refuses_more_than_its_capacity():
    buffer = limits.PartBuffer(4)
    assert buffer.write(b"abc") == 3
    with pytest.raises(ValueError, match="Content-Length"):
        buffer.write(b"de")
    assert buffer.seek(0) == 0 and buffer.read() == b"abc"


def test_a_part_buffer_holds_what_was_written_not_its_capacity():
    """The capacity is the body's declared length: a client that declares 20 MB and sends a few
    bytes, then stalls, must not make the server hold 20 MB (a few hundred such uploads, gigabytes)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        buffer = limits.PartBuffer(20 << 20)
        buffer.write(b"\x89PNG")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 64 * 1024, f"{held} bytes held for 4 written"
    chunk = os.urandom(65_536)
    for _ in range(40):
        buffer.write(chunk)
    buffer.seek(2)
    buffer.write(b"ng")  # overwrites in place, as a file does
    assert buffer.seek(0) == 0 and buffer.read() == b"\x89Png" + chunk * 40


@pytest.mark.asyncio
async def test_the_drain_after_a_refusal_is_bounded_in_bytes_and_time():
    """It read until the body ended: a client declaring 1 GB and sending slowly held it forever."""
    read = 0

    async def endless() -> dict[str, object]:  # a client that keeps sending 64 kB pieces
        nonlocal read
        read += 1
        return {"type": "http.request", "body": b"\0" * 65_536, "more_body": True}

    await limits.drain(endless, max_bytes=1 << 20)
    assert read == 16

    async def stalled() -> dict[str, object]:  # a client that sends nothing more
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    started = time.monotonic()
    await limits.drain(stalled, max_s=0.2)
    assert time.monotonic() - started < 1
