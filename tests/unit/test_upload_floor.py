"""The upload benchmark's floor line (tests/bench/upload_floor.py) stores exactly the image the
bench sends, cut from the body the bench's clients send."""

from __future__ import annotations

from tests.bench import bench_throughput as bt
from tests.bench import upload_floor


def bench_body(image: bytes) -> bytes:
    return bt.UPLOAD_HEAD + image + bt.UPLOAD_TAIL


def test_the_image_part_is_the_uploaded_png_byte_for_byte() -> None:
    picture = bt.Picture.noise(50_000)
    image = picture.variant(7)
    scope = {"headers": [(b"content-type", f"multipart/form-data; boundary={bt.BOUNDARY}".encode())]}

    part = upload_floor._image_part(bench_body(image), upload_floor._boundary(scope))

    assert part is not None
    assert bytes(part) == image


def test_a_png_holding_blank_lines_is_cut_at_its_own_start() -> None:
    image = b"\x89PNG\r\n\x1a\n" + b"\r\n\r\n" * 3 + b"end"

    part = upload_floor._image_part(bench_body(image), bt.BOUNDARY.encode())

    assert part is not None and bytes(part) == image


def test_a_body_without_its_boundary_or_image_has_no_part() -> None:
    image = bt.Picture.noise(10_000).data

    assert upload_floor._image_part(bench_body(image), b"") is None
    assert upload_floor._image_part(bench_body(image), b"another-boundary") is None
    assert upload_floor._image_part(bt.UPLOAD_HEAD + bt.UPLOAD_TAIL, bt.BOUNDARY.encode()) is None
