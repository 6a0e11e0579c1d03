"""Uploaded images: read with a size cap, identify by content, reject bombs and broken files."""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from app import errors
from app.queue.manager import NewInput

ACCEPTED = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
# How accepted files begin: one that begins so but cannot be identified is cut short, not foreign.
SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF")
CHUNK = 1 << 20


def read_capped(stream: BinaryIO, max_bytes: int) -> bytes:
    """Read a (spooled) upload, refusing it as soon as it passes `max_bytes`."""
    buffer = bytearray()
    while chunk := stream.read(CHUNK):
        buffer += chunk
        if len(buffer) > max_bytes:
            raise errors.PayloadTooLarge(
                f"the image is larger than the {max_bytes / 1024 / 1024:g} MB limit; send a smaller file"
            )
    return bytes(buffer)


def inspect(data: bytes, *, max_pixels: int) -> NewInput:
    """Check the bytes are a whole PNG, JPEG or WebP image within the pixel limit."""
    if not data:
        raise errors.InvalidRequest("image: the file is empty", field="image")
    try:
        with warnings.catch_warnings():  # the pixel limit below is ours; PIL's warning is not needed
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as probe:
                kind, (width, height) = probe.format, probe.size
    except UnidentifiedImageError as exc:
        if data.startswith(SIGNATURES) and (not data.startswith(b"RIFF") or data[8:12] == b"WEBP"):
            raise errors.InvalidRequest("image: the file is truncated or corrupt", field="image") from exc
        raise errors.UnsupportedMedia(
            "image: not a PNG, JPEG or WebP image (the type is read from the content, not the name)"
        ) from exc
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise errors.InvalidRequest(f"image: cannot be read ({exc})", field="image") from exc
    if kind not in ACCEPTED:
        raise errors.UnsupportedMedia(f"image: {kind} images are not accepted; send PNG, JPEG or WebP")
    if width * height > max_pixels:
        raise errors.InvalidRequest(
            f"image: {width}x{height} is {width * height / 1e6:.1f} megapixels, over the "
            f"{max_pixels / 1e6:g} megapixel limit",
            field="image",
        )
    _decode_fully(data, max_pixels)
    return NewInput(hashlib.sha256(data).hexdigest(), ACCEPTED[kind], width, height, data)


def _decode_fully(data: bytes, max_pixels: int) -> None:
    """Decode every pixel, so truncated or corrupt files are refused now, not in the model."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > max_pixels:
                    raise errors.InvalidRequest("image: too many pixels", field="image")
                image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
            raise errors.InvalidRequest(
                f"image: the file is truncated or corrupt ({exc}); upload it again", field="image"
            ) from exc
